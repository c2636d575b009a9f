#!/usr/bin/env bash
# The sanitizer step of CI (run through `bash scripts/dev.sh sanitize`, which installs clang and
# compiler-rt first): one clang build folder with AddressSanitizer + UndefinedBehaviorSanitizer
# holding the library, the core and model tests and the fuzz targets (the library is compiled
# once for all of them; LibTorch stays uninstrumented), then
#   1. the core and model tests under the sanitizers,
#   2. each fuzz target for FUZZ_SECONDS on its seed corpus (fuzz/corpus/<target>, read only;
#      what a run finds goes to $ASAN_BUILD_DIR/fuzz/corpus/<target>, kept between runs).
# Any sanitizer report, failed test or fuzzer crash fails the step.
set -euo pipefail

cd "$(dirname "$0")/.."
dir="${ASAN_BUILD_DIR:-build-asan}"
jobs="${JOBS:-$(nproc)}"
fuzz_seconds="${FUZZ_SECONDS:-30}"
model_filter="${ASAN_MODEL_TEST_FILTER:-*}"

echo "[sanitize] configuring $dir (clang, -fsanitize=address,undefined, fuzzers)"
mkdir -p "$dir"
# -O1 -g1: ASan's usual optimisation level (readable stacks, fast enough), line tables only.
# -fno-pch-timestamp and the ccache sloppiness below let ccache cache the files that use the
# precompiled ATen/GoogleTest header; without them every test file is a cache miss.
CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -Xclang -fno-pch-timestamp" \
  -DVLMGEN_SANITIZE=address,undefined -DVLMGEN_BUILD_FUZZERS=ON \
  -DVLMGEN_BUILD_EXAMPLES=OFF -DVLMGEN_BUILD_BENCHMARKS=OFF -DVLMGEN_INSTALL=OFF -DVLMGEN_BUILD_PYTHON=OFF \
  > "$dir/configure.log" 2>&1 || { cat "$dir/configure.log"; exit 1; }
export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"

# Runtime options (also used by the test discovery that runs during the build).
# LibTorch is not instrumented, and needs nothing switched off: leak detection stays on (its
# static registries are still reachable at exit, so LeakSanitizer reports only what is really
# lost), ODR checking stays on (only instrumented globals are checked, i.e. ours), and the
# shadow gap stays protected (nothing maps memory at fixed addresses on CPU; CUDA would).
# Added on top of the defaults: use-after-return (views and string_views of temporaries), static
# initialisation order, and strict string checks.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:strict_string_checks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# LibTorch's OpenMP threads otherwise spin against OpenBLAS's (see README, "Speed").
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"

start=$(date +%s)
echo "[sanitize] building the tests and fuzz targets with $jobs jobs"
cmake --build "$dir" -j "$jobs" --target vlmgen_core_tests vlmgen_model_tests vlmgen_fuzzers
built=$(date +%s)
echo "[sanitize] built in $((built - start)) s"

"$dir/tests/vlmgen_core_tests" --gtest_brief=1
"$dir/tests/vlmgen_model_tests" --gtest_brief=1 --gtest_filter="$model_filter"
tested=$(date +%s)
echo "[sanitize] tests passed in $((tested - built)) s"

for target in safetensors checkpoint config image tokenizer; do
  mkdir -p "$dir/fuzz/corpus/$target"
  log="$dir/fuzz/$target.log"
  # -timeout: an input that takes 10 s is a finding (a decoder kept busy), not patience.
  if ! "$dir/fuzz/vlmgen_${target}_fuzzer" -max_total_time="$fuzz_seconds" -timeout=10 -rss_limit_mb=4096 \
      -dict=fuzz/vlmgen.dict -print_final_stats=1 -artifact_prefix="$dir/fuzz/$target-" \
      "$dir/fuzz/corpus/$target" "fuzz/corpus/$target" > "$log" 2>&1; then
    tail -n 60 "$log"
    echo "[sanitize] fuzz target $target failed; the input is $dir/fuzz/$target-*" >&2
    exit 1
  fi
  echo "[sanitize] fuzz $target: $(grep -E '^Done [0-9]+ runs' "$log" || tail -n 1 "$log")"
done
echo "[sanitize] done in $(($(date +%s) - start)) s (build $((built - start)) s, tests $((tested - built)) s)"
