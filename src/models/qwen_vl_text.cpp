// The Qwen2 decoder of Qwen2-VL: RMSNorm, GQA with q/k/v bias and M-RoPE, SwiGLU MLP.

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "fused_decode.h"
#include "qwen_vl_ops.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/kernels/cpu.h"
#include "vlmgen/models/qwen_vl.h"

namespace vlmgen {
namespace {

/// cos and sin of M-RoPE for positions [3, B, S]: [B, 1, S, head_dim] each. Frequency j of the
/// rotary half takes its angle from one axis (t, h or w): chunked (Qwen2-VL, Qwen2.5-VL), the
/// axis whose mrope_section chunk holds j; interleaved (Qwen3-VL), h for j % 3 == 1 below
/// 3 * section[1], w for j % 3 == 2 below 3 * section[2], t otherwise. The same choice applies
/// to both halves, since HF repeats the frequencies as cat(freqs, freqs).
std::pair<at::Tensor, at::Tensor> mrope_cos_sin(const at::Tensor& positions, const QwenVlConfig& c) {
  const int64_t half = c.head_dim / 2;
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(positions.device());
  at::Tensor exponent = at::arange(0, c.head_dim, 2, opts) / static_cast<double>(c.head_dim);
  at::Tensor inv_freq = at::pow(c.rope_theta, exponent).reciprocal();     // [head_dim / 2]
  at::Tensor angles = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;  // [3, B, S, head_dim / 2]
  // Built on the device from the frequency indices: no host data crosses over each call.
  const at::Tensor j = at::arange(half, opts.dtype(at::kLong));
  at::Tensor index;
  if (c.mrope_interleaved) {
    index = (j.remainder(3).eq(1) & j.lt(3 * c.mrope_section[1])).to(at::kLong) +
            (j.remainder(3).eq(2) & j.lt(3 * c.mrope_section[2])).to(at::kLong) * 2;
  } else {
    index = j.ge(c.mrope_section[0]).to(at::kLong) + j.ge(c.mrope_section[0] + c.mrope_section[1]).to(at::kLong);
  }
  index = index.view({1, 1, 1, half}).expand({1, angles.size(1), angles.size(2), half});
  at::Tensor chosen = angles.gather(0, index).squeeze(0);  // [B, S, head_dim / 2]
  at::Tensor emb = at::cat({chosen, chosen}, -1);          // [B, S, head_dim]
  return {emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)};
}

/// Windows of up to this many columns attend through kernels::decode_attention on the CPU.
constexpr int64_t kKernelAttentionColumns = 4;
/// `x` [B, S, ...] padded with zeros at the end of dim 1 to `length` positions.
at::Tensor pad_sequence(const at::Tensor& x, int64_t length) {
  if (x.size(1) == length) return x;
  std::vector<int64_t> shape = x.sizes().vec();
  shape[1] = length - x.size(1);
  return at::cat({x, at::zeros(shape, x.options())}, 1);
}

/// Which keys the queries of a window see: query column window_start + c sees key column
/// key_begin + j when key_begin + j <= window_start + c and key_real[b, j].
struct AttentionWindow {
  int64_t window_start;
  int64_t key_begin;
  at::Tensor key_real;  // [B, K], bool
  double scale;
};

/// Attention of the window's queries q [B, heads, S, D] over k, v [B, kv, K, D]: [B, heads, S, D].
/// A few query columns on the CPU (decode): one pass over K and V per KV head in the kernel.
/// Otherwise GQA without copying K/V per query head: query head i uses KV head i / groups, so the
/// group's queries stack into one [g * S, D] matrix per KV head and each product is a plain
/// (batched) matmul (K and V read in place from the cache), in chunks of query columns, each with
/// its own slice of the mask, so no tensor grows with S x K.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionWindow& w) {
  const int64_t b = q.size(0), heads = q.size(1), s = q.size(2), head_dim = q.size(3);
  const int64_t keys = k.size(2);
  const bool recorded = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (q.device().is_cpu() && q.scalar_type() == at::kFloat && s <= kKernelAttentionColumns && kernels::enabled() &&
      !recorded) {
    return kernels::decode_attention(q, k, v, w.key_real, w.window_start - w.key_begin, w.scale);
  }
  if (k.scalar_type() == at::kByte)  // an FP8 cache's rows, decoded
    return attend(q, decode_fp8_kv(k).to(q.device(), q.scalar_type()), decode_fp8_kv(v).to(q.device(), q.scalar_type()),
                  w);
  if (k.scalar_type() != q.scalar_type())  // a bfloat16 cache: the products in the queries' dtype
    return attend(q, k.to(q.scalar_type()), v.to(q.scalar_type()), w);
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(q.device());
  const at::Tensor key_cols = at::arange(w.key_begin, w.key_begin + keys, long_opts).unsqueeze(0);  // [1, K]
  // Each chunk's output goes to its columns of one [B, S, heads, D] tensor, returned as its
  // [B, heads, S, D] view: no list of parts and their concatenation beside it, and the caller's
  // transpose back to [B, S, heads * D] is free.
  at::Tensor out = at::empty({b, s, heads, head_dim}, q.options());
  for (int64_t c0 = 0; c0 < s; c0 += detail::kAttentionChunk) {
    const int64_t n = std::min(detail::kAttentionChunk, s - c0);
    // Keys after the chunk's last query column are blocked for all of its queries: left out (a
    // causal prefill computes about half the scores, and softmaxes half).
    const int64_t seen = std::clamp<int64_t>(w.window_start + c0 + n - w.key_begin, 1, keys);
    const at::Tensor query_cols = at::arange(w.window_start + c0, w.window_start + c0 + n, long_opts).unsqueeze(1);
    const at::Tensor blocked = key_cols.narrow(1, 0, seen)
                                   .le(query_cols)
                                   .unsqueeze(0)
                                   .logical_and(w.key_real.narrow(1, 0, seen).unsqueeze(1))
                                   .logical_not();
    detail::attend_query_chunk(q, k, v, c0, 0, blocked, w.scale, out);
  }
  return out.transpose(1, 2);
}

}  // namespace

namespace detail {

void attend_query_chunk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t c0, int64_t key_lo,
                        const at::Tensor& blocked, double scale, at::Tensor& out) {
  const int64_t b = q.size(0), heads = q.size(1), head_dim = q.size(3);
  const int64_t kv_heads = k.size(1), groups = heads / kv_heads, n = blocked.size(1), keys = blocked.size(2);
  const bool recorded = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  const int64_t per_product = q.device().is_cpu() && !recorded ? 1 : kv_heads;
  // A finite fill (not -inf): a padding query row with every key blocked softmaxes to a uniform
  // row instead of NaN. Scaled in the softmax (lowest * scale), so divided by any scale above 1
  // to stay finite.
  const double blocked_score = std::numeric_limits<float>::lowest() / std::max(1.0, scale);
  const at::Tensor kt = k.narrow(2, key_lo, keys).transpose(-1, -2);
  const at::Tensor vs = v.narrow(2, key_lo, keys);
  const at::Tensor blocked_heads = blocked.unsqueeze(1).unsqueeze(1);  // [B, 1, 1, n, keys]
  for (int64_t h0 = 0; h0 < kv_heads; h0 += per_product) {
    const int64_t qh = per_product * groups;  // query heads of these KV heads
    at::Tensor q4 = q.narrow(2, c0, n).narrow(1, h0 * groups, qh).reshape({b, per_product, groups * n, head_dim});
    at::Tensor scores = at::matmul(q4, kt.narrow(1, h0, per_product));  // [B, per, g * n, keys]
    scores.view({b, per_product, groups, n, keys}).masked_fill_(blocked_heads, blocked_score);
    kernels::scaled_softmax_into(scores, scale);  // masked: lowest * scale, e^-huge = 0
    const at::Tensor part = at::matmul(scores, vs.narrow(1, h0, per_product)).view({b, qh, n, head_dim});
    out.narrow(1, c0, n).narrow(2, h0 * groups, qh).copy_(part.transpose(1, 2));
  }
}

}  // namespace detail

namespace {

/// Per segment: keys are the cached columns [0, window_start) plus the window; without a cache
/// only the window. Query column q sees key column k when k <= q and the key is not padding.
/// (A template: QwenVl::LmSegment is private to the model.)
template <class Segment>
std::vector<AttentionWindow> attention_windows(const std::vector<Segment>& segments, double scale) {
  std::vector<AttentionWindow> windows;
  for (const Segment& g : segments) {
    const int64_t key_begin = g.context != nullptr ? 0 : g.window_start;
    const int64_t key_end = g.window_start + g.cols;
    windows.push_back(AttentionWindow{g.window_start, key_begin,
                                      g.attention_mask.narrow(1, key_begin, key_end - key_begin).eq(1),  // [rows, K]
                                      scale});
  }
  return windows;
}

/// Where each segment's rows x cols tokens start in the stream of several segments.
template <class Segment>
std::vector<int64_t> stream_offsets(const std::vector<Segment>& segments) {
  std::vector<int64_t> offsets;
  int64_t streamed = 0;
  for (const Segment& g : segments) {
    offsets.push_back(streamed);
    streamed += g.rows * g.cols;
  }
  return offsets;
}

/// Attention of several segments in one [1, T] stream (q [1, heads, T, D], k and v [1, kv, T, D]),
/// each over its own cache: each takes its rows x cols tokens as [rows, heads, cols, D] and writes
/// its output to its place of the [T, heads * D] result.
template <class Segment>
at::Tensor attend_segments(int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const std::vector<Segment>& segments, const std::vector<int64_t>& offsets,
                           const std::vector<AttentionWindow>& windows) {
  const int64_t heads = q.size(1), head_dim = q.size(3);
  at::Tensor out = at::empty({q.size(2), heads * head_dim}, q.options());
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& g = segments[i];
    const int64_t n = g.rows * g.cols;
    auto own = [&](const at::Tensor& t) {
      return t.narrow(2, offsets[i], n).reshape({t.size(1), g.rows, g.cols, head_dim}).transpose(0, 1);
    };
    at::Tensor qi = own(q), ki = own(k), vi = own(v);
    if (g.context != nullptr) std::tie(ki, vi) = g.context->append_kv(layer, ki, vi);
    out.narrow(0, offsets[i], n)
        .view({g.rows, g.cols, heads, head_dim})
        .copy_(attend(qi, ki, vi, windows[i]).transpose(1, 2));
  }
  return out;
}

/// The rows of a fused decode step: every segment one column over its KV cache, or none.
template <class Segment>
std::vector<detail::FusedDecodeRows> fused_rows(const std::vector<Segment>& segments,
                                                const std::vector<int64_t>& offsets,
                                                const std::vector<AttentionWindow>& windows) {
  std::vector<detail::FusedDecodeRows> rows;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& g = segments[i];
    if (g.cols != 1 || g.context == nullptr) return {};
    rows.push_back(detail::FusedDecodeRows{g.context, offsets[i], g.rows, windows[i].key_real});
  }
  return rows;
}

/// The output layer once over the columns the segments want (the last of each row, or all) of
/// the stream x [1, T, hidden] of several segments: logits [rows, cols or 1, vocab] per segment.
/// A decode step's one-column windows want every row of the stream.
template <class Segment>
std::vector<at::Tensor> segment_logits(const at::Tensor& x, const std::vector<Segment>& segments,
                                       const std::vector<int64_t>& offsets, const qwen_vl::LanguageModel& lm) {
  std::vector<int64_t> wanted;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& g = segments[i];
    for (int64_t r = 0; r < g.rows; ++r) {
      for (int64_t col = g.last_column_only ? g.cols - 1 : 0; col < g.cols; ++col) {
        wanted.push_back(offsets[i] + r * g.cols + col);
      }
    }
  }
  at::Tensor rows = x.select(0, 0);
  if (static_cast<int64_t>(wanted.size()) < x.size(1))
    rows = rows.index_select(0, at::tensor(wanted, at::kLong).to(x.device(), at::kLong, /*non_blocking=*/true));
  const at::Tensor logits = kernels::linear(rows.unsqueeze(0), lm.lm_head, {}, lm.lm_head_fp8).squeeze(0);
  std::vector<at::Tensor> out;
  int64_t first = 0;
  for (const Segment& g : segments) {
    const int64_t cols = g.last_column_only ? 1 : g.cols;
    out.push_back(logits.narrow(0, first, g.rows * cols).view({g.rows, cols, logits.size(1)}));
    first += g.rows * cols;
  }
  return out;
}

/// A prefill's MLP over runs of rows: a window of n >= 2 * kMlpRunRows rows without tensor
/// parallelism computes it in at most kMlpRuns runs of at least kMlpRunRows rows (the last takes
/// the rest), so its [rows, intermediate] activations are one run's, not the window's: a
/// 512-token prompt of the 100M bench model peaked at 452.0 instead of 460.3 MB (bf16), 368.1
/// instead of 377.4 (FP8; runs of 256: 456.0 and 369.6), its prefill time unchanged. At most 4
/// runs: 16-bit and FP8 weights are widened once per product call. On the GEMM tiles (AVX2,
/// AVX-512) a row's result does not depend on the other rows, so the values are those of one
/// pass; ATen's GEMM (portable path, VLMGEN_CPU_ISA=aten, CUDA) may round a run differently.
constexpr int64_t kMlpRunRows = 128;
constexpr int64_t kMlpRuns = 4;

/// Whether x += MLP(h) may run in runs, adding into x in place: many rows, x contiguous, and
/// nothing that autograd records (x's old values may be saved for a backward pass).
bool mlp_in_runs(const at::Tensor& x, const at::Tensor& h, const qwen_vl::DecoderLayer& w) {
  if (h.numel() < 2 * kMlpRunRows * h.size(-1) || !x.is_contiguous()) return false;
  if (!at::GradMode::is_enabled()) return true;
  for (const at::Tensor* t : {&x, &h, &w.gate_proj.weight, &w.up_proj.weight, &w.down_proj.weight})
    if (t->requires_grad()) return false;
  return true;
}

/// x += down(silu(gate(h)) * up(h)) in runs of rows (mlp_in_runs), in x's own storage.
void add_mlp_in_runs(at::Tensor& x, const at::Tensor& h, const qwen_vl::DecoderLayer& w) {
  const int64_t n = h.numel() / h.size(-1);
  const int64_t run_rows = std::max(kMlpRunRows, (n + kMlpRuns - 1) / kMlpRuns), runs = n / run_rows;
  const at::Tensor rows_in = h.reshape({n, h.size(-1)});
  at::Tensor rows_out = x.view({n, x.size(-1)});
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t begin = r * run_rows, len = r + 1 < runs ? run_rows : n - begin;
    const at::Tensor part = rows_in.narrow(0, begin, len);
    at::Tensor gated = detail::apply_linear(part, w.gate_proj);
    kernels::silu_mul_into(gated, detail::apply_linear(part, w.up_proj));
    rows_out.narrow(0, begin, len).add_(detail::apply_row_parallel(gated, w.down_proj, nullptr));
  }
}

/// x + y into the residual stream: in x's storage when x is a tensor the layer loop made (`owned`)
/// and autograd records neither, else a new tensor (then owned). A prefill then keeps one stream
/// instead of allocating a new [B, S, hidden] tensor per addition.
void add_to_stream(at::Tensor& x, const at::Tensor& y, bool& owned) {
  if (owned && !x.requires_grad() && !y.requires_grad() && x.is_contiguous()) {
    x.add_(y);
  } else {
    x = x + y;
    owned = true;
  }
}

}  // namespace

std::vector<at::Tensor> QwenVl::run_language_model(at::Tensor x, const at::Tensor& position_ids,
                                                   const std::vector<LmSegment>& segments, const at::Tensor& deepstack,
                                                   const at::Tensor& deepstack_rows) const {
  const QwenVlConfig& c = config_;
  const int64_t b = x.size(0);
  const int64_t s = x.size(1);
  // Under TP this rank computes heads / tp query heads and kv_heads / tp KV heads.
  const int64_t tp = parallel_.tp_size();
  const int64_t heads = c.num_attention_heads / tp;
  const int64_t kv_heads = c.num_key_value_heads / tp;
  const int64_t head_dim = c.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  const bool one = segments.size() == 1;

  auto [cos, sin] = mrope_cos_sin(position_ids, c);

  const std::vector<AttentionWindow> windows = attention_windows(segments, scale);
  // Attention of every segment over its own cache; q [b, heads, s, D], k and v [b, kv, s, D].
  const std::vector<int64_t> offsets = stream_offsets(segments);
  auto attention = [&](int64_t layer, at::Tensor q, at::Tensor k, at::Tensor v) {
    if (!one) return attend_segments(layer, q, k, v, segments, offsets, windows).view({b, s, heads * head_dim});
    if (segments[0].context != nullptr) std::tie(k, v) = segments[0].context->append_kv(layer, k, v);
    return attend(q, k, v, windows[0]).transpose(1, 2).reshape({b, s, heads * head_dim});
  };

  // Sequence parallelism for windows of more than one token: between blocks each rank keeps
  // [B, padded / tp, hidden] of the residual stream; a one-token decode step is not split.
  // Attention and the MLP see the whole window (gathered, padding dropped), so positions, the
  // mask and the KV cache are the same as without SP.
  Communicator* comm = tp_comm_;
  const bool split = comm != nullptr && parallel_.sequence_parallel() && one && s > 1;
  int64_t padded = s;
  if (split) {
    SequenceShard shard = scatter_sequence(x, comm);
    x = shard.local;
    padded = shard.padded_len;
  }
  auto whole = [&](const at::Tensor& local) { return split ? gather_sequence(local, s, comm) : local; };
  // Row-parallel output of a block, back in the residual stream's layout.
  auto reduce = [&](const at::Tensor& in, const qwen_vl::Linear& linear) {
    if (!split) return detail::apply_row_parallel(in, linear, comm);
    return detail::apply_row_parallel(pad_sequence(in, padded), linear, comm,
                                      RowParallelReduce::kReduceScatterSequence);
  };

  // DeepStack (Qwen3-VL): feature k of every image token in the window is added to the residual
  // stream after layer k. Under SP the additions are laid out like the stream and sliced the same.
  std::vector<at::Tensor> deepstack_add;
  if (deepstack.defined()) {
    const int64_t hs = x.size(2);
    for (int64_t k = 0; k < deepstack.size(1); ++k) {
      at::Tensor add = at::zeros({b * s, hs}, x.options());
      add.index_copy_(0, deepstack_rows, deepstack.select(1, k));
      add = add.view({b, s, hs});
      deepstack_add.push_back(split ? scatter_sequence(add, comm).local : add);
    }
  }

  // A decode step (one new column per row over a KV cache) on the CPU: the fused layers.
  std::vector<detail::FusedDecodeRows> fused;
  if (comm == nullptr && !deepstack.defined()) fused = fused_rows(segments, offsets, windows);
  const bool run_fused = !fused.empty() && detail::fused_decode_fits(lm_, c, x, fused);
  if (run_fused) x = detail::fused_decode_layers(lm_, c, x, cos, sin, fused).view(x.sizes());

  bool owned = false;  // whether x is a tensor of the loop's own (add_to_stream)
  for (size_t layer = 0; layer < lm_.layers.size() && !run_fused; ++layer) {
    const qwen_vl::DecoderLayer& w = lm_.layers[layer];
    at::Tensor h = whole(detail::apply_rms_norm(x, w.input_layernorm, c.rms_norm_eps));
    at::Tensor q = detail::apply_linear(h, w.q_proj).view({b, s, heads, head_dim});
    at::Tensor k = detail::apply_linear(h, w.k_proj).view({b, s, kv_heads, head_dim});
    if (w.q_norm.defined()) {  // Qwen3: RMSNorm over each head before the rotary
      q = detail::apply_rms_norm(q, w.q_norm, c.rms_norm_eps);
      k = detail::apply_rms_norm(k, w.k_norm, c.rms_norm_eps);
    }
    q = q.transpose(1, 2);
    k = k.transpose(1, 2);
    at::Tensor v = detail::apply_linear(h, w.v_proj).view({b, s, kv_heads, head_dim}).transpose(1, 2);
    h.reset();  // not kept through the attention; q, k and v, moved into it, end with its statement
    q = detail::apply_rotary(q, cos, sin);
    k = detail::apply_rotary(k, cos, sin);
    add_to_stream(x, reduce(attention(static_cast<int64_t>(layer), std::move(q), std::move(k), std::move(v)), w.o_proj),
                  owned);

    h = whole(detail::apply_rms_norm(x, w.post_attention_layernorm, c.rms_norm_eps));
    if (comm == nullptr && mlp_in_runs(x, h, w)) {
      add_mlp_in_runs(x, h, w);
    } else {
      at::Tensor gated = detail::apply_linear(h, w.gate_proj);
      kernels::silu_mul_into(gated, detail::apply_linear(h, w.up_proj));
      add_to_stream(x, reduce(gated, w.down_proj), owned);
    }
    if (layer < deepstack_add.size()) add_to_stream(x, deepstack_add[layer], owned);
  }
  x = whole(detail::apply_rms_norm(x, lm_.norm, c.rms_norm_eps));
  // [B, S or 1, vocab] (vocab / tp under TP), float32
  if (one)
    return {
        kernels::linear(segments[0].last_column_only ? x.narrow(1, s - 1, 1) : x, lm_.lm_head, {}, lm_.lm_head_fp8)};
  return segment_logits(x, segments, offsets, lm_);
}

}  // namespace vlmgen
