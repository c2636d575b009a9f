#pragma once

// Helpers shared by the distributed tests (distributed_*test.cpp): seeded tensors and timing.

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "vlmgen/detail/torch_compat.h"

namespace vlmgen::distributed_test {

inline at::Tensor randn(const std::vector<int64_t>& shape, uint64_t seed) {
  at::Generator gen = detail::make_cpu_generator(seed);
  return at::randn(shape, gen, at::kFloat);
}

/// Seconds since `start` on the steady clock.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace vlmgen::distributed_test
