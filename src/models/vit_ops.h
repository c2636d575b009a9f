#pragma once

// The encoder layers of the SigLIP and CLIP towers (vit::EncoderLayer): allocation, names and
// forward. Private to src/models.

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "qwen_vl_ops.h"
#include "vlmgen/models/vit_layer.h"

namespace vlmgen::detail {

enum class VitActivation { kTanhGelu, kQuickGelu, kGelu };

inline vit::EncoderLayer allocate_encoder_layer(int64_t width, int64_t mlp, const at::TensorOptions& opts) {
  auto linear = [&](int64_t out, int64_t in) {
    return qwen_vl::Linear{at::empty({out, in}, opts), at::empty({out}, opts), {}};
  };
  auto norm = [&] { return qwen_vl::LayerNorm{at::empty({width}, opts), at::empty({width}, opts)}; };
  return {norm(), linear(width, width), linear(width, width), linear(width, width), linear(width, width),
          norm(), linear(mlp, width),   linear(width, mlp)};
}

/// Its weights under transformers' names below `prefix` ("...encoder.layers.N.").
inline void add_encoder_layer_weights(const std::string& prefix, vit::EncoderLayer& l,
                                      std::vector<std::pair<std::string, at::Tensor*>>& out) {
  auto linear = [&](const std::string& name, qwen_vl::Linear& lin) {
    out.emplace_back(prefix + name + ".weight", &lin.weight);
    out.emplace_back(prefix + name + ".bias", &lin.bias);
  };
  auto norm = [&](const std::string& name, qwen_vl::LayerNorm& n) {
    out.emplace_back(prefix + name + ".weight", &n.weight);
    out.emplace_back(prefix + name + ".bias", &n.bias);
  };
  norm("layer_norm1", l.layer_norm1);
  linear("self_attn.q_proj", l.q_proj);
  linear("self_attn.k_proj", l.k_proj);
  linear("self_attn.v_proj", l.v_proj);
  linear("self_attn.out_proj", l.out_proj);
  norm("layer_norm2", l.layer_norm2);
  linear("mlp.fc1", l.fc1);
  linear("mlp.fc2", l.fc2);
}

/// Query rows per chunk of the attention (bounds the score tensor of a large image).
constexpr int64_t kVitQueryChunk = 512;

/// One layer over x [T, P, E] (T sequences of P tokens, attending within each sequence).
inline at::Tensor run_encoder_layer(const at::Tensor& x, const vit::EncoderLayer& l, int64_t heads, double eps,
                                    VitActivation act) {
  const int64_t t = x.size(0), p = x.size(1), e = x.size(2), d = e / heads;
  const at::Tensor h = apply_layer_norm(x, l.layer_norm1, eps);
  auto split = [&](const qwen_vl::Linear& lin) {
    return apply_linear(h, lin).view({t, p, heads, d}).transpose(1, 2);  // [T, heads, P, d]
  };
  const at::Tensor q = split(l.q_proj), kt = split(l.k_proj).transpose(-1, -2), v = split(l.v_proj);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<at::Tensor> parts;
  for (int64_t c0 = 0; c0 < p; c0 += kVitQueryChunk) {
    const int64_t n = std::min(kVitQueryChunk, p - c0);
    parts.push_back(at::matmul(at::softmax(at::matmul(q.narrow(2, c0, n), kt).mul_(scale), -1), v));
  }
  const at::Tensor attended = parts.size() == 1 ? parts[0] : at::cat(parts, 2);
  at::Tensor y = x + apply_linear(attended.transpose(1, 2).reshape({t, p, e}), l.out_proj);
  at::Tensor m = apply_linear(apply_layer_norm(y, l.layer_norm2, eps), l.fc1);
  switch (act) {
    case VitActivation::kTanhGelu: m = at::gelu(m, "tanh"); break;
    case VitActivation::kQuickGelu: m = m * at::sigmoid(m * 1.702); break;
    case VitActivation::kGelu: m = at::gelu(m); break;
  }
  return y + apply_linear(m, l.fc2);
}

}  // namespace vlmgen::detail
