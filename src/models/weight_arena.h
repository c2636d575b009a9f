#pragma once

// Where a loader puts the weights a decode step streams: one block of address space advised for
// transparent huge pages, filled as the tensors are read. Private to src/models.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint_folder.h"
#include "vlmgen/models/load_options.h"
#include "vlmgen/models/qwen_vl.h"

namespace vlmgen::detail {

/// Tensors placed one after another (each at a 64-byte boundary) in an anonymous mapping advised
/// for 2 MiB pages (madvise MADV_HUGEPAGE), which lives while any tensor on it does.
///
/// Why: a decode step reads every weight once, and with 4 KiB pages each page's first read waits
/// on a page walk (two under a hypervisor); here decode ran 4-17% faster from 2 MiB pages. The
/// loader reads each weight straight into its place, so nothing is copied or freed on the way
/// (freeing large blocks after loading would also raise glibc's mmap threshold, after which a
/// prefill's temporaries stay resident in the heap: +35 MB peak on the 100M bench model).
class WeightArena {
 public:
  /// Reserves `max_bytes` of address space (nothing resident until written). Disabled (`enabled`
  /// false, off Linux, or the reservation refused), allocate() is at::empty.
  WeightArena(int64_t max_bytes, bool enabled);
  WeightArena(const WeightArena&) = delete;
  WeightArena& operator=(const WeightArena&) = delete;

  /// An uninitialized contiguous CPU tensor: in the arena while it has room, else at::empty.
  at::Tensor allocate(at::IntArrayRef shape, at::ScalarType dtype);
  /// `t`'s values in a tensor from allocate() (for a weight that was read some other way).
  at::Tensor place(const at::Tensor& t);
  /// Gives back the address space after the last tensor placed; allocate() then falls back.
  void finish();
  /// Bytes placed so far.
  int64_t used() const { return used_; }
  /// Whether allocate() can still place tensors in the mapping.
  bool active() const { return mapping_ != nullptr && used_ < capacity_; }

 private:
  struct Mapping;
  std::shared_ptr<Mapping> mapping_;
  char* base_ = nullptr;  // 2 MiB aligned, inside the mapping
  int64_t used_ = 0;
  int64_t capacity_ = 0;
};

/// The weights a decode step reads whole: each layer's q, k, v, o, gate, up and down matrices
/// (Qwen, Llama and Gemma layers name them alike) and the output head.
template <class Layer>
std::vector<const at::Tensor*> decode_streamed(const std::vector<Layer>& layers, const at::Tensor& lm_head) {
  std::vector<const at::Tensor*> out;
  for (const Layer& layer : layers)
    for (const qwen_vl::Linear* l : {&layer.q_proj, &layer.k_proj, &layer.v_proj, &layer.o_proj, &layer.gate_proj,
                                     &layer.up_proj, &layer.down_proj})
      out.push_back(&l->weight);
  out.push_back(&lm_head);
  return out;
}

/// A loader's reads of a model's weights: those a decode step streams (set; the tensors as the
/// model allocated them, their shapes the rank's) go into one WeightArena on the CPU with
/// LoadOptions::huge_pages, the others where they went before.
class StreamedWeights {
 public:
  StreamedWeights(std::vector<const at::Tensor*> set, const LoadOptions& options)
      : set_(std::move(set)), device_(options.device), arena_(bound(set_), options.huge_pages && device_.is_cpu()) {}

  bool holds(const at::Tensor* t) const { return std::find(set_.begin(), set_.end(), t) != set_.end(); }
  /// The weight `target` (one of the model's tensors) as read_shard reads it, in `dtype`.
  at::Tensor read(const SafetensorsCheckpoint& checkpoint, const std::string& name, const std::vector<int64_t>& full,
                  qwen_vl::ShardLayout layout, int64_t rank, int64_t tp, at::ScalarType dtype,
                  const at::Tensor& target) {
    if (!holds(&target) || !device_.is_cpu())
      return read_shard(checkpoint, name, full, layout, rank, tp, dtype).to(device_);
    at::Tensor place = arena_.allocate(target.sizes(), dtype);
    read_shard_into(checkpoint, name, full, layout, rank, tp, place);
    return place;
  }
  /// `t` (read some other way for `target`) moved into the arena when target is streamed.
  at::Tensor place(const at::Tensor* target, const at::Tensor& t) {
    return holds(target) && t.device().is_cpu() && arena_.active() ? arena_.place(t) : t;
  }
  /// After the last read: the unused address space goes back.
  void finish() { arena_.finish(); }

 private:
  /// Room for the tensors at their present shapes in float32 (the widest dtype a loader stores
  /// them in), on 64-byte boundaries.
  static int64_t bound(const std::vector<const at::Tensor*>& set) {
    int64_t bytes = 0;
    for (const at::Tensor* t : set) bytes += t->numel() * 4 + 64;
    return bytes;
  }

  std::vector<const at::Tensor*> set_;
  at::Device device_;
  WeightArena arena_;
};

}  // namespace vlmgen::detail
