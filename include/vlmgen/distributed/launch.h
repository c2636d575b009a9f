#pragma once

// Starting and joining a multi-process (torchrun-style) tensor-parallel run. Implemented in the
// compiled library over c10d; no c10d header leaks from here.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "vlmgen/distributed/communicator.h"
#include "vlmgen/parallel.h"

namespace vlmgen {

/// How long a rendezvous or a collective may wait for a peer before it raises vlmgen::Error.
inline constexpr std::chrono::milliseconds kDefaultDistributedTimeout{60000};

/// What carries the collectives of CPU tensors (CUDA tensors use NCCL when the build has it,
/// see DistributedOptions::use_nccl).
enum class CommBackend {
  /// Gloo when this build has it, else kStore.
  kAuto,
  /// c10d's ProcessGroupGloo; vlmgen::Error when this build lacks it.
  kGloo,
  /// Collectives exchanged through the c10d TCPStore itself: no Gloo needed, slow (every byte
  /// goes through rank 0's store), bit-identical results on every rank. For tests and small
  /// tensors.
  kStore,
};

/// Whether this build of vlmgen can use `backend` ("gloo", "nccl", "store").
bool comm_backend_available(const std::string& backend);

/// Options of init_parallel_from_env, with chaining setters.
///
///   auto par = vlmgen::init_parallel_from_env(
///       2, vlmgen::DistributedOptions().timeout(std::chrono::seconds(10)));
class DistributedOptions {
 public:
  /// How long the rendezvous and each collective may wait for a peer. Default 60 s.
  DistributedOptions& timeout(std::chrono::milliseconds value) {
    timeout_ = value;
    return *this;
  }
  std::chrono::milliseconds timeout() const { return timeout_; }

  /// Transport of CPU tensors. Default kAuto.
  DistributedOptions& backend(CommBackend value) {
    backend_ = value;
    return *this;
  }
  CommBackend backend() const { return backend_; }

  /// Use NCCL for CUDA tensors when the build has it (else they are staged through the CPU
  /// backend). Default true.
  DistributedOptions& use_nccl(bool value) {
    use_nccl_ = value;
    return *this;
  }
  bool use_nccl() const { return use_nccl_; }

  /// Connect a tensor-parallel group even when it has one rank (WORLD_SIZE=1, or tp_size 1):
  /// its collectives are copies, through the same transport (NCCL for CUDA tensors) as a larger
  /// group's, so a one-GPU machine can check that transport. Needs MASTER_ADDR and MASTER_PORT.
  /// Default false (a group of one is not connected and tp_group() is null).
  DistributedOptions& group_of_one(bool value) {
    group_of_one_ = value;
    return *this;
  }
  bool group_of_one() const { return group_of_one_; }

 private:
  std::chrono::milliseconds timeout_ = kDefaultDistributedTimeout;
  CommBackend backend_ = CommBackend::kAuto;
  bool use_nccl_ = true;
  bool group_of_one_ = false;
};

/// The torchrun variables of this process.
struct DistributedEnv {
  int64_t rank = 0;         // RANK, in [0, world_size)
  int64_t world_size = 1;   // WORLD_SIZE, >= 1
  int64_t local_rank = 0;   // LOCAL_RANK (the CUDA device index by convention); RANK when unset
  std::string master_addr;  // MASTER_ADDR: host of rank 0's rendezvous store
  int master_port = 0;      // MASTER_PORT, in [1, 65535]
};

/// The path of the running program (/proc/self/exe), or `argv0` when it cannot be read: what a
/// program started by hand with --nproc N re-runs as each local rank.
std::string self_executable(const char* argv0);

/// Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Returns nullopt when neither
/// RANK nor WORLD_SIZE is set (a plain single process); throws vlmgen::Error naming the variable
/// when one is missing or malformed (MASTER_ADDR and MASTER_PORT are needed only when
/// WORLD_SIZE > 1).
std::optional<DistributedEnv> read_distributed_env();

/// The ParallelContext of this process from the torchrun variables. Tensor-parallel groups are
/// contiguous blocks of `tp_size` ranks (Megatron's layout); tp_size 0 means the whole world.
/// Without the variables (or with WORLD_SIZE=1) returns ParallelContext::single(). Connects the
/// group (rank 0 serves the c10d TCPStore on MASTER_ADDR:MASTER_PORT) and throws vlmgen::Error
/// when a peer does not show up within the timeout or tp_size does not divide WORLD_SIZE.
/// Call it once per process (rank 0 serves the store on MASTER_PORT for as long as the group
/// lives). With tp_size 1 there is no group to connect and tp_group() is null.
///
///   // torchrun --nproc-per-node 2 my_service ...  (or vlmgen::launch_local_ranks)
///   vlmgen::ParallelContext par = vlmgen::init_parallel_from_env();
///   vlmgen::Generator generator(model, par);
ParallelContext init_parallel_from_env(int64_t tp_size = 0,
                                       std::chrono::milliseconds timeout = kDefaultDistributedTimeout);
ParallelContext init_parallel_from_env(int64_t tp_size, const DistributedOptions& options);

/// Options of launch_local_ranks.
struct LaunchOptions {
  /// All ranks must have exited by then; the rest are killed and the launch returns 124.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
  /// Rendezvous address given to the ranks as MASTER_ADDR.
  std::string master_addr = "127.0.0.1";
  /// MASTER_PORT; 0 picks a free port.
  int master_port = 0;
  /// More variables for every rank (override the inherited environment).
  std::vector<std::pair<std::string, std::string>> env;
  /// After a failure, how long the other ranks get between SIGTERM and SIGKILL.
  std::chrono::milliseconds kill_grace = std::chrono::seconds(2);
  /// Pass SIGINT and SIGTERM that reach the launching process on to every rank, and keep
  /// waiting for them (a service that drains on a signal); otherwise they end the launcher as
  /// they would any process.
  bool forward_signals = false;
};

/// Runs `argv` as `nproc` local processes, like `torchrun --nproc-per-node nproc`: each gets
/// RANK = LOCAL_RANK = its index, WORLD_SIZE = LOCAL_WORLD_SIZE = nproc, MASTER_ADDR and
/// MASTER_PORT. Waits for all of them. When one fails (non-zero exit or a signal) the others are
/// stopped. Returns 0 when every rank exited with 0, else the first failure's exit status
/// (128 + signal number for a signal, 124 for the timeout). Throws vlmgen::Error when a process
/// cannot be started.
///
///   int status = vlmgen::launch_local_ranks(2, {"/usr/bin/my_service", "--model", dir});
int launch_local_ranks(int nproc, const std::vector<std::string>& argv, const LaunchOptions& options = {});

/// For a tool's main(): when `nproc` > 1 and this process is not already a rank (no RANK or
/// WORLD_SIZE in its environment), runs this executable again with the same arguments as
/// `nproc` local ranks (launch_local_ranks) and returns the launch's status; otherwise nullopt,
/// and the caller goes on as a rank (or alone).
///
///   if (auto status = vlmgen::relaunch_as_local_ranks(nproc, argc, argv)) return *status;
std::optional<int> relaunch_as_local_ranks(int nproc, int argc, char** argv, LaunchOptions options = {});

/// A TCP port that is free on `host` right now (the OS picks it). Another process may take it
/// before it is used; the launcher accepts that small race, as torchrun does.
int find_free_port(const std::string& host = "127.0.0.1");

}  // namespace vlmgen
