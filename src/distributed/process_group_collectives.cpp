// Collectives over c10d process groups (Gloo for CPU tensors, NCCL for CUDA tensors). Both group
// types expose the same verbs in 1.13 and 2.x, so one template serves both.

#include <utility>
#include <vector>

#include "collectives.h"

namespace vlmgen::detail {
namespace {

template <typename Group>
class ProcessGroupCollectives final : public Collectives {
 public:
  // native_reduce_scatter: the group implements _reduce_scatter_base; bfloat16: it reduces
  // bfloat16 tensors itself.
  ProcessGroupCollectives(c10::intrusive_ptr<Group> group, std::string name, int64_t rank, int64_t size,
                          bool native_reduce_scatter, bool bfloat16)
      : group_(std::move(group)),
        name_(std::move(name)),
        rank_(rank),
        size_(size),
        native_reduce_scatter_(native_reduce_scatter),
        bfloat16_(bfloat16) {}

  std::string name() const override { return name_; }

  bool supports(at::ScalarType type) const override {
    switch (type) {
      case at::kFloat:
      case at::kDouble:
      case at::kHalf:
      case at::kInt:
      case at::kLong:
      case at::kChar:
      case at::kByte: return true;
      case at::kBFloat16: return bfloat16_;
      default: return false;
    }
  }

  void all_reduce_sum(at::Tensor& tensor) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d_compat::wait(group_->allreduce(tensors));  // AllreduceOptions' default op is SUM
  }

  std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override {
    std::vector<at::Tensor> inputs{tensor};
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int64_t r = 0; r < size_; ++r) outputs[0].push_back(at::empty_like(tensor));
    c10d_compat::wait(group_->allgather(outputs, inputs));
    return outputs[0];
  }

  at::Tensor reduce_scatter_sum(const at::Tensor& tensor) override {
    const int64_t chunk = tensor.size(0) / size_;
    at::Tensor input = tensor;
    if (native_reduce_scatter_) {
      std::vector<int64_t> shape = tensor.sizes().vec();
      shape[0] = chunk;
      at::Tensor output = at::empty(shape, tensor.options());
      c10d_compat::wait(group_->_reduce_scatter_base(output, input));
      return output;
    }
    // Gloo 1.13 does not implement reduce_scatter. An all-to-all moves each chunk to its owner
    // ((size-1)/size of the tensor per rank, like a ring reduce-scatter, half of what an
    // all-reduce + narrow would send); the owner then sums the chunks in rank order.
    at::Tensor received = at::empty_like(tensor);
    std::vector<int64_t> equal_split;  // empty: size() equal chunks along dim 0
    c10d_compat::wait(group_->alltoall_base(received, input, equal_split, equal_split));
    at::Tensor sum = received.narrow(0, 0, chunk).clone();
    for (int64_t r = 1; r < size_; ++r) sum.add_(received.narrow(0, r * chunk, chunk));
    return sum;
  }

  void broadcast(at::Tensor& tensor, int64_t root) override {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    c10d_compat::wait(group_->broadcast(tensors, options));
  }

  void barrier() override { c10d_compat::wait(group_->barrier()); }

 private:
  c10::intrusive_ptr<Group> group_;
  std::string name_;
  int64_t rank_;
  int64_t size_;
  bool native_reduce_scatter_;
  bool bfloat16_;
};

}  // namespace

#ifdef VLMGEN_HAVE_C10D_GLOO
std::unique_ptr<Collectives> make_gloo_collectives(c10::intrusive_ptr<c10d_compat::GlooGroup> group, int64_t rank,
                                                   int64_t size) {
  // Gloo 1.13 implements neither reduce_scatter nor bfloat16 reductions.
  return std::make_unique<ProcessGroupCollectives<c10d_compat::GlooGroup>>(std::move(group), "gloo", rank, size,
                                                                           /*native_reduce_scatter=*/false,
                                                                           /*bfloat16=*/false);
}
#endif

#ifdef VLMGEN_HAVE_C10D_NCCL
std::unique_ptr<Collectives> make_nccl_collectives(c10::intrusive_ptr<c10d_compat::NcclGroup> group, int64_t rank,
                                                   int64_t size) {
  return std::make_unique<ProcessGroupCollectives<c10d_compat::NcclGroup>>(std::move(group), "nccl", rank, size,
                                                                           /*native_reduce_scatter=*/true,
                                                                           /*bfloat16=*/true);
}
#endif

}  // namespace vlmgen::detail
