#pragma once

// Megatron-style tensor- and sequence-parallel building blocks as plain functions over a
// Communicator. With a null communicator (or a group of one) every function takes the
// single-process path and communicates nothing.
//
// Layouts (Megatron's): column-parallel weights are split by output rows ([out/tp, in]),
// row-parallel weights by input columns ([out, in/tp]), the vocabulary by rows of the table
// ([vocab/tp, hidden]). Sequence parallelism splits dim 1 of [B, S, H] activations into tp equal
// chunks, the sequence padded at the end to a multiple of tp.
//
//   auto h = vlmgen::column_parallel_linear(x, w_up_local, b_up_local, comm);   // [B, S, ffn/tp]
//   auto y = vlmgen::row_parallel_linear(at::gelu(h), w_down_local, b_down, comm);  // [B, S, H]

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/error.h"

namespace vlmgen {

namespace detail {

inline int64_t group_size(const Communicator* comm) { return comm == nullptr ? 1 : comm->size(); }

inline at::Tensor shard_dim(const at::Tensor& weight, int64_t dim, int64_t tp_rank, int64_t tp_size, const char* what) {
  VLMGEN_CHECK(weight.defined(), "cannot shard an undefined tensor");
  VLMGEN_CHECK(tp_size >= 1 && tp_rank >= 0 && tp_rank < tp_size,
               "tp rank {} is out of range for tensor-parallel size {}", tp_rank, tp_size);
  VLMGEN_CHECK(weight.dim() > dim, "cannot shard {} of a tensor with {} dims ({})", what, weight.dim(),
               shape_str(weight));
  const int64_t n = weight.size(dim);
  VLMGEN_CHECK(n % tp_size == 0,
               "cannot shard the {} {} of tensor {} over tensor-parallel size {}: {} is not divisible by {}", n, what,
               shape_str(weight), tp_size, n, tp_size);
  const int64_t part = n / tp_size;
  return weight.narrow(dim, tp_rank * part, part).contiguous();
}

}  // namespace detail

/// Rank `tp_rank`'s block of rows (dim 0) of `weight`, contiguous: the local part of a
/// column-parallel weight or bias, or of a vocab-parallel table. vlmgen::Error naming the numbers
/// when the rows do not divide evenly.
inline at::Tensor shard_rows(const at::Tensor& weight, int64_t tp_rank, int64_t tp_size) {
  return detail::shard_dim(weight, 0, tp_rank, tp_size, "rows");
}

/// Rank `tp_rank`'s block of columns (dim 1) of `weight`, contiguous: the local part of a
/// row-parallel weight.
inline at::Tensor shard_cols(const at::Tensor& weight, int64_t tp_rank, int64_t tp_size) {
  return detail::shard_dim(weight, 1, tp_rank, tp_size, "columns");
}

/// y = x W^T + b with W split by output rows: `local_weight` [out/tp, in], `local_bias` [out/tp]
/// (undefined: none). Returns this rank's [.., out/tp], or the full [.., out] when
/// `gather_output` (an all-gather along the last dim).
inline at::Tensor column_parallel_linear(const at::Tensor& x, const at::Tensor& local_weight,
                                         const at::Tensor& local_bias, Communicator* comm, bool gather_output = false) {
  VLMGEN_CHECK(local_weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == local_weight.size(1),
               "column_parallel_linear: input {} does not match local weight {} ([out/tp, in])", detail::shape_str(x),
               detail::shape_str(local_weight));
  at::Tensor y = detail::linear(x, local_weight, local_bias);
  if (!gather_output || detail::group_size(comm) == 1) return y;
  return comm->all_gather(y, -1);
}

/// How row_parallel_linear combines the ranks' partial sums.
enum class RowParallelReduce {
  /// All-reduce: every rank gets the full [B, S, out].
  kAllReduce,
  /// Reduce-scatter along the sequence (dim 1), for sequence parallelism: every rank gets its
  /// [B, S/tp, out] chunk. S must be divisible by tp (scatter_sequence pads it).
  kReduceScatterSequence,
};

/// The second half of row_parallel_linear, for a caller that computed this rank's partial product
/// itself: the ranks' partial sums combined by `reduce`, then `bias` (undefined: none) added once.
inline at::Tensor row_parallel_reduce(at::Tensor partial, const at::Tensor& bias, Communicator* comm,
                                      RowParallelReduce reduce = RowParallelReduce::kAllReduce) {
  if (detail::group_size(comm) > 1) {
    if (reduce == RowParallelReduce::kAllReduce) {
      comm->all_reduce_sum(partial);
    } else {
      VLMGEN_CHECK(partial.dim() >= 3, "row_parallel_linear with a sequence reduce-scatter needs [B, S, out], got {}",
                   detail::shape_str(partial));
      partial = comm->reduce_scatter_sum(partial, 1);
    }
  }
  return bias.defined() ? partial + bias : partial;
}

/// y = x W^T + b with W split by input columns: `x_local` [.., in/tp] (the output of a
/// column-parallel layer), `local_weight` [out, in/tp], `bias` [out] (undefined: none), added
/// once after the reduction.
inline at::Tensor row_parallel_linear(const at::Tensor& x_local, const at::Tensor& local_weight, const at::Tensor& bias,
                                      Communicator* comm, RowParallelReduce reduce = RowParallelReduce::kAllReduce) {
  VLMGEN_CHECK(local_weight.dim() == 2 && x_local.dim() >= 1 && x_local.size(-1) == local_weight.size(1),
               "row_parallel_linear: local input {} does not match local weight {} ([out, in/tp])",
               detail::shape_str(x_local), detail::shape_str(local_weight));
  return row_parallel_reduce(detail::linear(x_local, local_weight), bias, comm, reduce);
}

/// Embedding lookup with the table split by vocabulary rows: `local_table` [vocab/tp, hidden]
/// holds ids [vocab_start, vocab_start + vocab/tp). Each rank looks up the ids it owns (zeros
/// elsewhere) and an all-reduce assembles the rows. Every rank must hold the same number of rows
/// (as shard_rows makes them); ids outside [0, vocab/tp * tp) are a vlmgen::Error.
inline at::Tensor vocab_parallel_embedding(const at::Tensor& ids, const at::Tensor& local_table, int64_t vocab_start,
                                           Communicator* comm) {
  VLMGEN_CHECK(local_table.dim() == 2, "vocab_parallel_embedding: the local table must be [vocab/tp, hidden], got {}",
               detail::shape_str(local_table));
  VLMGEN_CHECK(detail::is_integral(ids), "vocab_parallel_embedding: ids must be integers, got {}",
               c10::toString(ids.scalar_type()));
  const int64_t tp = detail::group_size(comm);
  const int64_t local_vocab = local_table.size(0);
  const int64_t vocab = local_vocab * tp;
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>();
    const int64_t hi = ids.max().item<int64_t>();
    VLMGEN_CHECK(lo >= 0 && hi < vocab,
                 "vocab_parallel_embedding: token ids span [{}, {}], outside the vocabulary [0, {})", lo, hi, vocab);
  }
  if (tp == 1) return at::embedding(local_table, ids - vocab_start).to(at::kFloat);
  at::Tensor local_ids = ids.to(at::kLong) - vocab_start;
  at::Tensor owned = (local_ids >= 0) & (local_ids < local_vocab);
  at::Tensor rows = at::embedding(local_table, local_ids.masked_fill(~owned, 0)).to(at::kFloat);
  rows.masked_fill_(~owned.unsqueeze(-1), 0);
  comm->all_reduce_sum(rows);
  return rows;
}

/// This rank's part of a sequence-parallel activation.
struct SequenceShard {
  at::Tensor local;        // [B, padded_len / tp, ...]: this rank's chunk of the (padded) sequence
  int64_t seq_len = 0;     // S before padding; pass it to gather_sequence to drop the padding
  int64_t padded_len = 0;  // S rounded up to a multiple of tp (the padding is zeros at the end)
};

/// Splits dim 1 of `x` [B, S, ...] across the group: pads S at the end to a multiple of tp and
/// keeps this rank's chunk. Purely local (every rank holds the full `x` before the split).
inline SequenceShard scatter_sequence(const at::Tensor& x, Communicator* comm) {
  VLMGEN_CHECK(x.dim() >= 2, "scatter_sequence needs [B, S, ...], got {}", detail::shape_str(x));
  const int64_t tp = detail::group_size(comm);
  SequenceShard shard;
  shard.seq_len = x.size(1);
  shard.padded_len = (shard.seq_len + tp - 1) / tp * tp;
  if (tp == 1) {
    shard.local = x;
    return shard;
  }
  at::Tensor padded = x;
  if (shard.padded_len != shard.seq_len) {
    std::vector<int64_t> pad_shape = x.sizes().vec();
    pad_shape[1] = shard.padded_len - shard.seq_len;
    padded = at::cat({x, at::zeros(pad_shape, x.options())}, 1);
  }
  const int64_t chunk = shard.padded_len / tp;
  shard.local = padded.narrow(1, comm->rank() * chunk, chunk).contiguous();
  return shard;
}

/// The inverse of scatter_sequence: all-gathers dim 1 and keeps the first `seq_len` positions
/// (pass the padded length to keep the padding, e.g. before a column-parallel layer inside a
/// block).
inline at::Tensor gather_sequence(const at::Tensor& local, int64_t seq_len, Communicator* comm) {
  VLMGEN_CHECK(local.dim() >= 2, "gather_sequence needs [B, S/tp, ...], got {}", detail::shape_str(local));
  const int64_t tp = detail::group_size(comm);
  VLMGEN_CHECK(seq_len >= 0 && seq_len <= local.size(1) * tp && seq_len > (local.size(1) - 1) * tp,
               "gather_sequence: {} ranks holding {} positions each cannot make a sequence of {} (expected {}..{})", tp,
               local.size(1), seq_len, (local.size(1) - 1) * tp + 1, local.size(1) * tp);
  at::Tensor full = tp == 1 ? local : comm->all_gather(local, 1);
  return seq_len == full.size(1) ? full : full.narrow(1, 0, seq_len);
}

/// Sums the ranks' partial [B, S, ...] (the output of a row-parallel layer before its
/// reduction) and keeps this rank's sequence chunk [B, S/tp, ...]. S must be a multiple of tp.
inline at::Tensor reduce_scatter_sequence(const at::Tensor& partial, Communicator* comm) {
  VLMGEN_CHECK(partial.dim() >= 2, "reduce_scatter_sequence needs [B, S, ...], got {}", detail::shape_str(partial));
  if (detail::group_size(comm) == 1) return partial;
  return comm->reduce_scatter_sum(partial, 1);
}

/// Greedy choice over vocab-parallel logits without gathering the vocabulary: each rank's
/// (max value, global index) pair is all-gathered and the best is kept, ties to the lowest
/// global index; the same ids as at::argmax over the full [B, V] logits, NaN included (a NaN
/// wins, as in at::argmax). `local_logits` [B, V/tp] holds ids [vocab_start, vocab_start + V/tp).
/// Returns [B] int64 global ids, on the logits' device. `nan_rows` (optional) gets the rows no
/// token can be chosen from: a NaN in some rank's block, or no logit above -inf.
inline at::Tensor vocab_parallel_argmax(const at::Tensor& local_logits, int64_t vocab_start, Communicator* comm,
                                        std::vector<bool>* nan_rows = nullptr) {
  VLMGEN_CHECK(local_logits.dim() == 2 && local_logits.size(1) > 0,
               "vocab_parallel_argmax expects local logits [B, V/tp] with V/tp > 0, got {}",
               detail::shape_str(local_logits));
  at::Tensor local_index = local_logits.argmax(-1);
  // [B], bool: some rank's block has a NaN, or no logit of the row is above -inf
  auto report_nan = [&](const at::Tensor& rows) {
    if (nan_rows == nullptr) return;
    at::Tensor host = rows.to(at::kCPU);
    nan_rows->assign(static_cast<size_t>(host.size(0)), false);
    for (int64_t b = 0; b < host.size(0); ++b) (*nan_rows)[b] = host[b].item<bool>();
  };
  if (detail::group_size(comm) == 1) {
    report_nan(local_logits.isnan().any(-1) | local_logits.amax(-1).isneginf());
    return local_index + vocab_start;
  }
  // float64 holds every float32/bf16/fp16 value and every index below 2^53 exactly.
  at::Tensor value = local_logits.gather(-1, local_index.unsqueeze(-1)).squeeze(-1).to(at::kDouble);
  at::Tensor pair = at::stack({value, (local_index + vocab_start).to(at::kDouble)}, -1);  // [B, 2]
  at::Tensor all = comm->all_gather(pair.unsqueeze(0), 0);                                // [tp, B, 2]
  at::Tensor values = all.select(-1, 0);
  at::Tensor indices = all.select(-1, 1).to(at::kLong);
  at::Tensor nan = values.isnan();
  at::Tensor best = std::get<0>(values.max(0));  // NaN when a row has one
  report_nan(nan.any(0) | best.isneginf());
  at::Tensor candidate = (values == best.unsqueeze(0)) | (nan & nan.any(0, /*keepdim=*/true));
  at::Tensor masked = indices.masked_fill(~candidate, std::numeric_limits<int64_t>::max());
  return std::get<0>(masked.min(0));
}

/// The full last-position logits [B, V] from vocab-parallel ones, for sampling (which needs the
/// whole distribution). Takes [B, V/tp], or [B, S, V/tp] whose last position is used.
inline at::Tensor gather_last_position_logits(const at::Tensor& local_logits, Communicator* comm) {
  VLMGEN_CHECK(local_logits.dim() == 2 || local_logits.dim() == 3,
               "gather_last_position_logits expects [B, V/tp] or [B, S, V/tp], got {}",
               detail::shape_str(local_logits));
  at::Tensor last = local_logits.dim() == 3 ? local_logits.select(1, -1) : local_logits;
  if (detail::group_size(comm) == 1) return last;
  return comm->all_gather(last, -1);
}

}  // namespace vlmgen
