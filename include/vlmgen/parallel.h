#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "vlmgen/error.h"

namespace vlmgen {

/// The collective operations of a tensor-parallel group (implemented over c10d by the compiled
/// library). A single process has none.
class Communicator;

/// Where this process sits in a Megatron-style layout: ranks, the tensor-parallel group and
/// whether sequence parallelism is on. A value type, cheap to copy.
///
///   auto par = vlmgen::ParallelContext::single().sequence_parallel(true);
///   vlmgen::Generator gen(model, par);
class ParallelContext {
 public:
  /// One process, tensor-parallel size 1.
  static ParallelContext single() { return ParallelContext(); }

  int64_t world_size() const { return world_size_; }
  int64_t rank() const { return rank_; }
  int64_t tp_size() const { return tp_size_; }
  int64_t tp_rank() const { return tp_rank_; }
  bool sequence_parallel() const { return sequence_parallel_; }
  /// The tensor-parallel group's collectives; null when tp_size() == 1.
  const std::shared_ptr<Communicator>& tp_group() const { return tp_group_; }

  /// Turns sequence parallelism on or off. Default: off.
  ParallelContext& sequence_parallel(bool on) {
    sequence_parallel_ = on;
    return *this;
  }

  /// A multi-rank layout (used by the c10d launcher). Checks the numbers.
  static ParallelContext make(int64_t world_size, int64_t rank, int64_t tp_size, int64_t tp_rank,
                              std::shared_ptr<Communicator> tp_group) {
    VLMGEN_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "rank {} is out of range for world size {}", rank,
                 world_size);
    VLMGEN_CHECK(tp_size >= 1 && world_size % tp_size == 0, "tensor-parallel size {} does not divide world size {}",
                 tp_size, world_size);
    VLMGEN_CHECK(tp_rank >= 0 && tp_rank < tp_size, "tp rank {} is out of range for tp size {}", tp_rank, tp_size);
    VLMGEN_CHECK(tp_size == 1 || tp_group != nullptr, "tp size {} needs a communicator", tp_size);
    ParallelContext p;
    p.world_size_ = world_size;
    p.rank_ = rank;
    p.tp_size_ = tp_size;
    p.tp_rank_ = tp_rank;
    p.tp_group_ = std::move(tp_group);
    return p;
  }

 private:
  int64_t world_size_ = 1;
  int64_t rank_ = 0;
  int64_t tp_size_ = 1;
  int64_t tp_rank_ = 0;
  bool sequence_parallel_ = false;
  std::shared_ptr<Communicator> tp_group_;
};

/// Whether a request decodes with a KV cache, and why not when it does not.
struct KvCacheDecision {
  bool use_kv_cache = false;
  std::string reason;  // empty when the request is honoured as asked
};

/// The SP -> no-cache fallback: a KV cache is used when it is requested and the model supports
/// it, and, under sequence parallelism, only when the model can decode with a cache under SP.
inline KvCacheDecision decide_kv_cache(bool requested, bool model_supports_kv_cache, bool model_supports_kv_under_sp,
                                       const ParallelContext& parallel) {
  if (!requested) return {false, ""};
  if (!model_supports_kv_cache) {
    return {false, "the model does not support a KV cache; decoding by full-prefix recompute"};
  }
  if (parallel.sequence_parallel() && !model_supports_kv_under_sp) {
    return {false,
            "sequence parallelism is on and the model cannot decode with a KV cache under it; decoding by "
            "full-prefix recompute, with vision inputs replayed at every step"};
  }
  return {true, ""};
}

}  // namespace vlmgen
