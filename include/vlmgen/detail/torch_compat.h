#pragma once

// The one place for calls whose spelling differs between LibTorch 1.13 (Debian, CPU) and the
// CUDA LibTorch 2.x builds vlmgen also supports. Everything else uses only the common subset.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/version.h>

#include <cstdint>
#include <string>

namespace vlmgen::detail {

/// A CPU random generator seeded with `seed`; same seed, same stream, on every build.
inline at::Generator make_cpu_generator(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

/// "1.13.1", "2.4.0", ... as the headers vlmgen was compiled against report it.
inline std::string torch_version() { return TORCH_VERSION; }

}  // namespace vlmgen::detail
