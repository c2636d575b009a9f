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

}  // namespace vlmgen::detail
