#pragma once

// Small helpers over ATen used across vlmgen. Version-specific ATen/LibTorch calls live in
// vlmgen/detail/torch_compat.h, nowhere else.

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "vlmgen/error.h"

namespace vlmgen::detail {

inline std::string shape_str(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  return fmt::format("[{}]", fmt::join(t.sizes(), ", "));
}

inline std::vector<int64_t> shape_vec(const at::Tensor& t) {
  return t.defined() ? t.sizes().vec() : std::vector<int64_t>{};
}

/// Copies an integer tensor of any shape to a flat std::vector<int64_t> (row-major).
inline std::vector<int64_t> to_int64_vector(const at::Tensor& t) {
  if (!t.defined()) return {};
  at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

/// x @ weight^T (+ bias) over the last dimension, like at::linear. On the CPU a product with one
/// or two rows (a decode step) goes through matrix-vector products: OpenBLAS's sgemm with so few
/// rows runs about 3x slower than its sgemv, and decoding reads every weight once per token.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {}) {
  const int64_t in = x.size(-1);
  const int64_t rows = in == 0 ? 0 : x.numel() / in;
  if (x.device().is_cpu() && (rows == 1 || rows == 2) && x.scalar_type() == weight.scalar_type() && weight.dim() == 2 &&
      weight.is_contiguous()) {
    at::Tensor flat = x.reshape({rows, in});
    at::Tensor out = rows == 1 ? at::mv(weight, flat[0]).unsqueeze(0)
                               : at::stack({at::mv(weight, flat[0]), at::mv(weight, flat[1])});
    if (bias.defined()) out.add_(bias);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = weight.size(0);
    return out.view(shape);
  }
  return bias.defined() ? at::linear(x, weight, bias) : at::linear(x, weight);
}

/// A 1-D bool tensor as a std::vector<bool>.
inline std::vector<bool> to_bool_vector(const at::Tensor& t) {
  std::vector<int64_t> v = to_int64_vector(t);
  return std::vector<bool>(v.begin(), v.end());
}

inline bool is_integral(const at::Tensor& t) { return at::isIntegralType(t.scalar_type(), /*includeBool=*/false); }

}  // namespace vlmgen::detail
