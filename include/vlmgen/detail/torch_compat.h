#pragma once

// The one place for calls whose spelling differs between LibTorch 1.13 (Debian, CPU) and the
// CUDA LibTorch 2.x builds vlmgen also supports. Everything else uses only the common subset.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/version.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace vlmgen::detail {

/// A CPU random generator seeded with `seed`; same seed, same stream, on every build.
inline at::Generator make_cpu_generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

/// For programs (not the library): re-executes the current program with OMP_WAIT_POLICY=PASSIVE
/// unless the variable is already set. LibTorch's OpenMP threads otherwise spin while OpenBLAS's
/// own threads run a product, and on a 2-core machine a KV-cache decode step at a 512-token
/// context took 68 ms instead of 19 (measured). libgomp reads the variable when it loads, so it
/// cannot be changed from inside the process. Returns only when no re-exec happened.
inline void prefer_passive_openmp_wait(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("VLMGEN_KEEP_OMP_WAIT") != nullptr) return;
  ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  ::execv("/proc/self/exe", argv);  // on failure, carry on as we are
}

/// How many CUDA devices this process can use: 0 on a LibTorch built without CUDA, or when no
/// driver or device is present.
inline int64_t cuda_device_count() { return at::hasCUDA() ? static_cast<int64_t>(at::getNumGPUs()) : 0; }

/// "1.13.1", "2.4.0", ... as the headers vlmgen was compiled against report it.
inline std::string torch_version() { return TORCH_VERSION; }

}  // namespace vlmgen::detail
