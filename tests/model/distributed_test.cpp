// Tensor/sequence-parallel plumbing: the c10d communicator, the torchrun-style environment and
// launcher, and the Megatron-style layers.
//
// Multi-rank tests re-execute this binary as several ranks (see multiprocess_test_util.h).

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "multiprocess_test_util.h"
#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/distributed/launch.h"
#include "vlmgen/distributed/tensor_parallel.h"
#include "vlmgen/error.h"
#include "vlmgen/parallel.h"

namespace vlmgen {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using Clock = std::chrono::steady_clock;
using multiprocess::getenv_or;
using multiprocess::run_workers;
using multiprocess::worker_comm;
using multiprocess::worker_context;

// ---------------------------------------------------------------------------------------------
// Helpers

at::Tensor randn(const std::vector<int64_t>& shape, uint64_t seed) {
  at::Generator gen = detail::make_cpu_generator(seed);
  return at::randn(shape, gen, at::kFloat);
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Sets (or, with nullopt, unsets) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(std::string name, const std::optional<std::string>& value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) old_ = old;
    if (value) {
      ::setenv(name_.c_str(), value->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// Clears every torchrun variable, then sets the given ones.
class TorchrunEnv {
 public:
  explicit TorchrunEnv(const std::vector<std::pair<std::string, std::string>>& values) {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) {
      std::optional<std::string> value;
      for (const auto& kv : values) {
        if (kv.first == name) value = kv.second;
      }
      guards_.push_back(std::make_unique<ScopedEnv>(name, value));
    }
  }

 private:
  std::vector<std::unique_ptr<ScopedEnv>> guards_;
};

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
// Megatron-style layers on every rank against the unsharded computation.

struct Mlp {
  at::Tensor w_up, b_up, w_down, b_down;  // [ffn, hidden], [ffn], [hidden, ffn], [hidden]
  at::Tensor forward(const at::Tensor& x) const {
    return at::linear(at::gelu(at::linear(x, w_up, b_up)), w_down, b_down);
  }
};

Mlp make_mlp(int64_t hidden, int64_t ffn) {
  return {randn({ffn, hidden}, 11), randn({ffn}, 12), randn({hidden, ffn}, 13), randn({hidden}, 14)};
}

TEST(DISABLED_TensorParallelWorker, ColumnThenRowParallelMlpEqualsUnsharded) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const int64_t tp = comm.size();
  const int64_t rank = comm.rank();
  const Mlp mlp = make_mlp(8, 12);
  const at::Tensor x = randn({2, 5, 8}, 15);
  const at::Tensor expected = mlp.forward(x);

  at::Tensor h = column_parallel_linear(x, shard_rows(mlp.w_up, rank, tp), shard_rows(mlp.b_up, rank, tp), &comm);
  ASSERT_EQ(h.size(-1), 12 / tp);
  at::Tensor y = row_parallel_linear(at::gelu(h), shard_cols(mlp.w_down, rank, tp), mlp.b_down, &comm);
  // Partial sums in another order: float32 rounding, far below the values' scale (~10).
  EXPECT_TRUE(at::allclose(y, expected, 1e-4, 1e-5)) << (y - expected).abs().max();

  at::Tensor gathered = column_parallel_linear(x, shard_rows(mlp.w_up, rank, tp), shard_rows(mlp.b_up, rank, tp), &comm,
                                               /*gather_output=*/true);
  EXPECT_TRUE(at::allclose(gathered, at::linear(x, mlp.w_up, mlp.b_up), 1e-5, 1e-6));
}

TEST(DISABLED_TensorParallelWorker, VocabParallelEmbeddingEqualsLookup) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const int64_t tp = comm.size();
  const at::Tensor table = randn({12, 4}, 21);
  const at::Tensor ids = at::tensor(std::vector<int64_t>{0, 11, 5, 4, 3, 8, 7, 6, 2, 1}, at::kLong).reshape({2, 5});
  const int64_t local_vocab = 12 / tp;
  at::Tensor out = vocab_parallel_embedding(ids, shard_rows(table, comm.rank(), tp), comm.rank() * local_vocab, &comm);
  // One rank contributes each row, the others zeros: exact.
  EXPECT_TRUE(at::equal(out, at::embedding(table, ids)));
  EXPECT_THAT([&] { vocab_parallel_embedding(ids + 3, shard_rows(table, comm.rank(), tp), 0, &comm); },
              ThrowsMessage<Error>(HasSubstr("token ids span [3, 14], outside the vocabulary [0, 12)")));
}

TEST(DISABLED_TensorParallelWorker, SequenceScatterGatherRoundTripsOddLengths) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const int64_t tp = comm.size();
  for (int64_t seq : {1, 5, 7}) {
    const at::Tensor x = randn({2, seq, 3}, 30 + seq);
    SequenceShard shard = scatter_sequence(x, &comm);
    const int64_t padded = (seq + tp - 1) / tp * tp;
    EXPECT_EQ(shard.seq_len, seq);
    ASSERT_EQ(shard.padded_len, padded);
    ASSERT_EQ(shard.local.sizes(), (std::vector<int64_t>{2, padded / tp, 3}));
    EXPECT_TRUE(at::equal(gather_sequence(shard.local, shard.seq_len, &comm), x)) << "S=" << seq;
    at::Tensor with_padding = gather_sequence(shard.local, shard.padded_len, &comm);
    EXPECT_TRUE(at::equal(with_padding.narrow(1, seq, padded - seq), at::zeros({2, padded - seq, 3})));
  }
  EXPECT_THAT(
      [&] {
        gather_sequence(at::zeros({1, 3, 2}), 3 * tp + 1, &comm);
      },
      ThrowsMessage<Error>(HasSubstr("cannot make a sequence of " + std::to_string(3 * tp + 1))));
}

TEST(DISABLED_TensorParallelWorker, SequenceParallelMlpEqualsUnsharded) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const int64_t tp = comm.size();
  const int64_t rank = comm.rank();
  const Mlp mlp = make_mlp(8, 12);
  const at::Tensor x = randn({2, 5, 8}, 41);  // S = 5: padded for every tp > 1 used here
  SequenceShard shard = scatter_sequence(x, &comm);
  // Megatron's SP block: all-gather the sequence, column-parallel, row-parallel with a
  // reduce-scatter back to sequence chunks.
  at::Tensor full_seq = gather_sequence(shard.local, shard.padded_len, &comm);
  at::Tensor h =
      column_parallel_linear(full_seq, shard_rows(mlp.w_up, rank, tp), shard_rows(mlp.b_up, rank, tp), &comm);
  at::Tensor y_local = row_parallel_linear(at::gelu(h), shard_cols(mlp.w_down, rank, tp), mlp.b_down, &comm,
                                           RowParallelReduce::kReduceScatterSequence);
  ASSERT_EQ(y_local.sizes(), shard.local.sizes());
  at::Tensor y = gather_sequence(y_local, shard.seq_len, &comm);
  EXPECT_TRUE(at::allclose(y, mlp.forward(x), 1e-4, 1e-5)) << (y - mlp.forward(x)).abs().max();

  // reduce_scatter_sequence on its own: this rank's chunk of the sum over ranks.
  at::Tensor partial = at::full({1, 2 * tp, 2}, static_cast<double>(rank + 1));
  at::Tensor chunk = reduce_scatter_sequence(partial, &comm);
  const int64_t rank_sum = tp * (tp + 1) / 2;
  EXPECT_TRUE(at::equal(chunk, at::full({1, 2, 2}, static_cast<double>(rank_sum))));
}

TEST(DISABLED_TensorParallelWorker, VocabParallelArgmaxEqualsFullArgmaxWithTies) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const int64_t tp = comm.size();
  const int64_t vocab = 12;
  const int64_t local = vocab / tp;
  at::Tensor logits = randn({7, vocab}, 51);
  const float inf = std::numeric_limits<float>::infinity();
  logits[0].fill_(1.0f);  // all equal: id 0
  logits[1][2] = 9.0f;    // a tie across shards: the lower id wins
  logits[1][vocab - 2] = 9.0f;
  logits[2][vocab - 1] = 9.0f;  // the max in the last shard
  logits[2][vocab - 3] = 9.0f;  // and a tie inside it
  logits[3].fill_(-inf);        // all -inf: id 0
  logits[4][local] = inf;       // +inf on rank 1's first id, tied later
  logits[4][vocab - 1] = inf;
  logits[5][vocab - 1] = std::nanf("");  // NaN wins, as in at::argmax
  logits[6][local + 1] = std::nanf("");  // two NaNs: the lower id
  logits[6][vocab - 1] = std::nanf("");
  const at::Tensor expected = logits.argmax(-1);
  ASSERT_EQ(expected[1].item<int64_t>(), 2);  // what the ties above rely on
  ASSERT_EQ(expected[5].item<int64_t>(), vocab - 1);

  const at::Tensor mine = shard_cols(logits, comm.rank(), tp);
  at::Tensor ids = vocab_parallel_argmax(mine, comm.rank() * local, &comm);
  EXPECT_EQ(ids.scalar_type(), at::kLong);
  EXPECT_TRUE(at::equal(ids, expected)) << ids << expected;

  EXPECT_TRUE(at::allclose(gather_last_position_logits(mine, &comm), logits, 0, 0, /*equal_nan=*/true));
  at::Tensor steps = at::stack({logits * 0.5, logits}, 1);  // [B, 2, V]: the last position is `logits`
  EXPECT_TRUE(at::allclose(gather_last_position_logits(
                               shard_cols(steps.transpose(1, 2), comm.rank(), tp).transpose(1, 2).contiguous(), &comm),
                           logits, 0, 0, /*equal_nan=*/true));
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

TEST(TensorParallel, LayersOnTwoRanksEqualUnsharded) {
  EXPECT_EQ(run_workers(2, "DISABLED_TensorParallelWorker.*"), 0);
}

TEST(TensorParallel, LayersOnThreeRanksEqualUnsharded) {
  EXPECT_EQ(run_workers(3, "DISABLED_TensorParallelWorker.*"), 0);
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

// ---------------------------------------------------------------------------------------------
// The environment, in this process.

TEST(DistributedEnvTest, NoVariablesMeansASingleProcess) {
  TorchrunEnv env({});
  EXPECT_FALSE(read_distributed_env().has_value());
  ParallelContext par = init_parallel_from_env();
  EXPECT_EQ(par.world_size(), 1);
  EXPECT_EQ(par.tp_size(), 1);
  EXPECT_EQ(par.tp_group(), nullptr);
  EXPECT_THAT([] { init_parallel_from_env(2); }, ThrowsMessage<Error>(HasSubstr("tensor-parallel size 2 needs 2")));
}

TEST(DistributedEnvTest, WorldOfOneNeedsNoRendezvous) {
  TorchrunEnv env({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  ParallelContext par = init_parallel_from_env();
  EXPECT_EQ(par.world_size(), 1);
  EXPECT_EQ(par.tp_group(), nullptr);
}

TEST(DistributedEnvTest, ReadsTorchrunVariables) {
  TorchrunEnv env(
      {{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29511"}});
  std::optional<DistributedEnv> e = read_distributed_env();
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->rank, 3);
  EXPECT_EQ(e->world_size, 4);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->master_addr, "10.1.2.3");
  EXPECT_EQ(e->master_port, 29511);
}

TEST(DistributedEnvTest, MissingOrMalformedVariablesAreNamed) {
  const std::vector<std::pair<std::string, std::string>> full = {
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  auto without = [&](const std::string& name) {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& kv : full) {
      if (kv.first != name) out.push_back(kv);
    }
    return out;
  };
  auto with = [&](const std::string& name, const std::string& value) {
    auto out = without(name);
    out.emplace_back(name, value);
    return out;
  };
  struct Case {
    std::vector<std::pair<std::string, std::string>> vars;
    std::vector<std::string> message;
  };
  const std::vector<Case> cases = {
      {without("RANK"), {"RANK is not set", "WORLD_SIZE=2"}},
      {without("WORLD_SIZE"), {"WORLD_SIZE is not set", "RANK=0"}},
      {without("MASTER_ADDR"), {"MASTER_ADDR is not set"}},
      {without("MASTER_PORT"), {"MASTER_PORT is not set"}},
      {with("MASTER_PORT", "abc"), {"MASTER_PORT must be an integer", "'abc'"}},
      {with("MASTER_PORT", "70000"), {"MASTER_PORT must be a TCP port", "70000"}},
      {with("RANK", "2"), {"RANK=2 is out of range for WORLD_SIZE=2"}},
      {with("RANK", "1x"), {"RANK must be an integer", "'1x'"}},
      {with("WORLD_SIZE", "0"), {"WORLD_SIZE must be >= 1", "0"}},
      {with("LOCAL_RANK", "-1"), {"LOCAL_RANK=-1 is out of range"}},
  };
  for (const Case& c : cases) {
    TorchrunEnv env(c.vars);
    try {
      init_parallel_from_env(0, std::chrono::milliseconds(500));
      ADD_FAILURE() << "no error for " << ::testing::PrintToString(c.vars);
    } catch (const Error& e) {
      for (const auto& part : c.message) EXPECT_THAT(e.what(), HasSubstr(part)) << ::testing::PrintToString(c.vars);
    }
  }
}

TEST(DistributedEnvTest, TensorParallelSizeMustDivideTheWorld) {
  // Checked before any connection is tried (nothing listens on this port).
  TorchrunEnv env({{"RANK", "0"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1"}});
  EXPECT_THAT([] { init_parallel_from_env(2, std::chrono::milliseconds(500)); },
              ThrowsMessage<Error>(HasSubstr("tensor-parallel size 2 does not divide WORLD_SIZE 3")));
  EXPECT_THAT([] { init_parallel_from_env(-1); }, ThrowsMessage<Error>(HasSubstr("got -1")));
}

TEST(DistributedEnvTest, AbsentPeersAreAnErrorAfterTheTimeout) {
  // Rank 1 of 2 with nobody serving the store: an error naming the address, not a hang.
  const int port = find_free_port();
  TorchrunEnv env(
      {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(port)}});
  const auto start = Clock::now();
  EXPECT_THAT([] { init_parallel_from_env(2, std::chrono::milliseconds(1000)); },
              ThrowsMessage<Error>(AllOf(HasSubstr("rank 1 of 2 could not reach the rendezvous store"),
                                         HasSubstr("127.0.0.1:" + std::to_string(port)))));
  EXPECT_LT(seconds_since(start), 15.0);
}

// ---------------------------------------------------------------------------------------------
// The launcher, with a shell as the command (no LibTorch start-up).

TEST(LaunchLocalRanks, SetsTheTorchrunVariables) {
  const std::string check =
      "test \"$WORLD_SIZE\" = 3 && test \"$RANK\" = \"$LOCAL_RANK\" && test \"$RANK\" -ge 0 && "
      "test \"$RANK\" -lt 3 && test \"$MASTER_ADDR\" = 127.0.0.1 && test \"$MASTER_PORT\" -gt 0 && "
      "test \"$EXTRA\" = yes";
  LaunchOptions options;
  options.env = {{"EXTRA", "yes"}};
  EXPECT_EQ(launch_local_ranks(3, {"/bin/sh", "-c", check}, options), 0);
}

TEST(LaunchLocalRanks, AFailingRankStopsTheOthers) {
  const auto start = Clock::now();
  const int status = launch_local_ranks(2, {"/bin/sh", "-c", "if [ \"$RANK\" = 1 ]; then exit 3; fi; exec sleep 30"});
  EXPECT_EQ(status, 3);
  EXPECT_LT(seconds_since(start), 10.0);
}

TEST(LaunchLocalRanks, TimeoutStopsEveryRank) {
  LaunchOptions options;
  options.timeout = std::chrono::milliseconds(300);
  options.kill_grace = std::chrono::milliseconds(200);
  const auto start = Clock::now();
  EXPECT_EQ(launch_local_ranks(2, {"/bin/sh", "-c", "trap '' TERM; exec sleep 30"}, options), 124);
  EXPECT_LT(seconds_since(start), 10.0);
}

TEST(LaunchLocalRanks, ACommandThatCannotStartIsAnError) {
  EXPECT_THAT([] { launch_local_ranks(2, {"/no/such/binary"}); },
              ThrowsMessage<Error>(HasSubstr("cannot start rank 0 of 2 ('/no/such/binary')")));
  EXPECT_THAT([] { launch_local_ranks(0, {"/bin/true"}); }, ThrowsMessage<Error>(HasSubstr("nproc >= 1, got 0")));
}

// ---------------------------------------------------------------------------------------------
// Single-process paths of the layers (no communicator) and sharding.

TEST(TensorParallelTest, ShardsSplitEvenlyOrNameTheNumbers) {
  const at::Tensor w = randn({6, 4}, 61);
  EXPECT_TRUE(at::equal(at::cat({shard_rows(w, 0, 3), shard_rows(w, 1, 3), shard_rows(w, 2, 3)}, 0), w));
  EXPECT_TRUE(at::equal(at::cat({shard_cols(w, 0, 2), shard_cols(w, 1, 2)}, 1), w));
  EXPECT_TRUE(shard_cols(w, 1, 2).is_contiguous());
  EXPECT_THAT([&] { shard_rows(w, 0, 4); },
              ThrowsMessage<Error>(AllOf(HasSubstr("6 rows"), HasSubstr("[6, 4]"), HasSubstr("size 4"),
                                         HasSubstr("6 is not divisible by 4"))));
  EXPECT_THAT([&] { shard_cols(w, 0, 3); }, ThrowsMessage<Error>(HasSubstr("4 is not divisible by 3")));
  EXPECT_THAT([&] { shard_rows(w, 2, 2); }, ThrowsMessage<Error>(HasSubstr("tp rank 2 is out of range")));
  EXPECT_THAT([&] { shard_cols(at::ones({4}), 0, 2); }, ThrowsMessage<Error>(HasSubstr("1 dims")));
}

TEST(TensorParallelTest, WithoutACommunicatorEveryLayerIsTheSingleProcessOne) {
  const Mlp mlp = make_mlp(8, 12);
  const at::Tensor x = randn({2, 5, 8}, 71);
  at::Tensor h = column_parallel_linear(x, mlp.w_up, mlp.b_up, nullptr, /*gather_output=*/true);
  EXPECT_TRUE(at::equal(row_parallel_linear(at::gelu(h), mlp.w_down, mlp.b_down, nullptr), mlp.forward(x)));
  EXPECT_TRUE(at::equal(column_parallel_linear(x, mlp.w_up, at::Tensor(), nullptr), at::linear(x, mlp.w_up)));
  EXPECT_TRUE(at::equal(row_parallel_linear(h, mlp.w_down, at::Tensor(), nullptr), at::linear(h, mlp.w_down)));
  EXPECT_THAT([&] { column_parallel_linear(x, mlp.w_down, mlp.b_up, nullptr); },
              ThrowsMessage<Error>(HasSubstr("does not match local weight [8, 12]")));

  const at::Tensor table = randn({12, 4}, 72);
  const at::Tensor ids = at::tensor(std::vector<int64_t>{0, 11, 5}, at::kLong);
  EXPECT_TRUE(at::equal(vocab_parallel_embedding(ids, table, 0, nullptr), at::embedding(table, ids)));
  EXPECT_THAT([&] { vocab_parallel_embedding(ids - 1, table, 0, nullptr); },
              ThrowsMessage<Error>(HasSubstr("[-1, 10], outside the vocabulary [0, 12)")));

  SequenceShard shard = scatter_sequence(x, nullptr);
  EXPECT_EQ(shard.padded_len, 5);
  EXPECT_TRUE(at::equal(gather_sequence(shard.local, shard.seq_len, nullptr), x));
  EXPECT_TRUE(at::equal(reduce_scatter_sequence(x, nullptr), x));

  const at::Tensor logits = randn({3, 12}, 73);
  EXPECT_TRUE(at::equal(vocab_parallel_argmax(logits, 0, nullptr), logits.argmax(-1)));
  EXPECT_TRUE(at::equal(gather_last_position_logits(logits, nullptr), logits));
  EXPECT_TRUE(at::equal(gather_last_position_logits(at::stack({x[0], x[1]}, 0), nullptr), x.select(1, -1)));
}

}  // namespace
}  // namespace vlmgen
