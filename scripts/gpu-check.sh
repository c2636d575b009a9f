#!/usr/bin/env bash
# The GPU check, in one run on a machine with an NVIDIA GPU, CUDA, and Python with a CUDA build of
# PyTorch 2.x and HF transformers (no package registry needed):
#   1. CUDA must be usable (else it stops at once, FAILED, exit 1: it never skips), and the
#      toolchain must suit the packages of .gpu-deps/ (glibc, the C++11 ABI of PyTorch);
#   2. configures vlmgen against that PyTorch's LibTorch (torch.utils.cmake_prefix_path) and the
#      Debian packages of .gpu-deps/ (scripts/gpu-deps.sh fetches them on a build machine), with
#      NCCL from the nvidia-nccl wheel and {fmt} header-only (PyTorch ships its own fmt headers,
#      which come first on the include path), and builds only what the run needs: the library,
#      the two test programs, vlmgen-generate, vlmgen-make-tiny-checkpoint, the Python module;
#   3. the device tests (tests/model/device_test.cpp: OnTestDevice.*, NoHostReads.*) with
#      VLMGEN_TEST_DEVICE=cuda:0, NCCL with one rank included;
#   4. parity against transformers' own classes (tests/gpu/transformers_parity.py);
#   5. speed against transformers' generate (bench/gpu_speed.py);
#   6. the model, engine and collective tests on the CPU with this LibTorch (last: the most
#      expendable when time runs out);
# and writes $OUT/report.md (a line per stage), $OUT/log.txt, and the JSON of stages 4 and 5.
# Every stage after the build gets the time left before GPU_CHECK_DEADLINE (default 560 s after
# the start; the device tool stops a command at 600 s, or sooner when less device time is left:
# set it from the device tool's budget then), and each of stages 3-5 at most its own cap.
#
#   bash scripts/gpu-deps.sh                            # here, once: .gpu-deps/
#   device run: carry [".gpu-deps"], command "bash scripts/gpu-check.sh", timeout 600
#   bash scripts/gpu-check.sh --dry-run                 # here: the same stages on the CPU
#
# --dry-run (a build machine without a GPU): Debian's LibTorch, the existing build folder
# (GPU_CHECK_BUILD_DIR, default build), device cpu, and the Python stages' vlmgen halves only
# (no transformers here). Environment: OUT (default out/gpu-check), GPU_CHECK_JOBS (default nproc),
# GPU_CHECK_DEADLINE (seconds), GPU_CHECK_SPEED_ARGS (extra arguments of bench/gpu_speed.py),
# GPU_CHECK_COMMIT (the commit to name in the report when the copy has no .git).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

dry=0
if [ "${1:-}" = --dry-run ]; then dry=1; elif [ $# -gt 0 ]; then
  echo "usage: bash scripts/gpu-check.sh [--dry-run]" >&2
  exit 2
fi
out=$(mkdir -p "${OUT:-$root/out/gpu-check}" && cd "${OUT:-$root/out/gpu-check}" && pwd) || exit 1
report="$out/report.md"
: > "$report"
exec > >(tee "$out/log.txt") 2>&1
tee_pid=$!
# The log's last lines reach the file before the run ends.
trap 'exec >&- 2>&-; wait $tee_pid' EXIT
export PYTHONUNBUFFERED=1
jobs="${GPU_CHECK_JOBS:-$(nproc)}"
failures=0
started=$(date +%s)
deadline=$((started + ${GPU_CHECK_DEADLINE:-560}))

note() { echo "$*" | tee -a "$report"; }
stage() { echo; echo "=== $* ($(($(date +%s) - started)) s)"; }
left() { echo $((deadline - $(date +%s))); }
# Runs a stage's command for at most CAP seconds and the time left; its result is a line of the
# report; the run goes on after a failure.  check NAME CAP COMMAND...
check() {
  local name="$1" cap="$2"
  shift 2
  local t0=$(date +%s) budget=$(left) status=0
  [ "$budget" -gt "$cap" ] && budget=$cap
  if [ "$budget" -lt 10 ]; then
    note "- NOT RUN $name (no time left before the deadline)"
    failures=$((failures + 1))
    return
  fi
  timeout --signal=TERM --kill-after=5 "$budget" "$@" || status=$?
  if [ $status = 0 ]; then
    note "- PASS $name ($(($(date +%s) - t0)) s)"
  elif [ $status = 124 ] || [ $status = 137 ]; then
    note "- FAILED $name (stopped at the deadline after $(($(date +%s) - t0)) s; see log.txt)"
    failures=$((failures + 1))
  else
    note "- FAILED $name (exit $status, $(($(date +%s) - t0)) s; see log.txt)"
    failures=$((failures + 1))
  fi
}
fatal() {
  note "- FAILED $*"
  note ""
  note "stopped: nothing after this stage ran"
  exit 1
}

note "# vlmgen GPU check $(date -u +%Y-%m-%dT%H:%MZ)$([ $dry = 1 ] && echo ' (dry run on the CPU)')"
note ""
commit="${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
git diff --quiet 2>/dev/null
[ $? = 1 ] && commit="$commit + local changes"
note "commit $commit"

# --- 1. CUDA and the toolchain --------------------------------------------------------------------
stage "CUDA"
if [ $dry = 1 ]; then
  python=/usr/bin/python3
  device=cpu
  note "- device: cpu (dry run)"
else
  python=$(command -v python3) || fatal "no python3 on PATH"
  device=cuda:0
  nvidia-smi -L || true
  cuda_line=$("$python" - <<'EOF'
import sys
try:
    import torch
except Exception as e:
    sys.exit(f"python3 cannot import torch: {e}")
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable CUDA device")
x = torch.ones(4, device="cuda") * 2
torch.cuda.synchronize()
assert float(x.sum()) == 8.0
if not getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True):
    sys.exit(f"torch {torch.__version__} uses the pre-C++11 ABI; the Debian packages of .gpu-deps need the C++11 one")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.device_count()} device(s)")
EOF
  ) || fatal "CUDA is not usable, or this PyTorch cannot build with .gpu-deps (see log.txt)"
  note "- $cuda_line"
  glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
  note "- glibc ${glibc:-?}, $(cmake --version | head -1), $(g++ --version | head -1), nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo none)"
  case "$glibc" in
    2.3[4-9]* | 2.[4-9]*) ;;
    *) fatal "glibc ${glibc:-unknown}: the Debian 12 packages of .gpu-deps need 2.34 or newer" ;;
  esac
fi

# --- 2. configure and build -----------------------------------------------------------------------
stage "configure and build"
targets=(vlmgen vlmgen_core_tests vlmgen_model_tests vlmgen-generate vlmgen-make-tiny-checkpoint)
if [ $dry = 1 ]; then
  build="${GPU_CHECK_BUILD_DIR:-build}"
  [ -f "$build/CMakeCache.txt" ] || fatal "dry run: no configured build folder '$build' (run bash scripts/dev.sh test first)"
else
  build=/tmp/vlmgen-gpu-build
  expected=$(sed -n '/^packages=(/,/)/p' scripts/gpu-deps.sh | tr -d '()' | sed 's/packages=//' | wc -w)
  have=$(find .gpu-deps -name '*.deb' 2>/dev/null | wc -l)
  [ "$have" = "$expected" ] ||
    fatal "found $have .deb files in .gpu-deps, scripts/gpu-deps.sh lists $expected: run bash scripts/gpu-deps.sh on a build machine and carry .gpu-deps"
  deps=/tmp/vlmgen-gpu-deps
  rm -rf "$deps" && mkdir -p "$deps"
  for f in .gpu-deps/*.deb; do
    if command -v dpkg-deb > /dev/null; then
      dpkg-deb -x "$f" "$deps" || fatal "cannot unpack $f"
    else  # a .deb is an ar archive holding data.tar.xz
      ar p "$f" data.tar.xz | tar -xJ -C "$deps" || fatal "cannot unpack $f (no dpkg-deb; ar and tar failed)"
    fi
  done
  libdir="$deps/usr/lib/x86_64-linux-gnu"
  # pkgconf from the packages, reading only their .pc files, their paths under $deps.
  cat > "$deps/pkg-config" <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$libdir" PKG_CONFIG_LIBDIR="$libdir/pkgconfig:$deps/usr/share/pkgconfig" \\
  PKG_CONFIG_SYSROOT_DIR="$deps" exec "$deps/usr/bin/pkgconf" "\$@"
EOF
  chmod +x "$deps/pkg-config"
  torch_prefix=$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)') || fatal "no torch.utils.cmake_prefix_path"
  nccl_include=$("$python" -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "include"))' 2>/dev/null || true)
  pybind11_dir=$("$python" -c 'import pybind11; print(pybind11.get_cmake_dir())' 2>/dev/null || true)
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
  config_args=(-DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$torch_prefix;$deps/usr;$libdir"
               "-DPKG_CONFIG_EXECUTABLE=$deps/pkg-config" -DVLMGEN_BUILD_BENCHMARKS=OFF -DVLMGEN_INSTALL=OFF
               -DVLMGEN_USE_CCACHE=OFF -DVLMGEN_FMT_HEADER_ONLY=ON "-DPython3_EXECUTABLE=$python")
  [ -n "$nccl_include" ] && [ -f "$nccl_include/nccl.h" ] && config_args+=("-DVLMGEN_NCCL_INCLUDE_DIR=$nccl_include")
  [ -n "$pybind11_dir" ] && config_args+=("-Dpybind11_DIR=$pybind11_dir")
  [ -n "$nvcc" ] && config_args+=("-DCMAKE_CUDA_COMPILER=$nvcc" "-DCUDAToolkit_ROOT=$(dirname "$(dirname "$nvcc")")")
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
  t0=$(date +%s)
  if ! cmake -S . -B "$build" -G Ninja "${config_args[@]}" > "$out/configure.txt" 2>&1; then
    # Some PyTorch/CUDA pairs look for a libnvToolsExt the CUDA toolkit no longer has.
    tail -20 "$out/configure.txt"
    echo "configure failed; once more with USE_SYSTEM_NVTX=ON"
    rm -rf "$build"
    cmake -S . -B "$build" -G Ninja "${config_args[@]}" -DUSE_SYSTEM_NVTX=ON > "$out/configure.txt" 2>&1 ||
      { tail -40 "$out/configure.txt"; fatal "configure against $torch_prefix (configure.txt)"; }
  fi
  grep -E "vlmgen:|vlmgen Python module" "$out/configure.txt" | sed 's/^-- /- /' | tee -a "$report"
  note "- configured in $(($(date +%s) - t0)) s"
fi
grep -q "vlmgen_python" "$build/build.ninja" 2>/dev/null && targets+=(vlmgen_python)
build=$(cd "$build" && pwd)
t0=$(date +%s)
[ "$(left)" -gt 30 ] || fatal "no time left to build before the deadline"
timeout "$(left)" cmake --build "$build" -j "$jobs" --target "${targets[@]}" || fatal "build (log.txt)"
note "- PASS build of ${targets[*]} in $(($(date +%s) - t0)) s with $jobs jobs"

# --- 3. the device tests ----------------------------------------------------------------------------
stage "device tests"
export OMP_WAIT_POLICY=PASSIVE
# Weights, KV cache, images with and without a KV cache, the engine's encoder cache, seeded
# sampling, bf16, loading onto the device, NCCL with one rank, no host reads in a forward.
check "device tests on $device (OnTestDevice.*, NoHostReads.*)" 150 \
  env VLMGEN_TEST_DEVICE=$device "$build/tests/vlmgen_model_tests" --gtest_filter='OnTestDevice.*:NoHostReads.*'

# --- 4. parity against transformers -----------------------------------------------------------------
stage "parity"
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
only=()
[ $dry = 1 ] && only=(--vlmgen-only)
check "parity with transformers (fp32 CPU logits <= 1e-4 and greedy tokens; bf16 on $device)" 150 \
  "$python" tests/gpu/transformers_parity.py --tools "$build/examples" --device "$device" --json "$out/parity.json" \
  "${only[@]}"

# --- 5. speed ----------------------------------------------------------------------------------------
stage "speed"
speed_args=(--tools "$build/examples")
[ $dry = 1 ] && speed_args+=(--vlmgen-only --small)
# shellcheck disable=SC2206
speed_args+=(${GPU_CHECK_SPEED_ARGS:-})
check "speed against transformers generate (bf16, batch 1 with a 448x448 image, batch 16)" 300 \
  "$python" bench/gpu_speed.py --device "$device" --json "$out/speed.json" "${speed_args[@]}"
[ -f "$out/speed.json" ] && "$python" -c "
import json, sys
for line in json.load(open(sys.argv[1])).get('table', []): print(line)
" "$out/speed.json" | tee -a "$report"

# --- 6. the CPU tests with this LibTorch ----------------------------------------------------------------
stage "CPU tests"
cd "$build"
check "CPU tests (core, Qwen-VL models, engine, TP/SP over two ranks)" 600 \
  ctest -j "$jobs" --timeout 90 --output-on-failure \
  -R '^(Families/|Qwen|EngineOnQwenVl|TensorParallel|Distributed|LaunchLocalRanks|CpuKernels|Fp8|Safetensors|ImageProcessor|BadInputTable|Batching|Continuation|EncoderCache|Engine\.|InferenceContext|Prefill|ReplayPolicy|Sampl|SequenceParallel|StepPlan|Streaming|VisionInputs|ForwardSpy)'
cd "$root"

note ""
note "$failures stage(s) failed or did not run; $(($(date +%s) - started)) s in all"
[ $failures = 0 ]
