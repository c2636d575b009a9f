#pragma once

// Multi-process tests of the compiled library. A launching test re-executes this binary
// (/proc/self/exe) as several ranks through vlmgen::launch_local_ranks, each running the
// DISABLED_*Worker tests named by --gtest_filter (with --gtest_also_run_disabled_tests).
// Disabled, they cost a normal run and ctest nothing; run by hand outside a launch, they skip
// themselves (no VLMGEN_TEST_WORKER). Workers of one launch share one communicator (made on
// first use, closed in the environment's TearDown): one rendezvous per process, and every rank
// runs the same tests, hence the same collectives, in the same order.
//
// Knobs a launching test passes to its workers: VLMGEN_TEST_TP (tensor-parallel size, 0 = the
// world), VLMGEN_TEST_BACKEND (auto, gloo or store), VLMGEN_TEST_TIMEOUT_MS (collectives).

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "vlmgen/distributed/communicator.h"
#include "vlmgen/distributed/launch.h"
#include "vlmgen/error.h"
#include "vlmgen/parallel.h"

namespace vlmgen::multiprocess {

inline std::string getenv_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::string(value) : fallback;
}

// ---------------------------------------------------------------------------------------------
// The worker side

inline bool in_worker() { return std::getenv("VLMGEN_TEST_WORKER") != nullptr && std::getenv("RANK") != nullptr; }

#define SKIP_UNLESS_WORKER()                                                                                 \
  do {                                                                                                       \
    if (!::vlmgen::multiprocess::in_worker()) GTEST_SKIP() << "runs only as a rank of a multi-process test"; \
  } while (false)

inline std::optional<ParallelContext>& worker_slot() {
  static std::optional<ParallelContext> slot;
  return slot;
}

/// The collectives' timeout of this launch (VLMGEN_TEST_TIMEOUT_MS, default 20 s).
inline std::chrono::milliseconds worker_timeout() {
  return std::chrono::milliseconds(std::stoll(getenv_or("VLMGEN_TEST_TIMEOUT_MS", "20000")));
}

/// The launch's parallel context, from the torchrun variables and the test's own knobs.
inline const ParallelContext& worker_context() {
  auto& slot = worker_slot();
  if (!slot) {
    const std::string backend = getenv_or("VLMGEN_TEST_BACKEND", "auto");
    DistributedOptions options;
    options.timeout(worker_timeout());
    options.backend(backend == "gloo"    ? CommBackend::kGloo
                    : backend == "store" ? CommBackend::kStore
                                         : CommBackend::kAuto);
    options.group_of_one(getenv_or("VLMGEN_TEST_GROUP_OF_ONE", "") == "1");
    slot = init_parallel_from_env(std::stoll(getenv_or("VLMGEN_TEST_TP", "0")), options);
  }
  return *slot;
}

inline Communicator& worker_comm() {
  const auto& group = worker_context().tp_group();
  if (group == nullptr) throw Error("the worker launch has no tensor-parallel group");
  return *group;
}

/// Closes the launch's communicator before the process exits (rank 0 serves the store and
/// waits for the others there), rather than in static destruction after LibTorch's own statics.
class WorkerEnvironment : public ::testing::Environment {
 public:
  void TearDown() override { worker_slot().reset(); }
};
inline ::testing::Environment* const kWorkerEnvironment = ::testing::AddGlobalTestEnvironment(new WorkerEnvironment);

// ---------------------------------------------------------------------------------------------
// The launching side

inline std::string self_exe() {
  std::vector<char> path(4096);
  const ssize_t n = ::readlink("/proc/self/exe", path.data(), path.size() - 1);
  if (n <= 0) throw Error("cannot read /proc/self/exe");
  return std::string(path.data(), static_cast<size_t>(n));
}

/// How many of this binary's tests `filter` ("Suite.*" or "Suite.Name") selects: a launch whose
/// filter matched nothing would pass without testing anything.
inline int count_selected(const std::string& filter) {
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  int count = 0;
  for (int i = 0; i < unit.total_test_suite_count(); ++i) {
    const ::testing::TestSuite& suite = *unit.GetTestSuite(i);
    for (int j = 0; j < suite.total_test_count(); ++j) {
      const std::string name = std::string(suite.name()) + "." + suite.GetTestInfo(j)->name();
      if (name == filter || filter == std::string(suite.name()) + ".*") ++count;
    }
  }
  return count;
}

/// Runs this binary's worker tests matching `filter` as `nproc` ranks; returns the launch status
/// (0 when every rank passed).
inline int run_workers(int nproc, const std::string& filter, std::vector<std::pair<std::string, std::string>> env = {},
                       std::chrono::seconds timeout = std::chrono::seconds(60)) {
  if (count_selected(filter) == 0) {
    ADD_FAILURE() << "--gtest_filter=" << filter << " selects no worker test";
    return -1;
  }
  LaunchOptions options;
  options.timeout = timeout;
  options.env = std::move(env);
  options.env.emplace_back("VLMGEN_TEST_WORKER", "1");
  return launch_local_ranks(
      nproc, {self_exe(), "--gtest_filter=" + filter, "--gtest_also_run_disabled_tests", "--gtest_brief=1"}, options);
}

}  // namespace vlmgen::multiprocess
