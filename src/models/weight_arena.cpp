#include "weight_arena.h"

#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace vlmgen::detail {
namespace {

constexpr int64_t kHugePageBytes = int64_t{2} << 20;
constexpr int64_t kAlign = 64;

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

}  // namespace

/// One anonymous mapping; unmapped when the arena and the last tensor placed in it are gone.
struct WeightArena::Mapping {
  void* start = nullptr;
  size_t bytes = 0;
  Mapping(void* s, size_t n) : start(s), bytes(n) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
#if defined(__linux__)
    ::munmap(start, bytes);
#endif
  }
};

WeightArena::WeightArena(int64_t max_bytes, bool enabled) {
#if defined(__linux__)
  if (!enabled || max_bytes <= 0) return;
  const size_t bytes = static_cast<size_t>(round_up(max_bytes, kHugePageBytes) + kHugePageBytes);
  void* start = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (start == MAP_FAILED) return;
  mapping_ = std::make_shared<Mapping>(start, bytes);
  base_ = reinterpret_cast<char*>(round_up(reinterpret_cast<intptr_t>(start), kHugePageBytes));
  capacity_ = round_up(max_bytes, kHugePageBytes);
  ::madvise(base_, static_cast<size_t>(capacity_), MADV_HUGEPAGE);  // advice: a refusal only costs the speed
#else
  (void)max_bytes;
  (void)enabled;
#endif
}

at::Tensor WeightArena::allocate(at::IntArrayRef shape, at::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (mapping_ == nullptr || bytes == 0 || bytes > capacity_ - used_) return at::empty(shape, dtype);
  char* place = base_ + used_;
  used_ += round_up(bytes, kAlign);
  auto* keep = new std::shared_ptr<Mapping>(mapping_);
  return at::from_blob(
      place, shape, [keep](void*) { delete keep; }, at::TensorOptions().dtype(dtype));
}

at::Tensor WeightArena::place(const at::Tensor& t) {
  at::Tensor out = allocate(t.sizes(), t.scalar_type());
  out.copy_(t);
  return out;
}

void WeightArena::finish() {
#if defined(__GLIBC__)
  // The load's temporaries (converted and dequantized copies) are freed by now; the heap pages
  // they leave between the weights go back to the system instead of staying resident.
  ::malloc_trim(0);
#endif
#if defined(__linux__)
  if (mapping_ == nullptr) return;
  if (used_ == 0) {  // nothing placed: all of it goes
    mapping_.reset();
    base_ = nullptr;
    capacity_ = 0;
    return;
  }
  // Keep whole 2 MiB pages up to the last tensor; the reserved rest goes back.
  char* end = base_ + round_up(used_, kHugePageBytes);
  char* mapping_end = static_cast<char*>(mapping_->start) + mapping_->bytes;
  if (mapping_end > end) {
    ::munmap(end, static_cast<size_t>(mapping_end - end));
    mapping_->bytes = static_cast<size_t>(end - static_cast<char*>(mapping_->start));
  }
  capacity_ = used_;
#endif
}

}  // namespace vlmgen::detail
