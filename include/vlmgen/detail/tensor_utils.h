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

inline bool is_integral(const at::Tensor& t) {
  return at::isIntegralType(t.scalar_type(), /*includeBool=*/false);
}

}  // namespace vlmgen::detail
