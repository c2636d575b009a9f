#pragma once

// Functional building blocks shared by the Qwen2-VL translation units (private to src/).

#include <ATen/ATen.h>

#include "vlmgen/models/qwen2_vl.h"

namespace vlmgen::detail {

inline at::Tensor apply_linear(const at::Tensor& x, const qwen2_vl::Linear& linear) {
  return linear.bias.defined() ? at::linear(x, linear.weight, linear.bias) : at::linear(x, linear.weight);
}

inline at::Tensor apply_layer_norm(const at::Tensor& x, const qwen2_vl::LayerNorm& norm, double eps) {
  return at::layer_norm(x, {x.size(-1)}, norm.weight, norm.bias, eps);
}

/// Qwen2 RMSNorm: x / rms(x) * weight, in fp32.
inline at::Tensor apply_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * weight;
}

/// The rotate_half convention of HF rotary embeddings: (x1, x2) -> (-x2, x1) over the last
/// dimension's halves (not interleaved pairs).
inline at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

inline at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return x * cos + rotate_half(x) * sin;
}

}  // namespace vlmgen::detail
