#pragma once

// The one place for c10d calls whose spelling differs between LibTorch 1.13 (Debian, CPU) and
// the CUDA LibTorch 2.x builds vlmgen also supports, and the only file that includes c10d
// headers. Private to src/: c10d headers are heavy and change between versions.
//
// What differs and is kept here:
//  - the process-group base: 1.13's ProcessGroupGloo/NCCL derive from c10d::ProcessGroup, 2.x's
//    from c10d::Backend; callers hold the concrete groups only, so neither base is named;
//  - TCPStoreOptions grew fields in 2.x (useLibUV, masterListenFd) and numWorkers changed from
//    c10::optional to std::optional; only fields common to both are set, by assignment;
//  - c10::Error's message: what() carries a C++ backtrace in 1.13; the user-facing text is
//    what_without_backtrace() in both;
//  - 1.12 and older spelled the work type ProcessGroup::Work; they are not supported.
//
// VLMGEN_HAVE_C10D_GLOO / VLMGEN_HAVE_C10D_NCCL come from src/distributed/c10d.cmake, which
// found the backend's headers and linked a use of it. torch's own USE_C10D_GLOO is no evidence:
// Debian's exported targets define it for every consumer whether or not the Gloo headers
// (libgloo-dev) that ProcessGroupGloo.hpp includes are installed; other builds do not define it
// at all. The CMake file defines USE_C10D_* alongside, for the c10d headers' own guards.

#include <c10/util/Exception.h>
#include <torch/version.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#ifdef VLMGEN_HAVE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef VLMGEN_HAVE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <string>
#include <thread>

#if TORCH_VERSION_MAJOR < 1 || (TORCH_VERSION_MAJOR == 1 && TORCH_VERSION_MINOR < 13)
#error "vlmgen's c10d plumbing needs LibTorch 1.13 or newer (c10d::Work)"
#endif

namespace vlmgen::detail::c10d_compat {

using StorePtr = c10::intrusive_ptr<c10d::Store>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

/// A TCPStore client (and, when `is_server`, the server) on host:port for `world_size` ranks.
/// The server waits up to `timeout` for every rank to connect, so a rank that never starts is
/// an error at rendezvous, not a hang later.
///
/// A client retries here until `timeout`: 1.13 truncates the connect timeout to whole seconds
/// and waits 1 s between its own attempts, giving up at once unless 1 s is left, so with a
/// timeout under 2 s a client that starts before the server would fail immediately.
inline StorePtr make_tcp_store(const std::string& host, int port, bool is_server, int64_t world_size,
                               std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    c10d::TCPStoreOptions options;
    options.port = static_cast<std::uint16_t>(port);
    options.isServer = is_server;
    options.numWorkers = static_cast<std::size_t>(world_size);
    options.waitWorkers = true;
    options.timeout = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                               std::chrono::milliseconds(1));
    try {
      return c10::make_intrusive<c10d::TCPStore>(host, options);
    } catch (const std::exception&) {
      const auto retry_delay = std::chrono::milliseconds(250);
      if (is_server || Clock::now() + retry_delay >= deadline) throw;
      std::this_thread::sleep_for(retry_delay);
    }
  }
}

inline StorePtr make_prefix_store(const std::string& prefix, StorePtr store) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, std::move(store));
}

/// Blocks until `work` is done; rethrows its error. The bound is the group's own timeout (set
/// when it was made), which Gloo enforces on every transfer.
inline void wait(const WorkPtr& work) { work->wait(); }

/// The message of an exception from c10d, without 1.13's C++ backtrace.
inline std::string message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

#ifdef VLMGEN_HAVE_C10D_GLOO
using GlooGroup = c10d::ProcessGroupGloo;

/// A Gloo group of `size` ranks rendezvousing through `store`. `device` picks the network
/// interface: a loopback master means a local run, where the hostname may resolve to an address
/// peers cannot reach; GLOO_SOCKET_IFNAME (torch's variable) names an interface explicitly.
inline c10::intrusive_ptr<GlooGroup> make_gloo_group(const StorePtr& store, int64_t rank, int64_t size,
                                                     std::chrono::milliseconds timeout,
                                                     const std::string& interface_name, bool loopback) {
  auto options = GlooGroup::Options::create(timeout);
  if (!interface_name.empty()) {
    options->devices.push_back(GlooGroup::createDeviceForInterface(interface_name));
  } else if (loopback) {
    options->devices.push_back(GlooGroup::createDeviceForHostname("127.0.0.1"));
  } else {
    options->devices.push_back(GlooGroup::createDefaultDevice());
  }
  options->threads = 2;
  return c10::make_intrusive<GlooGroup>(store, static_cast<int>(rank), static_cast<int>(size), options);
}
#endif

#ifdef VLMGEN_HAVE_C10D_NCCL
using NcclGroup = c10d::ProcessGroupNCCL;

/// An NCCL group (communicators are made lazily, at the first collective, on the tensors'
/// device). Timeouts are enforced by NCCL's watchdog thread, which tears the process down rather
/// than raising: torch's own behaviour, kept.
inline c10::intrusive_ptr<NcclGroup> make_nccl_group(const StorePtr& store, int64_t rank, int64_t size,
                                                     std::chrono::milliseconds timeout) {
  auto options = NcclGroup::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<NcclGroup>(store, static_cast<int>(rank), static_cast<int>(size), options);
}
#endif

}  // namespace vlmgen::detail::c10d_compat
