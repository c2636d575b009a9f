// vlmgen::Communicator over c10d: a TCPStore for the rendezvous, Gloo (or the store itself) for
// CPU tensors, NCCL for CUDA tensors when the build has it.

#include "c10d_communicator.h"

#include <c10/core/InferenceMode.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "c10d_compat.h"
#include "collectives.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/logging.h"

namespace vlmgen {

bool comm_backend_available(const std::string& backend) {
  if (backend == "store") return true;
#ifdef VLMGEN_HAVE_C10D_GLOO
  if (backend == "gloo") return true;
#endif
#ifdef VLMGEN_HAVE_C10D_NCCL
  if (backend == "nccl") return true;
#endif
  return false;
}

namespace detail {
namespace {

// Holds the world's TCPStore for every group of this process. World rank 0 serves the store, so
// at exit it waits (bounded) for every rank to check out: a fast rank 0 closing the server would
// break peers still reading their last collective's keys.
class StoreHost {
 public:
  StoreHost(c10d_compat::StorePtr store, int64_t rank, int64_t world_size, std::chrono::milliseconds timeout)
      : store_(std::move(store)), rank_(rank), world_size_(world_size), timeout_(timeout) {}

  StoreHost(const StoreHost&) = delete;
  StoreHost& operator=(const StoreHost&) = delete;

  ~StoreHost() {
    try {
      store_->set(exit_key(rank_), std::vector<uint8_t>{1});
      if (rank_ != 0 || failed_) return;
      std::vector<std::string> keys;
      for (int64_t r = 0; r < world_size_; ++r) keys.push_back(exit_key(r));
      store_->wait(keys, timeout_);
    } catch (const std::exception& e) {
      // A peer died or the store is gone: there is nobody left to wait for.
      if (rank_ == 0 && !failed_) {
        log(LogLevel::kWarning, "rank 0 closed the rendezvous store before every rank checked out: {}",
            c10d_compat::message(e));
      }
    }
  }

  const c10d_compat::StorePtr& store() const { return store_; }
  // After a failed collective a peer may be gone for good; waiting for it at exit would only add
  // a timeout to the error the caller is already handling.
  void mark_failed() { failed_ = true; }

 private:
  static std::string exit_key(int64_t rank) { return "vlmgen/exit/" + std::to_string(rank); }

  c10d_compat::StorePtr store_;
  int64_t rank_;
  int64_t world_size_;
  std::chrono::milliseconds timeout_;
  std::atomic<bool> failed_{false};
};

// Runs `f` with InferenceMode off, so the tensors a transport makes (outputs) are normal ones.
template <typename F>
auto normal_mode(F&& f) {
  c10::InferenceMode off(false);
  return f();
}

class C10dCommunicator final : public Communicator {
 public:
  C10dCommunicator(std::shared_ptr<StoreHost> host, int64_t rank, int64_t size, std::chrono::milliseconds timeout,
                   std::unique_ptr<Collectives> cpu, std::unique_ptr<Collectives> cuda)
      : host_(std::move(host)),
        rank_(rank),
        size_(size),
        timeout_(timeout),
        cpu_(std::move(cpu)),
        cuda_(std::move(cuda)) {}

  int64_t rank() const override { return rank_; }
  int64_t size() const override { return size_; }

  std::string backend_name() const override { return cuda_ ? cuda_->name() + "+" + cpu_->name() : cpu_->name(); }

  void all_reduce_sum(at::Tensor& tensor) override {
    check_tensor(tensor, "all_reduce_sum");
    if (tensor.numel() == 0) return;  // the same shape on every rank: nothing to send anywhere
    run("all_reduce_sum", [&] {
      Collectives& transport = route(tensor);
      at::Tensor staged = stage(tensor, transport);
      normal_mode([&] { transport.all_reduce_sum(staged); });
      if (!staged.is_same(tensor)) tensor.copy_(staged);
    });
  }

  at::Tensor all_gather(const at::Tensor& tensor, int64_t dim) override {
    check_tensor(tensor, "all_gather");
    const int64_t d = checked_dim(tensor, dim, "all_gather");
    if (tensor.numel() == 0) return at::cat(std::vector<at::Tensor>(static_cast<size_t>(size_), tensor), d);
    at::Tensor result;
    run("all_gather", [&] {
      Collectives& transport = route(tensor);
      const at::Tensor staged = stage(tensor, transport);
      std::vector<at::Tensor> parts;
      normal_mode([&] { parts = transport.all_gather(staged); });
      result = at::cat(parts, d).to(tensor.device(), tensor.scalar_type());
    });
    return result;
  }

  at::Tensor reduce_scatter_sum(const at::Tensor& tensor, int64_t dim) override {
    check_tensor(tensor, "reduce_scatter_sum");
    const int64_t d = checked_dim(tensor, dim, "reduce_scatter_sum");
    VLMGEN_CHECK(tensor.size(d) % size_ == 0,
                 "reduce_scatter_sum splits dim {} of tensor {} into {} equal chunks, but {} is not divisible by {}", d,
                 shape_str(tensor), size_, tensor.size(d), size_);
    if (tensor.numel() == 0) return tensor.narrow(d, 0, tensor.size(d) / size_).clone();
    at::Tensor result;
    run("reduce_scatter_sum", [&] {
      Collectives& transport = route(tensor);
      // The transports split along dim 0 of a contiguous tensor.
      const at::Tensor staged = stage(tensor.movedim(d, 0), transport);
      at::Tensor chunk;
      normal_mode([&] { chunk = transport.reduce_scatter_sum(staged); });
      result = chunk.movedim(0, d).to(tensor.device(), tensor.scalar_type());
    });
    return result;
  }

  void broadcast(at::Tensor& tensor, int64_t root) override {
    check_tensor(tensor, "broadcast");
    VLMGEN_CHECK(root >= 0 && root < size_, "broadcast root {} is out of range for a group of {} ranks", root, size_);
    if (tensor.numel() == 0) return;
    run("broadcast", [&] {
      Collectives& transport = route(tensor);
      at::Tensor staged = stage(tensor, transport);
      normal_mode([&] { transport.broadcast(staged, root); });
      if (!staged.is_same(tensor)) tensor.copy_(staged);
    });
  }

  void barrier() override {
    run("barrier", [&] { cpu_->barrier(); });
  }

 private:
  static void check_tensor(const at::Tensor& tensor, const char* op) {
    VLMGEN_CHECK(tensor.defined(), "{} needs a defined tensor", op);
    VLMGEN_CHECK(!tensor.is_complex(), "{} does not take complex tensors, got {}", op,
                 c10::toString(tensor.scalar_type()));
  }

  static int64_t checked_dim(const at::Tensor& tensor, int64_t dim, const char* op) {
    const int64_t rank = tensor.dim();
    VLMGEN_CHECK(rank >= 1 && dim >= -rank && dim < rank, "{}: dim {} is out of range for tensor {}", op, dim,
                 shape_str(tensor));
    return dim < 0 ? dim + rank : dim;
  }

  Collectives& route(const at::Tensor& tensor) { return tensor.is_cuda() && cuda_ ? *cuda_ : *cpu_; }

  // A contiguous tensor the transport takes: CPU for the CPU transport, float32 for dtypes it
  // lacks (exact for bfloat16 and bool, and sums of either stay exact in float32 for small
  // groups). Returns `tensor` itself when nothing needs to change, so in-place ops can skip the
  // copy back.
  at::Tensor stage(const at::Tensor& tensor, const Collectives& transport) const {
    at::Tensor staged = tensor;
    if (&transport == cpu_.get() && !staged.is_cpu()) staged = staged.to(at::kCPU);
    if (!transport.supports(staged.scalar_type())) staged = staged.to(at::kFloat);
    // c10d works on the tensors from its own threads, where InferenceMode (thread-local) is
    // off: an inference tensor (made under the generator's InferenceMode) may not be written
    // there, so the transport gets a normal copy.
    if (staged.is_inference()) return normal_mode([&] { return staged.clone(at::MemoryFormat::Contiguous); });
    return staged.contiguous();
  }

  template <typename Body>
  void run(const char* op, Body&& body) {
    VLMGEN_CHECK(failure_.empty(), "{} on rank {} of {}: the communicator failed earlier and cannot be used again ({})",
                 op, rank_, size_, failure_);
    try {
      body();
    } catch (const std::exception& e) {
      failure_ = c10d_compat::message(e);
      host_->mark_failed();
      VLMGEN_FAIL(
          "{} failed on rank {} of {} (backend {}; a peer may have exited or stopped calling collectives; "
          "timeout {} ms): {}",
          op, rank_, size_, backend_name(), timeout_.count(), failure_);
    }
  }

  std::shared_ptr<StoreHost> host_;
  int64_t rank_;
  int64_t size_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Collectives> cpu_;   // CPU tensors (and CUDA ones without NCCL, staged)
  std::unique_ptr<Collectives> cuda_;  // CUDA tensors; null without NCCL
  std::string failure_;                // the first failure's message; empty while usable
};

bool is_loopback(const std::string& host) { return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0; }

std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string() : std::string(value);
}

}  // namespace

std::shared_ptr<Communicator> connect_tp_group(const DistributedEnv& env, int64_t tp_size,
                                               const DistributedOptions& options) {
  VLMGEN_CHECK(tp_size >= 1 && env.world_size % tp_size == 0, "tensor-parallel size {} does not divide world size {}",
               tp_size, env.world_size);
  const auto timeout = options.timeout();
  VLMGEN_CHECK(timeout.count() > 0, "the distributed timeout must be > 0 ms, got {}", timeout.count());

  CommBackend backend = options.backend();
  if (backend == CommBackend::kAuto) {
    backend = comm_backend_available("gloo") ? CommBackend::kGloo : CommBackend::kStore;
  }
  VLMGEN_CHECK(backend != CommBackend::kGloo || comm_backend_available("gloo"),
               "this build of vlmgen has no Gloo (the Gloo headers were not found when it was configured: install "
               "libgloo-dev and reconfigure), or use CommBackend::kStore");

  c10d_compat::StorePtr store;
  try {
    store = c10d_compat::make_tcp_store(env.master_addr, env.master_port, env.rank == 0, env.world_size, timeout);
  } catch (const std::exception& e) {
    VLMGEN_FAIL("rank {} of {} could not {} the rendezvous store at {}:{} within {} ms: {}", env.rank, env.world_size,
                env.rank == 0 ? "serve (and see every rank join)" : "reach", env.master_addr, env.master_port,
                timeout.count(), c10d_compat::message(e));
  }
  auto host = std::make_shared<StoreHost>(store, env.rank, env.world_size, timeout);

  const int64_t group = env.rank / tp_size;
  const int64_t group_rank = env.rank % tp_size;
  auto group_store = c10d_compat::make_prefix_store("vlmgen/tp" + std::to_string(group) + "/", store);
  std::unique_ptr<Collectives> cpu;
  std::unique_ptr<Collectives> cuda;
  try {
    if (backend == CommBackend::kGloo) {
#ifdef VLMGEN_HAVE_C10D_GLOO
      auto gloo =
          c10d_compat::make_gloo_group(c10d_compat::make_prefix_store("gloo/", group_store), group_rank, tp_size,
                                       timeout, env_or_empty("GLOO_SOCKET_IFNAME"), is_loopback(env.master_addr));
      cpu = make_gloo_collectives(std::move(gloo), group_rank, tp_size);
#endif
    } else {
      cpu = make_store_collectives(c10d_compat::make_prefix_store("store/", group_store), group_rank, tp_size, timeout);
    }
#ifdef VLMGEN_HAVE_C10D_NCCL
    if (options.use_nccl()) {
      auto nccl = c10d_compat::make_nccl_group(c10d_compat::make_prefix_store("nccl/", group_store), group_rank,
                                               tp_size, timeout);
      cuda = make_nccl_collectives(std::move(nccl), group_rank, tp_size);
    }
#endif
  } catch (const std::exception& e) {
    host->mark_failed();
    VLMGEN_FAIL("rank {} of {} could not connect tensor-parallel group {} ({} ranks) within {} ms: {}", env.rank,
                env.world_size, group, tp_size, timeout.count(), c10d_compat::message(e));
  }
  return std::make_shared<C10dCommunicator>(std::move(host), group_rank, tp_size, timeout, std::move(cpu),
                                            std::move(cuda));
}

}  // namespace detail
}  // namespace vlmgen
