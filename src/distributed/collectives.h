#pragma once

// The transports behind C10dCommunicator. Private to src/distributed/.

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "c10d_compat.h"

namespace vlmgen::detail {

/// Flat collectives over contiguous tensors that the transport accepts (device, dtype); the
/// communicator does the shape work (dims, contiguity, staging, errors) once, above all of them.
class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual std::string name() const = 0;
  /// Whether `type` travels as is; other dtypes are staged through float32 by the caller.
  virtual bool supports(at::ScalarType type) const = 0;
  virtual void all_reduce_sum(at::Tensor& tensor) = 0;
  /// One tensor per rank, in rank order, each shaped like `tensor`.
  virtual std::vector<at::Tensor> all_gather(const at::Tensor& tensor) = 0;
  /// `tensor` is size() equal chunks along dim 0; returns the sum of every rank's chunk rank().
  virtual at::Tensor reduce_scatter_sum(const at::Tensor& tensor) = 0;
  virtual void broadcast(at::Tensor& tensor, int64_t root) = 0;
  virtual void barrier() = 0;
};

/// Collectives through the store's keys (no Gloo needed). Results are bit-identical on every
/// rank: each rank sums the same tensors in rank order.
std::unique_ptr<Collectives> make_store_collectives(c10d_compat::StorePtr store, int64_t rank, int64_t size,
                                                    std::chrono::milliseconds timeout);

#ifdef VLMGEN_HAVE_C10D_GLOO
std::unique_ptr<Collectives> make_gloo_collectives(c10::intrusive_ptr<c10d_compat::GlooGroup> group, int64_t rank,
                                                   int64_t size);
#endif
#ifdef VLMGEN_HAVE_C10D_NCCL
std::unique_ptr<Collectives> make_nccl_collectives(c10::intrusive_ptr<c10d_compat::NcclGroup> group, int64_t rank,
                                                   int64_t size);
#endif

}  // namespace vlmgen::detail
