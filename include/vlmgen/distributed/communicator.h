#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace vlmgen {

/// The collectives of one tensor-parallel group: the handful of verbs Megatron-style layers
/// need, and nothing about how they travel. The compiled library implements it over c10d
/// (`init_parallel_from_env` in vlmgen/distributed/launch.h); tests or services may bring
/// their own.
///
/// Every rank of the group must call the same collectives in the same order with tensors of the
/// same shape and dtype (as in torch.distributed). A failed collective (a dead or silent peer,
/// a timeout) throws vlmgen::Error; the communicator is unusable after that. Not thread-safe:
/// the order of collectives is the contract, so one thread drives a communicator.
///
///   at::Tensor partial = at::matmul(x_local, w_local.t());
///   comm.all_reduce_sum(partial);   // every rank now holds the full sum
class Communicator {
 public:
  virtual ~Communicator() = default;

  /// This process's index in the group, in [0, size()).
  virtual int64_t rank() const = 0;
  /// Number of ranks in the group.
  virtual int64_t size() const = 0;

  /// Replaces `tensor` (in place, any shape) by the element-wise sum over all ranks.
  virtual void all_reduce_sum(at::Tensor& tensor) = 0;

  /// The ranks' tensors concatenated along `dim` in rank order (negative dims count from the
  /// end): size(dim) * size() long along that dimension.
  virtual at::Tensor all_gather(const at::Tensor& tensor, int64_t dim) = 0;

  /// The element-wise sum over all ranks, split into size() equal chunks along `dim`; returns
  /// this rank's chunk. tensor.size(dim) must be divisible by size() (vlmgen::Error otherwise).
  virtual at::Tensor reduce_scatter_sum(const at::Tensor& tensor, int64_t dim) = 0;

  /// Replaces `tensor` (in place) on every rank by rank `root`'s tensor.
  virtual void broadcast(at::Tensor& tensor, int64_t root) = 0;

  /// Returns once every rank has entered the barrier.
  virtual void barrier() = 0;

  /// What carries the collectives ("gloo", "nccl+gloo", "store", ...), for logs and errors.
  virtual std::string backend_name() const { return "custom"; }
};

/// Replaces `bytes` on every rank by rank `root`'s (two broadcasts: the length, then the bytes).
inline void broadcast_bytes(Communicator& group, std::string& bytes, int64_t root) {
  at::Tensor size = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  group.broadcast(size, root);
  const int64_t n = size.item<int64_t>();
  at::Tensor data = at::empty({n}, at::kByte);
  if (group.rank() == root && n > 0) std::memcpy(data.data_ptr(), bytes.data(), static_cast<size_t>(n));
  group.broadcast(data, root);
  bytes.assign(static_cast<const char*>(data.data_ptr()), static_cast<size_t>(n));
}

}  // namespace vlmgen
