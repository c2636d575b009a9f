#pragma once

// Helpers of the tensor-parallel model tests (tensor_parallel_*_test.cpp,
// vision_tower_tp_test.cpp): expected shards computed independently of the library, groups that
// refuse or count collectives, the comparison of a TP run with a TP=1 run, call by call, and the
// requests they generate from.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "multiprocess_test_util.h"
#include "qwen_test_util.h"
#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/models/llava_next.h"
#include "vlmgen/models/qwen_vl.h"
#include "vlmgen/models/qwen_vl_config.h"
#include "vlmgen/parallel.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen::tp_test {

using qwen_vl::ShardLayout;

// TP=2 logits against TP=1 (the same sums split into two partial sums, then added): float32
// rounding. Measured max 2.4e-7 (greedy), 3.0e-7 (SP); kept far below the logits' spread (~0.1)
// and the effect of a wrong shard (> 1e-2).
constexpr double kTpTolerance = 1e-5;

// The same slice the model should hold, computed here independently of the library's sharding.
inline at::Tensor expected_slice(const at::Tensor& full, ShardLayout layout, int64_t rank, int64_t tp) {
  switch (layout) {
    case ShardLayout::kReplicated: return full;
    case ShardLayout::kRows: return full.chunk(tp, 0)[rank];
    case ShardLayout::kColumns: return full.chunk(tp, 1)[rank];
    case ShardLayout::kStackedRows: {
      std::vector<at::Tensor> parts;
      for (const at::Tensor& third : full.chunk(3, 0)) parts.push_back(third.chunk(tp, 0)[rank]);
      return at::cat(parts, 0);
    }
  }
  return {};
}

// The layout each weight must have when its part of the model is split, from its HF name.
inline ShardLayout layout_by_name(const std::string& name) {
  auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with("attn.qkv.weight") || ends_with("attn.qkv.bias")) return ShardLayout::kStackedRows;
  for (const char* rows : {"q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight",
                           "v_proj.bias", "gate_proj.weight", "up_proj.weight", "fc1.weight", "fc1.bias",
                           "merger.mlp.0.weight", "merger.mlp.0.bias", "embed_tokens.weight", "lm_head.weight"}) {
    if (ends_with(rows)) return ShardLayout::kRows;
  }
  for (const char* cols : {"o_proj.weight", "down_proj.weight", "attn.proj.weight", "out_proj.weight", "fc2.weight",
                           "merger.mlp.2.weight"}) {
    if (ends_with(cols)) return ShardLayout::kColumns;
  }
  return ShardLayout::kReplicated;
}

/// A tensor-parallel group whose collectives must not be reached: for the checks that have to
/// happen before any communication, and for building a rank's shards in one process.
class NoCollectives : public Communicator {
 public:
  NoCollectives(int64_t rank, int64_t size) : rank_(rank), size_(size) {}
  int64_t rank() const override { return rank_; }
  int64_t size() const override { return size_; }
  void all_reduce_sum(at::Tensor&) override { fail("all_reduce_sum"); }
  at::Tensor all_gather(const at::Tensor&, int64_t) override { fail("all_gather"); }
  at::Tensor reduce_scatter_sum(const at::Tensor&, int64_t) override { fail("reduce_scatter_sum"); }
  void broadcast(at::Tensor&, int64_t) override { fail("broadcast"); }
  void barrier() override { fail("barrier"); }

 private:
  [[noreturn]] static void fail(const char* op) { throw Error(std::string("unexpected collective: ") + op); }
  int64_t rank_;
  int64_t size_;
};

inline ParallelContext without_collectives(int64_t rank, int64_t tp) {
  return ParallelContext::make(tp, rank, tp, rank, std::make_shared<NoCollectives>(rank, tp));
}

/// Forwards to a real communicator and counts the collectives by kind, so a test can see which
/// path a forward call took (sequence-parallel reduce-scatters or all-reduces).
class CountingCommunicator : public Communicator {
 public:
  explicit CountingCommunicator(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int64_t rank() const override { return inner_->rank(); }
  int64_t size() const override { return inner_->size(); }
  void all_reduce_sum(at::Tensor& t) override {
    ++all_reduces;
    inner_->all_reduce_sum(t);
  }
  at::Tensor all_gather(const at::Tensor& t, int64_t dim) override {
    ++all_gathers;
    return inner_->all_gather(t, dim);
  }
  at::Tensor reduce_scatter_sum(const at::Tensor& t, int64_t dim) override {
    ++reduce_scatters;
    return inner_->reduce_scatter_sum(t, dim);
  }
  void broadcast(at::Tensor& t, int64_t root) override { inner_->broadcast(t, root); }
  void barrier() override { inner_->barrier(); }
  void reset() { all_reduces = all_gathers = reduce_scatters = 0; }

  int64_t all_reduces = 0;
  int64_t all_gathers = 0;
  int64_t reduce_scatters = 0;

 private:
  std::shared_ptr<Communicator> inner_;
};

// The worker's context with its group wrapped in a CountingCommunicator.
inline std::pair<ParallelContext, std::shared_ptr<CountingCommunicator>> counted_context(bool sequence_parallel) {
  const ParallelContext& par = multiprocess::worker_context();
  auto counter = std::make_shared<CountingCommunicator>(par.tp_group());
  ParallelContext counted = ParallelContext::make(par.world_size(), par.rank(), par.tp_size(), par.tp_rank(), counter);
  counted.sequence_parallel(sequence_parallel);
  return {counted, counter};
}

/// One generate call with every forward call recorded.
struct RecordedRun {
  GenerationResult result;
  std::vector<testing::ForwardCall> calls;
};

inline RecordedRun generate_recorded(CausalVlm& model, const ParallelContext& parallel, const GenerateRequest& request,
                                     const GenerationConfig& config) {
  testing::ForwardSpy spy(model);
  spy.record_tensors(true);
  RecordedRun run;
  run.result = Generator(spy, parallel).generate(request, config);
  run.calls = spy.calls();
  return run;
}

/// Every row's tokens are the same on every rank of the group.
inline void expect_same_tokens_on_every_rank(const GenerationResult& result, Communicator& comm, int64_t max_new) {
  const auto rows = static_cast<int64_t>(result.sequences.size());
  at::Tensor mine = at::full({1, rows, max_new}, -1, at::kLong);
  for (int64_t r = 0; r < rows; ++r) {
    const auto& tokens = result.sequences[r].tokens;
    mine[0][r].narrow(0, 0, static_cast<int64_t>(tokens.size())).copy_(at::tensor(tokens, at::kLong));
  }
  at::Tensor all = comm.all_gather(mine, 0);
  for (int64_t rank = 0; rank < comm.size(); ++rank) {
    EXPECT_TRUE(at::equal(all[rank], mine[0])) << "rank " << rank << " chose other tokens: " << all;
  }
}

/// Tokens and finish reasons equal, logprobs and this rank's block of every call's logits close;
/// returns the largest logit difference.
inline double expect_run_matches_tp1(const RecordedRun& tp1, const RecordedRun& tp, const std::string& what) {
  const ParallelContext& par = multiprocess::worker_context();
  EXPECT_EQ(tp.result.stats.used_kv_cache, tp1.result.stats.used_kv_cache) << what;
  EXPECT_EQ(tp.result.sequences.size(), tp1.result.sequences.size()) << what;
  for (size_t r = 0; r < std::min(tp.result.sequences.size(), tp1.result.sequences.size()); ++r) {
    const SequenceOutput& a = tp1.result.sequences[r];
    const SequenceOutput& b = tp.result.sequences[r];
    EXPECT_EQ(b.tokens, a.tokens) << what << ", row " << r;
    EXPECT_EQ(b.finish_reason, a.finish_reason) << what << ", row " << r;
    EXPECT_EQ(b.logprobs.size(), a.logprobs.size()) << what << ", row " << r;
    for (size_t i = 0; i < std::min(a.logprobs.size(), b.logprobs.size()); ++i) {
      EXPECT_NEAR(b.logprobs[i], a.logprobs[i], kTpTolerance) << what << ", row " << r << " token " << i;
    }
  }
  EXPECT_EQ(tp.calls.size(), tp1.calls.size()) << what;
  double worst = 0.0;
  for (size_t i = 0; i < std::min(tp.calls.size(), tp1.calls.size()); ++i) {
    EXPECT_EQ(tp.calls[i].window_start, tp1.calls[i].window_start) << what << ", call " << i;
    EXPECT_EQ(tp.calls[i].window_end, tp1.calls[i].window_end) << what << ", call " << i;
    const at::Tensor& local = tp.calls[i].logits;
    const int64_t block = local.size(2);
    EXPECT_EQ(block * par.tp_size(), tp1.calls[i].logits.size(2)) << what;
    const at::Tensor expected = tp1.calls[i].logits.narrow(2, par.tp_rank() * block, block);
    worst = std::max(worst, (local - expected).abs().max().item<double>());
  }
  EXPECT_LE(worst, kTpTolerance) << what;
  return worst;
}

/// The launch environment of the two-rank tests: Gloo on loopback (the c10d store when the build
/// lacks Gloo), TP 2, a 20 s bound on collectives.
inline std::vector<std::pair<std::string, std::string>> two_rank_env(
    std::vector<std::pair<std::string, std::string>> more = {}) {
  more.emplace_back("VLMGEN_TEST_TP", "2");
  more.emplace_back("VLMGEN_TEST_TIMEOUT_MS", "20000");
  return more;
}

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Two rows with an image each, of lengths 13 and 14 (left-padded to 14).
inline GenerateRequest image_request(const QwenVlConfig& c) {
  return GenerateRequest(
      {qwen_test::image_prompt({1, 2, 3, 4, 5}, 4, {6, 7}), qwen_test::image_prompt({9}, 8, {10, 11, 12})},
      qwen_test::make_vision(c, {{1, 4, 4}, {1, 4, 8}}, 81));
}

// Two rows of 13 tokens each: a prompt length that does not divide by 2.
inline GenerateRequest odd_length_request(const QwenVlConfig& c) {
  return GenerateRequest(
      {qwen_test::image_prompt({1, 2, 3, 4, 5}, 4, {6, 7}), qwen_test::image_prompt({9}, 8, {10, 11})},
      qwen_test::make_vision(c, {{1, 4, 4}, {1, 4, 8}}, 82));
}

// Gemma-3 (tiny config): two rows of 10 and 11 tokens (ragged, odd), an image of 4 placeholders in each.
inline GenerateRequest gemma3_request() {
  const std::vector<int64_t> image = {88, 90, 90, 90, 90, 89};
  std::vector<int64_t> row0 = {2, 3}, row1 = {9};
  row0.insert(row0.end(), image.begin(), image.end());
  row0.insert(row0.end(), {4, 5});
  row1.insert(row1.end(), image.begin(), image.end());
  row1.insert(row1.end(), {10, 11, 12, 13});
  at::Generator gen = detail::make_cpu_generator(83);
  return GenerateRequest({row0, row1}, VisionInputs::per_image(at::randn({2, 3, 16, 16}, gen)));
}

// LLaVA-NeXT: a wide and a tall image (1x3 and 2x2 tiles of 8x8 pixels besides the base tile).
inline GenerateRequest llava_next_request(const LlavaNextConfig& config) {
  const int64_t a = llava_next_placeholder_count(config, 10, 30), b = llava_next_placeholder_count(config, 20, 12);
  std::vector<int64_t> row0 = {1, 3}, row1 = {1, 7};
  row0.insert(row0.end(), static_cast<size_t>(a), 90);
  row0.push_back(4);
  row1.insert(row1.end(), static_cast<size_t>(b), 90);
  row1.insert(row1.end(), {8, 9});
  at::Generator gen = detail::make_cpu_generator(84);
  return GenerateRequest({row0, row1},
                         VisionInputs::per_image(at::randn({2, 5, 3, 8, 8}, gen),
                                                 at::tensor(std::vector<int64_t>{10, 30, 20, 12}).view({2, 2})));
}

/// Checks that this rank's encoder layer holds its slice of the TP=1 layer: half the heads
/// (q_proj rows) and half of fc2's columns.
template <typename Layer>
void expect_tower_layer_is_this_ranks_slice(const Layer& local, const Layer& whole, int64_t rank) {
  EXPECT_EQ(local.q_proj.weight.size(0) * 2, whole.q_proj.weight.size(0)) << "half the heads on each rank";
  EXPECT_TRUE(local.q_proj.weight.equal(whole.q_proj.weight.chunk(2, 0)[rank]));
  EXPECT_TRUE(local.fc2.weight.equal(whole.fc2.weight.chunk(2, 1)[rank]));
}

}  // namespace vlmgen::tp_test
