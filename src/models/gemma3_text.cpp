// The Gemma-3 text model: (1 + w) RMSNorms around attention and MLP, q/k norms, GeGLU, and
// interleaved sliding-window and global layers, each with its own RoPE; attention causal except
// among the placeholders of one image.

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "qwen_vl_ops.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/kernels/cpu.h"
#include "vlmgen/models/gemma3.h"

namespace vlmgen {
namespace {

using detail::apply_gemma_rms_norm;

/// cos and sin [B, 1, S, head_dim] of positions [B, S] for RoPE with `base`, frequencies divided
/// by `factor` (linear scaling).
std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& positions, int64_t head_dim, double base,
                                               double factor) {
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(positions.device());
  at::Tensor inv_freq = at::pow(base, at::arange(0, head_dim, 2, opts) / static_cast<double>(head_dim)).reciprocal();
  if (factor != 1.0) inv_freq = inv_freq / factor;
  at::Tensor angles = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;  // [B, S, D / 2]
  at::Tensor emb = at::cat({angles, angles}, -1).unsqueeze(1);
  return {emb.cos(), emb.sin()};
}

/// Which keys a query sees: query column q (window_start + c) sees key column k (key_begin + j)
/// when the key is real and either k <= q (and q - k < window for a sliding layer) or both are
/// placeholders of the same image.
struct Visibility {
  int64_t window_start;
  int64_t key_begin;
  at::Tensor key_real;  // [B, K], bool
  at::Tensor groups;    // [B, window_start + S], image of each column (-1 text); undefined: no image
  int64_t window;       // 0: a global layer
  double scale;
};

/// q [B, heads, S, D] over k, v [B, kv, K, D]: [B, heads, S, D]. One-column decode steps of
/// text on the CPU use kernels::decode_attention;
/// otherwise GQA as batched matmuls over query chunks, each with its own slice of the mask.
at::Tensor attend(const at::Tensor& q, at::Tensor k, at::Tensor v, Visibility vis) {
  // A sliding layer's queries (all at or after window_start) see no key before
  // window_start - window + 1 outside an image: read only the keys from there on, so a cached
  // step costs the window, not the context.
  if (vis.window > 0 && !vis.groups.defined()) {
    const int64_t first = std::max<int64_t>(0, vis.window_start - vis.key_begin - vis.window + 1);
    if (first > 0) {
      const int64_t kept = k.size(2) - first;
      k = k.narrow(2, first, kept);
      v = v.narrow(2, first, kept);
      vis.key_real = vis.key_real.narrow(1, first, kept);
      vis.key_begin += first;
    }
  }
  const int64_t b = q.size(0), heads = q.size(1), s = q.size(2), d = q.size(3);
  const int64_t keys = k.size(2);
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(q.device());
  const at::Tensor key_cols = at::arange(vis.key_begin, vis.key_begin + keys, long_opts).unsqueeze(0);  // [1, K]
  if (q.device().is_cpu() && s == 1 && !vis.groups.defined() && kernels::enabled() && !at::GradMode::is_enabled()) {
    return kernels::decode_attention(q, k, v, vis.key_real, vis.window_start - vis.key_begin, vis.scale);
  }
  if (k.scalar_type() == at::kByte) {  // an FP8 cache's rows, decoded
    k = decode_fp8_kv(k);
    v = decode_fp8_kv(v);
  }
  if (k.scalar_type() != q.scalar_type()) {  // a bfloat16 cache: the products in the queries' dtype
    k = k.to(q.scalar_type());
    v = v.to(q.scalar_type());
  }
  // Each chunk into its columns of one [B, S, heads, D] output, as Qwen2-VL's attend.
  at::Tensor out = at::empty({b, s, heads, d}, q.options());
  for (int64_t c0 = 0; c0 < s; c0 += detail::kAttentionChunk) {
    const int64_t n = std::min(detail::kAttentionChunk, s - c0);
    const at::Tensor query_cols = at::arange(vis.window_start + c0, vis.window_start + c0 + n, long_opts).unsqueeze(1);
    at::Tensor seen = key_cols.le(query_cols);  // [n, K]
    if (vis.window > 0) seen = seen.logical_and((query_cols - key_cols).lt(vis.window));
    seen = seen.unsqueeze(0).logical_and(vis.key_real.unsqueeze(1));  // [B, n, K]
    if (vis.groups.defined()) {
      const at::Tensor gq = vis.groups.narrow(1, vis.window_start + c0, n).unsqueeze(2);  // [B, n, 1]
      const at::Tensor gk = vis.groups.narrow(1, vis.key_begin, keys).unsqueeze(1);       // [B, 1, K]
      seen = seen.logical_or(gq.eq(gk).logical_and(gq.ge(0)));
    }
    // On the CPU only the keys that some query of the chunk sees are computed: none after its
    // last column but the rest of an image its queries see in both directions, none before a
    // sliding layer's window but the start of such an image (elsewhere every key, without reading
    // the mask back to the host).
    int64_t lo = 0, hi = keys;
    if (q.device().is_cpu()) {
      const at::Tensor columns = seen.any(0).any(0).nonzero();  // [m, 1]: the keys seen
      const int64_t m = columns.size(0);
      const int64_t* first = columns.data_ptr<int64_t>();
      lo = m > 0 ? first[0] : 0;
      hi = m > 0 ? first[m - 1] + 1 : 1;  // all padding: one key, as a causal cut keeps
    }
    detail::attend_query_chunk(q, k, v, c0, lo, seen.narrow(2, lo, hi - lo).logical_not(), vis.scale, out);
  }
  return out.transpose(1, 2);
}

}  // namespace

at::Tensor Gemma3::run_language_model(at::Tensor x, const Window& w) const {
  const Gemma3Config& c = config_;
  const int64_t b = x.size(0), s = x.size(1), tp = parallel_.tp_size();
  const int64_t heads = c.num_attention_heads / tp, kv_heads = c.num_key_value_heads / tp, d = c.head_dim;
  const auto global = rope_cos_sin(w.positions, d, c.rope_theta, c.rope_scaling_factor);
  const auto local = rope_cos_sin(w.positions, d, c.rope_local_base_freq, 1.0);
  const int64_t key_begin = w.context != nullptr ? 0 : w.start;
  Visibility vis{w.start,        key_begin, w.mask.narrow(1, key_begin, w.start + s - key_begin).eq(1),
                 w.image_groups, 0,         1.0 / std::sqrt(c.query_pre_attn_scalar)};
  const double eps = c.rms_norm_eps;
  for (size_t layer = 0; layer < lm_.layers.size(); ++layer) {
    const gemma3::DecoderLayer& l = lm_.layers[layer];
    const bool slides = c.layer_slides(static_cast<int64_t>(layer));
    const auto& [cos, sin] = slides ? local : global;
    at::Tensor h = apply_gemma_rms_norm(x, l.input_layernorm, eps);
    at::Tensor q =
        apply_gemma_rms_norm(detail::apply_linear(h, l.q_proj).view({b, s, heads, d}), l.q_norm, eps).transpose(1, 2);
    at::Tensor k = apply_gemma_rms_norm(detail::apply_linear(h, l.k_proj).view({b, s, kv_heads, d}), l.k_norm, eps)
                       .transpose(1, 2);
    at::Tensor v = detail::apply_linear(h, l.v_proj).view({b, s, kv_heads, d}).transpose(1, 2);
    q = detail::apply_rotary(q, cos, sin);
    k = detail::apply_rotary(k, cos, sin);
    if (w.context != nullptr) std::tie(k, v) = w.context->append_kv(static_cast<int64_t>(layer), k, v);
    vis.window = slides ? c.sliding_window : 0;
    at::Tensor a = attend(q, k, v, vis).transpose(1, 2).reshape({b, s, heads * d});
    x = x + apply_gemma_rms_norm(detail::apply_row_parallel(a, l.o_proj, tp_comm_), l.post_attention_layernorm, eps);
    h = apply_gemma_rms_norm(x, l.pre_feedforward_layernorm, eps);
    at::Tensor m = at::gelu(detail::apply_linear(h, l.gate_proj), "tanh") * detail::apply_linear(h, l.up_proj);
    x = x +
        apply_gemma_rms_norm(detail::apply_row_parallel(m, l.down_proj, tp_comm_), l.post_feedforward_layernorm, eps);
  }
  x = apply_gemma_rms_norm(x, lm_.norm, eps);
  if (w.last_column_only) x = x.narrow(1, s - 1, 1);
  // A tied head reads the embedding itself, even after a caller replaced that tensor through
  // named_weights().
  at::Tensor logits = kernels::linear(x, c.tie_word_embeddings ? lm_.embed_tokens : lm_.lm_head);
  if (c.final_logit_softcapping > 0) {
    logits = at::tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping;
  }
  return logits;
}

}  // namespace vlmgen
