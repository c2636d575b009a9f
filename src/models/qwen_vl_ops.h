#pragma once

// Functional building blocks shared by the Qwen2-VL translation units (private to src/).

#include <ATen/ATen.h>

#include <vector>

#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/distributed/tensor_parallel.h"
#include "vlmgen/kernels/cpu.h"
#include "vlmgen/models/qwen_vl.h"

namespace vlmgen::detail {

inline at::Tensor apply_linear(const at::Tensor& x, const qwen_vl::Linear& linear) {
  return kernels::linear(x, linear.weight, linear.bias, linear.fp8);
}

/// A row-parallel linear: this rank's partial product, all-reduced (or reduce-scattered along
/// the sequence), the bias added once after. Without a group, the plain linear.
inline at::Tensor apply_row_parallel(const at::Tensor& x, const qwen_vl::Linear& linear, Communicator* comm,
                                     RowParallelReduce reduce = RowParallelReduce::kAllReduce) {
  if (comm == nullptr) return apply_linear(x, linear);
  return row_parallel_reduce(kernels::linear(x, linear.weight, {}, linear.fp8), linear.bias, comm, reduce);
}

/// Rank `rank`'s slice of the full weight `full` under `layout`, contiguous.
inline at::Tensor take_shard(const at::Tensor& full, qwen_vl::ShardLayout layout, int64_t rank, int64_t tp) {
  switch (layout) {
    case qwen_vl::ShardLayout::kReplicated: return full;
    case qwen_vl::ShardLayout::kRows: return shard_rows(full, rank, tp);
    case qwen_vl::ShardLayout::kColumns: return shard_cols(full, rank, tp);
    case qwen_vl::ShardLayout::kStackedRows: {
      std::vector<at::Tensor> parts;
      for (const at::Tensor& third : full.chunk(3, 0)) parts.push_back(shard_rows(third, rank, tp));
      return at::cat(parts, 0);
    }
  }
  return full;
}

/// The inverse of take_shard over the group: every rank gets the full weight.
inline at::Tensor gather_shard(const at::Tensor& local, qwen_vl::ShardLayout layout, Communicator& comm) {
  switch (layout) {
    case qwen_vl::ShardLayout::kReplicated: return local;
    case qwen_vl::ShardLayout::kRows: return comm.all_gather(local, 0);
    case qwen_vl::ShardLayout::kColumns: return comm.all_gather(local, 1);
    case qwen_vl::ShardLayout::kStackedRows: {
      std::vector<at::Tensor> parts;
      for (const at::Tensor& third : local.chunk(3, 0)) parts.push_back(comm.all_gather(third, 0));
      return at::cat(parts, 0);
    }
  }
  return local;
}

inline at::Tensor apply_layer_norm(const at::Tensor& x, const qwen_vl::LayerNorm& norm, double eps) {
  return at::layer_norm(x, {x.size(-1)}, norm.weight, norm.bias, eps);
}

/// Qwen2 RMSNorm: x / rms(x) * weight, in fp32.
inline at::Tensor apply_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return kernels::rms_norm(x, weight, eps);
}

/// Gemma's RMSNorm: x / rms(x) * (1 + weight), in fp32 (its stored weights sit near 0).
inline at::Tensor apply_gemma_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return kernels::rms_norm(x, weight, eps, /*weight_offset=*/1.0);
}

/// HF rotary embeddings (the rotate_half convention): kernels::rotary.
inline at::Tensor apply_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return kernels::rotary(x, cos, sin);
}

/// Query columns per chunk of the prefill attention (attend_query_chunk): [B, g * 128, K] scores
/// of one KV head at a time (softmaxed in place). Against 256: a 2048-token f32 prefill of the
/// bench's 100M Qwen2-VL 370-404 -> 475 tokens/s, 512 tokens 755 -> 778, and the peak memory of a
/// 512-token prompt 11 MB lower (the bf16 model's peak over weights and KV 1.186 -> 1.142); 64
/// gained nothing more.
constexpr int64_t kAttentionChunk = 128;

/// One chunk of a prefill's grouped-query attention: query columns [c0, c0 + n) of q [B, heads, S,
/// D] over keys [key_lo, key_lo + blocked.size(2)) of k and v [B, kv, K, D] (query head i uses KV
/// head i / (heads / kv), read in place), keys where `blocked` [B, n, keys] is true left out of the
/// softmax, into columns [c0, c0 + n) of out [B, S, heads, D]. Keys outside the range must be blocked
/// for every query of the chunk: they are not computed at all. On the CPU one KV head per product
/// (scores [B, g * n, keys] at a time; the batched product runs one GEMM per head anyway, the same
/// values); all heads in one batched product elsewhere and where autograd records (a copy into a
/// slice of `out` then costs a copy of its whole gradient). A query row with every key of the range
/// blocked (padding) averages the range's values; its output is not used.
void attend_query_chunk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t c0, int64_t key_lo,
                        const at::Tensor& blocked, double scale, at::Tensor& out);

}  // namespace vlmgen::detail
