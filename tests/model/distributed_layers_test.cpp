// Tensor/sequence-parallel plumbing: the Megatron-style layers, on several ranks and in one
// process (no communicator), and the sharding of their weights.
//
// Multi-rank tests re-execute this binary as several ranks (see multiprocess_test_util.h).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "distributed_test_util.h"
#include "multiprocess_test_util.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/distributed/tensor_parallel.h"
#include "vlmgen/error.h"

namespace vlmgen {
namespace {

using distributed_test::randn;
using multiprocess::run_workers;
using multiprocess::worker_comm;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

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
// The launching tests.

TEST(TensorParallel, LayersOnTwoRanksEqualUnsharded) {
  EXPECT_EQ(run_workers(2, "DISABLED_TensorParallelWorker.*"), 0);
}

TEST(TensorParallel, LayersOnThreeRanksEqualUnsharded) {
  EXPECT_EQ(run_workers(3, "DISABLED_TensorParallelWorker.*"), 0);
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
