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
#include "vlmgen/kernels/cpu.h"
#include "vlmgen/logging.h"
#include "vlmgen/models/vit_layer.h"
#include "vlmgen/parallel.h"

namespace vlmgen::detail {

enum class VitActivation { kTanhGelu, kQuickGelu, kGelu };

/// Whether a tower of `heads` attention heads and an MLP of width `mlp` splits over the
/// tensor-parallel ranks of `parallel` (Megatron-style, see add_encoder_layer_weights): only when
/// both divide by tp_size; else every rank holds all of it. Decided once, at construction; rank 0
/// logs the decision.
inline bool shard_encoder_layers(const char* family, int64_t heads, int64_t mlp, const ParallelContext& parallel) {
  const int64_t tp = parallel.tp_size();
  const bool sharded = tp > 1 && heads % tp == 0 && mlp % tp == 0;
  if (tp > 1 && parallel.tp_rank() == 0) {
    if (sharded) {
      log(LogLevel::kInfo, "{}: vision tower sharded over {} tensor-parallel ranks ({} heads, MLP width {})", family,
          tp, heads, mlp);
    } else {
      log(LogLevel::kInfo,
          "{}: vision tower replicated on each of {} tensor-parallel ranks because its {} heads and MLP width {} do "
          "not both divide by {}",
          family, tp, heads, mlp, tp);
    }
  }
  return sharded;
}

/// A layer's local weights on one of `tp` ranks (tp 1: the whole layer; see add_encoder_layer_weights).
inline vit::EncoderLayer allocate_encoder_layer(int64_t width, int64_t mlp, const at::TensorOptions& opts, int64_t tp) {
  auto linear = [&](int64_t out, int64_t in, int64_t bias) {
    return qwen_vl::Linear{at::empty({out, in}, opts), at::empty({bias}, opts), {}};
  };
  auto by_rows = [&](int64_t out, int64_t in) { return linear(out / tp, in, out / tp); };
  auto by_columns = [&](int64_t out, int64_t in) { return linear(out, in / tp, out); };
  auto norm = [&] { return qwen_vl::LayerNorm{at::empty({width}, opts), at::empty({width}, opts)}; };
  return {norm(), by_rows(width, width), by_rows(width, width), by_rows(width, width), by_columns(width, width),
          norm(), by_rows(mlp, width),   by_columns(width, mlp)};
}

/// Its weights under transformers' names below `prefix` ("...encoder.layers.N."), each passed to
/// `add(name, tensor, layout)`. Sharded: q/k/v and fc1 split by output rows (weights and biases),
/// out_proj and fc2 by input columns (their biases whole, added once after the all-reduce); the
/// norms whole. Not sharded: everything kReplicated.
template <typename Add>
void add_encoder_layer_weights(const std::string& prefix, vit::EncoderLayer& l, bool sharded, Add&& add) {
  using qwen_vl::ShardLayout;
  const ShardLayout rows = sharded ? ShardLayout::kRows : ShardLayout::kReplicated;
  const ShardLayout columns = sharded ? ShardLayout::kColumns : ShardLayout::kReplicated;
  auto linear = [&](const std::string& name, qwen_vl::Linear& lin, ShardLayout layout) {
    add(prefix + name + ".weight", lin.weight, layout);
    add(prefix + name + ".bias", lin.bias, layout == ShardLayout::kColumns ? ShardLayout::kReplicated : layout);
  };
  auto norm = [&](const std::string& name, qwen_vl::LayerNorm& n) {
    add(prefix + name + ".weight", n.weight, ShardLayout::kReplicated);
    add(prefix + name + ".bias", n.bias, ShardLayout::kReplicated);
  };
  norm("layer_norm1", l.layer_norm1);
  linear("self_attn.q_proj", l.q_proj, rows);
  linear("self_attn.k_proj", l.k_proj, rows);
  linear("self_attn.v_proj", l.v_proj, rows);
  linear("self_attn.out_proj", l.out_proj, columns);
  norm("layer_norm2", l.layer_norm2);
  linear("mlp.fc1", l.fc1, rows);
  linear("mlp.fc2", l.fc2, columns);
}

/// Query rows per chunk of the attention (bounds the score tensor of a large image).
constexpr int64_t kVitQueryChunk = 512;

/// One layer over x [T, P, E] (T sequences of P tokens, attending within each sequence), for a
/// tower of `heads` attention heads. With a group (`comm`, the layer sharded over its ranks) this
/// rank computes heads / tp heads and its block of the MLP, and out_proj and fc2 are all-reduced:
/// every rank returns the same whole result.
inline at::Tensor run_encoder_layer(const at::Tensor& x, const vit::EncoderLayer& l, int64_t heads, double eps,
                                    VitActivation act, Communicator* comm = nullptr) {
  const int64_t t = x.size(0), p = x.size(1), d = x.size(2) / heads;
  const int64_t local_heads = heads / group_size(comm);
  const at::Tensor h = apply_layer_norm(x, l.layer_norm1, eps);
  auto split = [&](const qwen_vl::Linear& lin) {
    return apply_linear(h, lin).view({t, p, local_heads, d}).transpose(1, 2);  // [T, local heads, P, d]
  };
  const at::Tensor q = split(l.q_proj), kt = split(l.k_proj).transpose(-1, -2), v = split(l.v_proj);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<at::Tensor> parts;
  for (int64_t c0 = 0; c0 < p; c0 += kVitQueryChunk) {
    const int64_t n = std::min(kVitQueryChunk, p - c0);
    at::Tensor probs = at::matmul(q.narrow(2, c0, n), kt);
    kernels::scaled_softmax_into(probs, scale);
    parts.push_back(at::matmul(probs, v));
  }
  const at::Tensor attended = parts.size() == 1 ? parts[0] : at::cat(parts, 2);
  at::Tensor y = x + apply_row_parallel(attended.transpose(1, 2).reshape({t, p, local_heads * d}), l.out_proj, comm);
  at::Tensor m = apply_linear(apply_layer_norm(y, l.layer_norm2, eps), l.fc1);
  switch (act) {
    case VitActivation::kTanhGelu: m = at::gelu(m, "tanh"); break;
    case VitActivation::kQuickGelu: m = m * at::sigmoid(m * 1.702); break;
    case VitActivation::kGelu: m = at::gelu(m); break;
  }
  return y + apply_row_parallel(m, l.fc2, comm);
}

}  // namespace vlmgen::detail
