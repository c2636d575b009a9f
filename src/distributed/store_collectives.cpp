// Collectives through a c10d store: each rank publishes its bytes under a key, reads its peers'
// keys, and the last reader deletes them. Every byte passes through rank 0's TCPStore, so this is
// for tests, small tensors and builds without Gloo, not for throughput.

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "collectives.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"

namespace vlmgen::detail {
namespace {

std::vector<uint8_t> to_bytes(const at::Tensor& tensor) {
  const auto* begin = static_cast<const uint8_t*>(tensor.data_ptr());
  return std::vector<uint8_t>(begin, begin + tensor.nbytes());
}

class StoreCollectives final : public Collectives {
 public:
  StoreCollectives(c10d_compat::StorePtr store, int64_t rank, int64_t size, std::chrono::milliseconds timeout)
      : store_(std::move(store)), rank_(rank), size_(size), timeout_(timeout) {
    store_->setTimeout(timeout_);
  }

  std::string name() const override { return "store"; }

  bool supports(at::ScalarType /*type*/) const override { return true; }

  void all_reduce_sum(at::Tensor& tensor) override {
    std::vector<at::Tensor> parts = all_gather(tensor);
    // Rank order on every rank: the sums are bit-identical across ranks.
    at::Tensor sum = parts[0];
    for (size_t r = 1; r < parts.size(); ++r) sum.add_(parts[r]);
    tensor.copy_(sum);
  }

  std::vector<at::Tensor> all_gather(const at::Tensor& tensor) override {
    std::vector<std::vector<uint8_t>> blobs = exchange(to_bytes(tensor), /*from=*/-1);
    std::vector<at::Tensor> parts;
    parts.reserve(blobs.size());
    for (size_t r = 0; r < blobs.size(); ++r) parts.push_back(from_bytes(blobs[r], tensor, static_cast<int64_t>(r)));
    return parts;
  }

  at::Tensor reduce_scatter_sum(const at::Tensor& tensor) override {
    // Simple rather than bandwidth-optimal: everyone sees every chunk, then sums its own.
    std::vector<at::Tensor> parts = all_gather(tensor);
    const int64_t chunk = tensor.size(0) / size_;
    at::Tensor sum = parts[0].narrow(0, rank_ * chunk, chunk).clone();
    for (size_t r = 1; r < parts.size(); ++r) sum.add_(parts[r].narrow(0, rank_ * chunk, chunk));
    return sum;
  }

  void broadcast(at::Tensor& tensor, int64_t root) override {
    std::vector<uint8_t> mine = rank_ == root ? to_bytes(tensor) : std::vector<uint8_t>{};
    std::vector<std::vector<uint8_t>> blobs = exchange(mine, root);
    if (rank_ != root) tensor.copy_(from_bytes(blobs[0], tensor, root));
  }

  void barrier() override { exchange({1}, /*from=*/-1); }

 private:
  // Publishes `mine` (when this rank sends) and returns the senders' bytes: every rank's
  // (from == -1) or rank `from`'s alone. Ranks call collectives in the same order, so a counter
  // gives every call the same fresh key prefix on every rank.
  std::vector<std::vector<uint8_t>> exchange(const std::vector<uint8_t>& mine, int64_t from) {
    const std::string prefix = "c" + std::to_string(sequence_++) + "/";
    if (from < 0 || from == rank_) store_->set(prefix + std::to_string(rank_), mine);
    std::vector<std::string> keys;
    for (int64_t r = 0; r < size_; ++r) {
      if (from < 0 || from == r) keys.push_back(prefix + std::to_string(r));
    }
    store_->wait(keys, timeout_);
    std::vector<std::vector<uint8_t>> blobs;
    blobs.reserve(keys.size());
    for (const auto& key : keys) blobs.push_back(store_->get(key));
    // Everyone has read every key once the counter reaches size: the last reader cleans up, so
    // the store does not grow with the number of collectives.
    if (store_->add(prefix + "done", 1) == size_) {
      for (const auto& key : keys) store_->deleteKey(key);
      store_->deleteKey(prefix + "done");
    }
    return blobs;
  }

  static at::Tensor from_bytes(const std::vector<uint8_t>& blob, const at::Tensor& like, int64_t from) {
    VLMGEN_CHECK(blob.size() == like.nbytes(),
                 "rank {} sent {} bytes where this rank expected {} (tensor {} of {}); ranks must call "
                 "collectives in the same order with tensors of the same shape and dtype",
                 from, blob.size(), like.nbytes(), shape_str(like), c10::toString(like.scalar_type()));
    at::Tensor out = at::empty_like(like, at::MemoryFormat::Contiguous);
    if (!blob.empty()) std::memcpy(out.data_ptr(), blob.data(), blob.size());
    return out;
  }

  c10d_compat::StorePtr store_;
  int64_t rank_;
  int64_t size_;
  std::chrono::milliseconds timeout_;
  uint64_t sequence_ = 0;
};

}  // namespace

std::unique_ptr<Collectives> make_store_collectives(c10d_compat::StorePtr store, int64_t rank, int64_t size,
                                                    std::chrono::milliseconds timeout) {
  return std::make_unique<StoreCollectives>(std::move(store), rank, size, timeout);
}

}  // namespace vlmgen::detail
