#pragma once

// Helpers shared by the CPU kernel tests (kernels_*test.cpp).

#include <ATen/ATen.h>

namespace vlmgen::kernels_test {

/// Largest |got - want| over the scale of the terms summed (sum over i of |x_i w_i| per output):
/// float32 accumulation of n terms stays within a few n * 2^-24 of that scale.
inline double relative_error(const at::Tensor& got, const at::Tensor& want, const at::Tensor& term_scale) {
  return ((got.to(at::kDouble) - want).abs() / (term_scale + 1e-30)).max().item<double>();
}

}  // namespace vlmgen::kernels_test
