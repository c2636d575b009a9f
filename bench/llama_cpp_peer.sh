#!/usr/bin/env bash
# Runs the llama.cpp peer of vlmgen's speed report on a Qwen2-VL checkpoint and prints one JSON
# object: {"checkpoint": ..., "f32": {peer figures}, "f16": {...}, "q8_0": {...}}.
#
#   [DTYPES="f32 f16 q8_0"] bash bench/llama_cpp_peer.sh CHECKPOINT_DIR [peer options...]
#
# CHECKPOINT_DIR: an HF-style Qwen2-VL checkpoint, e.g. the bench's 100M model written by
# `build/bench/vlmgen-bench --write-checkpoint DIR`. Peer options (bench/llama_cpp_peer.mjs)
# override the defaults --threads 1 --contexts 128,512,2048 --prefill 512,2048
# --greedy-length 16 --greedy-new 16 (timing with llama.cpp's defaults: f16 KV cache, flash
# attention auto; the greedy run in a context of its own with f32 KV, flash attention off). Steps:
#   1. node-llama-cpp 3.21.1 with only its prebuilt CPU binaries (@node-llama-cpp/linux-x64) into
#      build/npm-llama, unless already there: `npm install` from the npm registry, install
#      scripts skipped (so nothing is downloaded from elsewhere or compiled), ~85 MB, ~15-40 s;
#   2. bench/gguf_writer.py writes a GGUF of the language model per weights type in DTYPES
#      (default "f32 f16 q8_0"; any of f32, f16, q8_0) into a scratch folder
#      (LLAMA_PEER_SCRATCH, default a fresh temporary one, removed at exit);
#   3. bench/llama_cpp_peer.mjs runs on each (one process per dtype).
# Check the greedy tokens against vlmgen with:
#   bash bench/llama_cpp_peer.sh DIR > peer.json && /usr/bin/python3 bench/llama_cpp_check.py DIR peer.json
# Progress goes to stderr; stdout holds only the JSON.
set -euo pipefail

say() { echo "[llama-cpp-peer] $*" >&2; }
die() { say "error: $*"; exit 1; }

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  [ $# -ge 1 ] && exit 0 || exit 2
fi
ckpt="$1"
shift
[ -f "$ckpt/config.json" ] || die "$ckpt/config.json not found (expected an HF-style Qwen2-VL checkpoint)"
dtypes="${DTYPES:-f32 f16 q8_0}"
for dtype in $dtypes; do
  case "$dtype" in f32 | f16 | q8_0) ;; *) die "DTYPES: unknown weights type '$dtype' (f32, f16, q8_0)" ;; esac
done
[ -n "${dtypes// /}" ] || die "DTYPES is empty"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
npm_dir="$root/build/npm-llama"
version="3.21.1"
python="${PYTHON:-/usr/bin/python3}"

command -v node > /dev/null 2>&1 || die "node not found (node-llama-cpp $version needs node >= 20)"
node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 20 ? 0 : 1)' ||
  die "node $(node --version) is older than 20, which node-llama-cpp $version needs"
[ -x "$python" ] || command -v "$python" > /dev/null 2>&1 || die "$python not found (set PYTHON)"

installed() {
  [ -f "$npm_dir/node_modules/node-llama-cpp/package.json" ] &&
    [ -d "$npm_dir/node_modules/@node-llama-cpp/linux-x64/bins" ] &&
    node -e 'process.exit(require(process.argv[1]).version === process.argv[2] ? 0 : 1)' \
      "$npm_dir/node_modules/node-llama-cpp/package.json" "$version"
}

if ! installed; then
  command -v npm > /dev/null 2>&1 || die "npm not found"
  say "installing node-llama-cpp@$version (prebuilt CPU binaries only) into $npm_dir"
  mkdir -p "$npm_dir"
  start=$(date +%s)
  # --omit=optional drops the CUDA/Vulkan/other-platform binary packages (~650 MB); the CPU one
  # is named explicitly so it stays. --ignore-scripts: node-llama-cpp's postinstall would try
  # to download and build llama.cpp when its prebuilt binary does not load; the peer loads the
  # prebuilt one with build: "never". NODE_LLAMA_CPP_SKIP_DOWNLOAD guards the same in case a
  # script runs anyway.
  NODE_LLAMA_CPP_SKIP_DOWNLOAD=true npm install --prefix "$npm_dir" --no-audit --no-fund \
    --ignore-scripts --save-exact --omit=optional \
    "node-llama-cpp@$version" "@node-llama-cpp/linux-x64@$version" >&2 ||
    die "npm install failed (the npm registry must be reachable)"
  installed || die "npm install finished but node-llama-cpp $version / @node-llama-cpp/linux-x64 is missing"
  say "installed in $(( $(date +%s) - start )) s, $(du -sh "$npm_dir" | cut -f1)"
fi

if [ -n "${LLAMA_PEER_SCRATCH:-}" ]; then
  scratch="$LLAMA_PEER_SCRATCH"
  mkdir -p "$scratch"
else
  scratch="$(mktemp -d "${TMPDIR:-/tmp}/llama-cpp-peer.XXXXXX")"
  trap 'rm -rf "$scratch"' EXIT
fi

# Prompt ids stay below the vocabulary, every image/vision token id and 16000 (as in vlmgen's bench).
limit="$("$python" -c '
import json, sys
c = json.load(open(sys.argv[1]))
t = c.get("text_config") or {}
ids = [c.get("vocab_size", t.get("vocab_size")), 16000] + [c.get(k) for k in
       ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")]
print(min(int(i) for i in ids if i is not None))' "$ckpt/config.json")"

outputs=()
for dtype in $dtypes; do
  gguf="$scratch/model-$dtype.gguf"
  say "writing $gguf"
  "$python" "$root/bench/gguf_writer.py" "$ckpt" "$gguf" --dtype "$dtype"
  say "running the peer on the $dtype GGUF"
  out="$scratch/peer-$dtype.json"
  node "$root/bench/llama_cpp_peer.mjs" --model "$gguf" --llama-dir "$npm_dir" --id-limit "$limit" \
    --threads 1 --contexts 128,512,2048 --prefill 512,2048 --greedy-length 16 --greedy-new 16 \
    "$@" > "$out" || die "the peer failed on $gguf"
  outputs+=("$dtype" "$out")
done

node -e '
const fs = require("fs");
const [ckpt, ...rest] = process.argv.slice(1);
const out = {checkpoint: ckpt};
for (let i = 0; i < rest.length; i += 2) out[rest[i]] = JSON.parse(fs.readFileSync(rest[i + 1], "utf8"));
process.stdout.write(JSON.stringify(out, null, 1) + "\n");
' "$(cd "$ckpt" && pwd)" "${outputs[@]}"
