#!/usr/bin/env bash
# One entry point for a fresh Debian 12 machine: installs what is missing (apt-get), builds,
# then runs the main example or the whole test suite.
#
#   bash scripts/dev.sh demo [IMAGE...]   # install + build + run the main example (vlmgen-demo)
#   bash scripts/dev.sh test     # install + build + run every test (ctest)
#   bash scripts/dev.sh sanitize # clang + AddressSanitizer/UBSan build of the core and model tests
#                                # and the fuzz targets (build-asan); runs the tests, then each
#                                # fuzzer for FUZZ_SECONDS on its seed corpus (fuzz/README.md)
#
# Environment: BUILD_DIR (default: build), BUILD_TYPE (default: Release), JOBS (default: nproc);
# for sanitize: ASAN_BUILD_DIR (default: build-asan), FUZZ_SECONDS (default: 30),
# ASAN_MODEL_TEST_FILTER (gtest filter for the model tests, default: all of them).
set -euo pipefail

cd "$(dirname "$0")/.."
what="${1:-}"
case "$what" in
  demo|test|sanitize) ;;
  *) echo "usage: bash scripts/dev.sh demo|test|sanitize" >&2; exit 2 ;;
esac

build_dir="${BUILD_DIR:-build}"
build_type="${BUILD_TYPE:-Release}"
jobs="${JOBS:-$(nproc)}"

# libopenblas0-pthread: without it LibTorch's CPU matrix products run tens of times slower.
# python3-torch, pybind11-dev, python3-pytest: the Python module and its tests (python/, tests/python).
packages=(cmake ninja-build g++ ccache pkg-config libtorch-dev libfmt-dev libgtest-dev libgmock-dev
          libopenblas0-pthread nlohmann-json3-dev libstb-dev libcli11-dev libbenchmark-dev libgloo-dev
          libpcre2-dev libutf8proc-dev libcpp-httplib-dev libssl-dev
          python3-dev python3-torch pybind11-dev python3-pytest)
# node/npm run the tokenizer reference tests (scripts/npm-deps.sh). A node from elsewhere
# (NodeSource ships npm inside its nodejs package) is kept: apt's npm would conflict with it.
if ! command -v node > /dev/null 2>&1 || ! command -v npm > /dev/null 2>&1; then
  packages+=(nodejs npm)
fi
# The sanitizer build: clang, and compiler-rt's ASan/UBSan runtimes and libFuzzer.
if [ "$what" = sanitize ]; then packages+=(clang libclang-rt-14-dev); fi
missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "[dev.sh] installing: ${missing[*]}"
  sudo_cmd=()
  if [ "$(id -u)" != 0 ]; then sudo_cmd=(sudo); fi
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ "$what" = sanitize ]; then
  exec bash scripts/sanitize.sh
fi

echo "[dev.sh] configuring $build_dir ($build_type)"
mkdir -p "$build_dir"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE="$build_type" > "$build_dir/configure.log" 2>&1 ||
  { cat "$build_dir/configure.log"; exit 1; }
if [ "$what" = test ]; then bash scripts/npm-deps.sh "$build_dir"; fi
echo "[dev.sh] building with $jobs jobs"
start=$(date +%s)
cmake --build "$build_dir" -j "$jobs"
echo "[dev.sh] built in $(( $(date +%s) - start )) s"

if [ "$what" = demo ]; then
  # The main job: the shipped grounded captioner, with and without a KV cache and under the
  # legacy step-0 gate. Extra arguments (PNG/JPEG files) are captioned too.
  shift
  exec "$build_dir/tools/vlmgen-demo" "$@"
fi
cd "$build_dir"
# LibTorch's OpenMP threads otherwise spin against OpenBLAS's (see README, "Speed").
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec ctest --output-on-failure -j "$jobs"
