// Tensor/sequence-parallel plumbing: the c10d communicator (collectives on every rank,
// tensor-parallel groups, peers that exit or stop talking). The torchrun-style environment and
// launcher are in distributed_launch_test.cpp, the Megatron-style layers in
// distributed_layers_test.cpp.
//
// Multi-rank tests re-execute this binary as several ranks (see multiprocess_test_util.h).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "distributed_test_util.h"
#include "multiprocess_test_util.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/distributed/launch.h"
#include "vlmgen/error.h"
#include "vlmgen/parallel.h"

namespace vlmgen {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using Clock = std::chrono::steady_clock;
using distributed_test::randn;
using distributed_test::seconds_since;
using multiprocess::getenv_or;
using multiprocess::run_workers;
using multiprocess::worker_comm;
using multiprocess::worker_context;

// ---------------------------------------------------------------------------------------------
// Collectives: every rank's result against the single-process computation over all ranks'
// inputs (which every rank can make, the inputs being seeded by rank).

TEST(DISABLED_DistributedWorker, AllReduceSumEqualsSumOfRankTensors) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const int64_t n = comm.size();
  at::Tensor expected = at::zeros({3, 4});
  for (int64_t r = 0; r < n; ++r) expected += randn({3, 4}, 100 + r);
  at::Tensor mine = randn({3, 4}, 100 + comm.rank());
  comm.all_reduce_sum(mine);
  // Float sums in another order: a few ulps.
  EXPECT_TRUE(at::allclose(mine, expected, 1e-6, 1e-6)) << mine - expected;

  // Integers are exact; a non-contiguous view is reduced in place, through its base.
  at::Tensor base = at::arange(12, at::kLong).reshape({3, 4}) * (comm.rank() + 1);
  at::Tensor view = base.t();
  comm.all_reduce_sum(view);
  const int64_t rank_sum = n * (n + 1) / 2;  // 1 + 2 + ... + n
  EXPECT_TRUE(at::equal(base, at::arange(12, at::kLong).reshape({3, 4}) * rank_sum));

  // bfloat16 (staged through float32 where the transport lacks it): small integers stay exact.
  at::Tensor bf = at::full({5}, static_cast<double>(comm.rank() + 1), at::kBFloat16);
  comm.all_reduce_sum(bf);
  EXPECT_EQ(bf.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(bf, at::full({5}, static_cast<double>(rank_sum), at::kBFloat16)));
}

TEST(DISABLED_DistributedWorker, AllGatherConcatenatesInRankOrder) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  std::vector<at::Tensor> all;
  for (int64_t r = 0; r < comm.size(); ++r) all.push_back(randn({2, 3, 4}, 200 + r));
  const at::Tensor& mine = all[comm.rank()];
  for (int64_t dim : {0, 1, 2, -1}) {
    at::Tensor gathered = comm.all_gather(mine, dim);
    EXPECT_TRUE(at::equal(gathered, at::cat(all, dim))) << "dim " << dim;
  }
  // A non-contiguous input gathers its values, not its storage.
  std::vector<at::Tensor> transposed;
  transposed.reserve(all.size());
  for (const auto& t : all) transposed.push_back(t.transpose(0, 2));
  EXPECT_TRUE(at::equal(comm.all_gather(mine.transpose(0, 2), 0), at::cat(transposed, 0)));
  EXPECT_THAT([&] { comm.all_gather(mine, 3); }, ThrowsMessage<Error>(HasSubstr("dim 3 is out of range")));
}

TEST(DISABLED_DistributedWorker, ReduceScatterSumReturnsThisRanksChunkOfTheSum) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const int64_t n = comm.size();
  at::Tensor sum = at::zeros({2 * n, 3, n});
  for (int64_t r = 0; r < n; ++r) sum += randn({2 * n, 3, n}, 300 + r);
  at::Tensor mine = randn({2 * n, 3, n}, 300 + comm.rank());
  at::Tensor chunk0 = comm.reduce_scatter_sum(mine, 0);
  EXPECT_TRUE(at::allclose(chunk0, sum.narrow(0, 2 * comm.rank(), 2), 1e-6, 1e-6));
  at::Tensor chunk2 = comm.reduce_scatter_sum(mine, -1);
  ASSERT_EQ(chunk2.sizes(), (std::vector<int64_t>{2 * n, 3, 1}));
  EXPECT_TRUE(at::allclose(chunk2, sum.narrow(2, comm.rank(), 1), 1e-6, 1e-6));

  // Indivisible: an error naming the numbers, raised before any communication, so the group
  // stays usable.
  at::Tensor odd = at::ones({2, n + 1});
  EXPECT_THAT([&] { comm.reduce_scatter_sum(odd, 1); },
              ThrowsMessage<Error>(AllOf(HasSubstr(std::to_string(n + 1) + " is not divisible by " + std::to_string(n)),
                                         HasSubstr("[2, " + std::to_string(n + 1) + "]"))));
  at::Tensor ones = at::ones({n});
  comm.all_reduce_sum(ones);
  EXPECT_TRUE(at::equal(ones, at::full({n}, static_cast<double>(n))));
}

TEST(DISABLED_DistributedWorker, BroadcastCopiesRootsTensor) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const int64_t root = comm.size() - 1;
  at::Tensor t = randn({4, 2}, 400 + comm.rank());
  comm.broadcast(t, root);
  EXPECT_TRUE(at::equal(t, randn({4, 2}, 400 + root)));
  EXPECT_THAT([&] { comm.broadcast(t, comm.size()); }, ThrowsMessage<Error>(HasSubstr("out of range")));
}

TEST(DISABLED_DistributedWorker, EmptyTensorsKeepTheirShapes) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const int64_t n = comm.size();
  at::Tensor empty = at::zeros({0, 3});
  comm.all_reduce_sum(empty);
  comm.broadcast(empty, 0);
  EXPECT_EQ(empty.sizes(), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(comm.all_gather(at::zeros({2, 0}), 0).sizes(), (std::vector<int64_t>{2 * n, 0}));
  EXPECT_EQ(comm.reduce_scatter_sum(at::zeros({0, 2 * n}), 1).sizes(), (std::vector<int64_t>{0, 2}));
  // The group still works after the no-ops.
  at::Tensor one = at::ones({1});
  comm.all_reduce_sum(one);
  EXPECT_EQ(one.item<float>(), static_cast<float>(n));
}

TEST(DISABLED_DistributedWorker, BarrierWaitsForTheLastRank) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  at::Tensor sync = at::ones({1});
  comm.all_reduce_sum(sync);  // start together, give or take the scheduler
  const auto start = Clock::now();
  if (comm.rank() == comm.size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  comm.barrier();
  // 250 ms of slack for ranks that left the all-reduce late on a loaded machine.
  EXPECT_GE(seconds_since(start), 0.25) << "rank " << comm.rank() << " left the barrier early";
}

// Tensor-parallel groups: world 4, tp 2 -> groups {0, 1} and {2, 3}.
TEST(DISABLED_DistributedGroupsWorker, CollectivesStayInsideTheTensorParallelGroup) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = worker_context();
  ASSERT_EQ(par.tp_size(), 2);
  EXPECT_EQ(par.tp_rank(), par.rank() % 2);
  Communicator& comm = worker_comm();
  EXPECT_EQ(comm.rank(), par.tp_rank());
  EXPECT_EQ(comm.size(), 2);
  at::Tensor t = at::full({3}, static_cast<double>(par.rank() + 1), at::kLong);
  comm.all_reduce_sum(t);
  const int64_t first = par.rank() / 2 * 2;  // ranks first, first + 1
  EXPECT_TRUE(at::equal(t, at::full({3}, static_cast<double>((first + 1) + (first + 2)), at::kLong)));
}

// ---------------------------------------------------------------------------------------------
// Failures: a peer that exits or stops talking becomes a vlmgen::Error within the timeout.

TEST(DISABLED_DistributedFailureWorker, PeerExitDuringCollectiveRaises) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const int64_t exiting = std::stoll(getenv_or("VLMGEN_TEST_EXITING_RANK", "1"));
  at::Tensor t = at::ones({16});
  comm.all_reduce_sum(t);  // the group works
  if (comm.rank() == exiting) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let the others block first
    std::_Exit(0);
  }
  const auto start = Clock::now();
  try {
    comm.all_reduce_sum(t);
    ADD_FAILURE() << "rank " << comm.rank() << ": no error after rank " << exiting << " exited";
  } catch (const Error& e) {
    std::cerr << "rank " << comm.rank() << " got the expected error: " << e.what() << "\n";
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("all_reduce_sum failed on rank " + std::to_string(comm.rank())), HasSubstr("timeout")));
  }
  const double timeout_s = std::stod(getenv_or("VLMGEN_TEST_TIMEOUT_MS", "20000")) / 1000.0;
  EXPECT_LT(seconds_since(start), timeout_s + 5.0);
  // The communicator refuses further use instead of hanging on a broken group.
  EXPECT_THAT([&] { comm.barrier(); }, ThrowsMessage<Error>(HasSubstr("failed earlier")));
}

TEST(DISABLED_DistributedFailureWorker, SilentPeerTimesOut) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const double timeout_s = std::stod(getenv_or("VLMGEN_TEST_TIMEOUT_MS", "20000")) / 1000.0;
  at::Tensor t = at::ones({16});
  if (comm.rank() == 1) {
    // Alive but not calling the collective; afterwards its peer is gone or has given up.
    std::this_thread::sleep_for(std::chrono::duration<double>(timeout_s + 1.0));
    try {
      comm.all_reduce_sum(t);
    } catch (const Error&) {
    }
    return;
  }
  const auto start = Clock::now();
  try {
    comm.all_reduce_sum(t);
    ADD_FAILURE() << "no error from a collective that rank 1 never joined";
  } catch (const Error& e) {
    std::cerr << "rank 0 got the expected error: " << e.what() << "\n";
  }
  const double elapsed = seconds_since(start);
  EXPECT_GE(elapsed, timeout_s * 0.5) << "gave up before the timeout";
  EXPECT_LT(elapsed, timeout_s + 5.0);
}

// ---------------------------------------------------------------------------------------------
// The launching tests.

TEST(Distributed, CollectivesOnTwoRanksWithGloo) {
  if (!comm_backend_available("gloo")) GTEST_SKIP() << "this build has no Gloo";
  EXPECT_EQ(run_workers(2, "DISABLED_DistributedWorker.*", {{"VLMGEN_TEST_BACKEND", "gloo"}}), 0);
}

TEST(Distributed, CollectivesOnThreeRanksThroughTheStore) {
  EXPECT_EQ(run_workers(3, "DISABLED_DistributedWorker.*", {{"VLMGEN_TEST_BACKEND", "store"}}), 0);
}

TEST(Distributed, FourRanksFormTwoTensorParallelGroups) {
  EXPECT_EQ(run_workers(4, "DISABLED_DistributedGroupsWorker.*", {{"VLMGEN_TEST_TP", "2"}}), 0);
}

// The whole launch, including process start-up, is bounded well below a hang.
void expect_peer_failure_raises(const std::string& backend, const std::string& exiting_rank) {
  const auto start = Clock::now();
  EXPECT_EQ(run_workers(2, "DISABLED_DistributedFailureWorker.PeerExitDuringCollectiveRaises",
                        {{"VLMGEN_TEST_BACKEND", backend},
                         {"VLMGEN_TEST_TIMEOUT_MS", backend == "store" ? "4000" : "5000"},
                         {"VLMGEN_TEST_EXITING_RANK", exiting_rank}},
                        std::chrono::seconds(45)),
            0);
  EXPECT_LT(seconds_since(start), 30.0);
}

TEST(Distributed, PeerExitRaisesWithinTimeoutGloo) {
  if (!comm_backend_available("gloo")) GTEST_SKIP() << "this build has no Gloo";
  expect_peer_failure_raises("gloo", "1");
}

TEST(Distributed, StoreServerExitRaisesWithinTimeoutGloo) {
  if (!comm_backend_available("gloo")) GTEST_SKIP() << "this build has no Gloo";
  expect_peer_failure_raises("gloo", "0");
}

TEST(Distributed, PeerExitRaisesWithinTimeoutStore) { expect_peer_failure_raises("store", "1"); }

TEST(Distributed, StoreServerExitRaisesWithinTimeoutStore) { expect_peer_failure_raises("store", "0"); }

TEST(Distributed, SilentPeerTimesOut) {
  const auto start = Clock::now();
  EXPECT_EQ(run_workers(2, "DISABLED_DistributedFailureWorker.SilentPeerTimesOut", {{"VLMGEN_TEST_TIMEOUT_MS", "3000"}},
                        std::chrono::seconds(45)),
            0);
  EXPECT_LT(seconds_since(start), 30.0);
}

}  // namespace
}  // namespace vlmgen
