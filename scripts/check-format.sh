#!/usr/bin/env bash
# Checks that every C++ file of the repository follows .clang-format (clang-format 14, Debian 12).
#   bash scripts/check-format.sh         # lists the files that differ; exit 1 when any does
#   bash scripts/check-format.sh --fix   # rewrites them in place
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v clang-format >/dev/null; then
  sudo_cmd=()
  if [ "$(id -u)" != 0 ]; then sudo_cmd=(sudo); fi
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends clang-format
fi
mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.hpp' '*.cc')
if [ "${1:-}" = "--fix" ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  if ! clang-format --dry-run --Werror "$f" >/dev/null 2>&1; then bad+=("$f"); fi
done
if ((${#bad[@]})); then
  echo "[check-format] ${#bad[@]} of ${#files[@]} files differ from .clang-format (fix: bash scripts/check-format.sh --fix):"
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
echo "[check-format] ${#files[@]} files follow .clang-format"
