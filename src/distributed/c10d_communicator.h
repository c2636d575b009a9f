#pragma once

// Private to src/distributed/: the c10d Communicator's factory, used by init_parallel_from_env.

#include <cstdint>
#include <memory>

#include "vlmgen/distributed/communicator.h"
#include "vlmgen/distributed/launch.h"

namespace vlmgen::detail {

/// Connects this process's tensor-parallel group: ranks [k * tp_size, (k + 1) * tp_size) for
/// k = env.rank / tp_size, through a TCPStore served by world rank 0. Every rank of the world
/// must call it (rank 0 waits for all of them).
std::shared_ptr<Communicator> connect_tp_group(const DistributedEnv& env, int64_t tp_size,
                                               const DistributedOptions& options);

}  // namespace vlmgen::detail
