// Tensor parallelism through the Generator beyond greedy tokens: prompt and top-k log-probabilities
// and returned logits, seeded sampling and the sampler on vocabulary shards equal TP=1's; ranks
// given different requests all raise; a rank that dies mid-generation makes the other raise in
// bounded time. Workers and launching tests as in tensor_parallel_model_test.cpp.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "multiprocess_test_util.h"
#include "qwen_test_util.h"
#include "tp_test_util.h"
#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/models/qwen2_vl.h"
#include "vlmgen/parallel.h"
#include "vlmgen/sampling.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)
using namespace tp_test;    // NOLINT(google-build-using-namespace)

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using multiprocess::getenv_or;
using multiprocess::run_workers;
using multiprocess::worker_comm;
using multiprocess::worker_context;

// ---------------------------------------------------------------------------------------------
// Workers (run as ranks of a launch; see multiprocess_test_util.h)

// Ranks given different requests (another length, other ids, another option, another picture)
// all raise the same vlmgen::Error before any collective of the model, and stay usable.
TEST(DISABLED_TpModelWorker, RanksGivenDifferentRequestsAllRaise) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = multiprocess::worker_context();
  ASSERT_EQ(par.tp_size(), 2);
  const QwenVlConfig config = test_config(2);
  Qwen2Vl model(config, 13, 0.02, par);
  Generator generator(model, par);
  const GenerateRequest request = image_request(config);
  const auto gen_config = GenerationConfig().max_new_tokens(3);
  const bool odd = par.tp_rank() == 1;
  std::vector<std::pair<std::string, std::function<void(GenerateRequest&, GenerationConfig&)>>> cases = {
      {"longer prompt", [](GenerateRequest& r, GenerationConfig&) { r.prompts[0].push_back(5); }},
      {"other token", [](GenerateRequest& r, GenerationConfig&) { r.prompts[0][0] += 1; }},
      {"other max_new_tokens", [](GenerateRequest&, GenerationConfig& c) { c.max_new_tokens(4); }},
      {"other seed", [](GenerateRequest&, GenerationConfig& c) { c.seed(99); }},
      {"other picture",
       [](GenerateRequest& r, GenerationConfig&) {
         r.vision.pixel_values = r.vision.pixel_values.clone();
         r.vision.pixel_values.view({-1})[7] += 0.5;
       }},
  };
  for (auto& [what, change] : cases) {
    GenerateRequest mine = request;
    GenerationConfig mine_config = gen_config;
    if (odd) change(mine, mine_config);
    try {
      generator.generate(mine, mine_config);
      ADD_FAILURE() << what << ": expected vlmgen::Error on rank " << par.tp_rank();
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("tensor-parallel ranks were given different requests: rank(s) [1]"))
          << what;
    }
  }
  auto out = generator.generate(request, gen_config);
  expect_same_tokens_on_every_rank(out, *par.tp_group(), 3);
}

// Prompt log-probabilities, top-k log-probabilities and returned logits come from the whole
// vocabulary under TP=2 (gathered from the ranks' blocks) and equal TP=1's.
TEST(DISABLED_TpModelWorker, ScoresEqualTp1) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = worker_context();
  const QwenVlConfig config = test_config();
  Qwen2Vl reference(config, 13);
  Qwen2Vl model(config, 13, 0.02, par);
  const GenerateRequest request = image_request(config);
  for (bool kv : {true, false}) {
    const auto gen_config = GenerationConfig()
                                .max_new_tokens(4)
                                .enable_kv_cache(kv)
                                .prompt_logprobs(true)
                                .top_logprobs(5)
                                .return_logits(true)
                                .prefill_chunk_size(kv ? 7 : 0);
    auto tp1 = Generator(reference).generate(request, gen_config);
    auto tp2 = Generator(model, par).generate(request, gen_config);
    for (size_t r = 0; r < tp1.sequences.size(); ++r) {
      const auto& a = tp1.sequences[r];
      const auto& b = tp2.sequences[r];
      ASSERT_EQ(a.tokens, b.tokens);
      ASSERT_EQ(a.prompt_logprobs.size(), request.prompts[r].size());
      ASSERT_EQ(b.prompt_logprobs.size(), a.prompt_logprobs.size());
      EXPECT_TRUE(std::isnan(b.prompt_logprobs[0]));
      for (size_t i = 1; i < a.prompt_logprobs.size(); ++i) {
        EXPECT_NEAR(b.prompt_logprobs[i], a.prompt_logprobs[i], kTpTolerance) << "row " << r << " token " << i;
        EXPECT_LT(a.prompt_logprobs[i], 0.0f);
      }
      ASSERT_EQ(b.top_logprobs.size(), a.top_logprobs.size());
      for (size_t s = 0; s < a.top_logprobs.size(); ++s) {
        ASSERT_EQ(b.top_logprobs[s].size(), 5u);
        EXPECT_EQ(b.top_logprobs[s][0].first, a.top_logprobs[s][0].first);
        for (size_t j = 0; j < 5; ++j)
          EXPECT_NEAR(b.top_logprobs[s][j].second, a.top_logprobs[s][j].second, kTpTolerance);
      }
      ASSERT_EQ(b.logits.sizes(), (at::IntArrayRef{4, config.vocab_size})) << "gathered to the whole vocabulary";
      EXPECT_LE((b.logits - a.logits).abs().max().item<double>(), kTpTolerance);
      // And TP=1's numbers are the log-softmax of the logits the tokens were chosen from.
      at::Tensor lp = at::log_softmax(a.logits, -1);
      for (size_t s = 0; s < a.tokens.size(); ++s) {
        EXPECT_NEAR(a.top_logprobs[s][0].second, lp[static_cast<int64_t>(s)].max().item<float>(), 1e-6);
      }
    }
  }
}

TEST(DISABLED_TpModelWorker, SeededSamplingEqualsTp1) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = worker_context();
  const QwenVlConfig config = test_config();
  Qwen2Vl reference(config, 13);
  Qwen2Vl model(config, 13, 0.02, par);
  const GenerateRequest request = image_request(config);
  double worst = 0.0;
  const std::vector<GenerationConfig> configs = {
      GenerationConfig().max_new_tokens(8).temperature(0.9).top_k(40).top_p(0.95).seed(1234).return_logprobs(true),
      GenerationConfig().max_new_tokens(8).temperature(1.5).row_seeds({7, 8}).enable_kv_cache(false),
      GenerationConfig().max_new_tokens(8).return_logprobs(true),  // greedy, logprobs gathered
  };
  for (size_t i = 0; i < configs.size(); ++i) {
    RecordedRun tp1 = generate_recorded(reference, ParallelContext::single(), request, configs[i]);
    RecordedRun tp2 = generate_recorded(model, par, request, configs[i]);
    worst = std::max(worst, expect_run_matches_tp1(tp1, tp2, fmt::format("sampling config {}", i)));
    expect_same_tokens_on_every_rank(tp2.result, *par.tp_group(), 8);
  }
  // The seed matters (so the equality above is not a coincidence of near-greedy sampling).
  RecordedRun other = generate_recorded(model, par, request, GenerationConfig(configs[0]).seed(99));
  RecordedRun first = generate_recorded(model, par, request, configs[0]);
  EXPECT_NE(other.result.sequences[0].tokens, first.result.sequences[0].tokens);
  report("TP=2 vs TP=1 per-step logits (seeded sampling), max|diff|", worst);
}

TEST(DISABLED_TpModelWorker, SamplerOnVocabShardsEqualsSamplerOnFullVocabulary) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const int64_t tp = comm.size();
  const int64_t block = 48;
  const int64_t vocab = block * tp - 3;  // the last block ends in 3 padding columns
  at::Generator gen = detail::make_cpu_generator(5);
  at::Tensor full = at::randn({4, block * tp}, gen, at::kFloat);
  full[0][vocab - 2] = 50.0f;       // suppressed, in the last block
  full[1][block * tp - 1] = 90.0f;  // padding: never chosen
  full[2][3] = 50.0f;               // suppressed, in the first block
  full[3].fill_(1.0f);              // a tie over the whole vocabulary: the lowest id
  SamplingOptions options;
  options.suppressed_tokens = {vocab - 2, 3};
  const at::Tensor local = full.narrow(1, comm.rank() * block, block);
  const VocabShard shard{comm.rank() * block, vocab, &comm};
  const std::vector<bool> active = {true, true, true, true};

  std::vector<int64_t> greedy = Sampler(options, 4).choose_vocab_parallel(local, shard, active);
  std::vector<int64_t> expected = Sampler(options, 4).choose(full.narrow(1, 0, vocab), active);
  EXPECT_EQ(greedy, expected);
  EXPECT_NE(greedy[0], vocab - 2);
  EXPECT_LT(greedy[1], vocab);
  EXPECT_NE(greedy[2], 3);
  EXPECT_EQ(greedy[3], 0);
  EXPECT_EQ(Sampler(options, 4).choose_vocab_parallel(local, shard, {true, false, true, false}),
            (std::vector<int64_t>{expected[0], -1, expected[2], -1}));
  // Rows no token can be chosen from fail on every rank as with the whole vocabulary: a NaN at a
  // suppressed id (in the last block), +inf (in the first), no allowed id above -inf.
  for (int bad = 0; bad < 3; ++bad) {
    at::Tensor broken = full.clone();
    if (bad == 0) broken[1][vocab - 2] = std::nanf("");
    if (bad == 1) broken[1][1] = std::numeric_limits<float>::infinity();
    if (bad == 2) {
      broken[1].fill_(-std::numeric_limits<float>::infinity());
      broken[1][3] = 1.0f;  // suppressed
    }
    EXPECT_THROW(Sampler(options, 4).choose(broken.narrow(1, 0, vocab), active), Error) << bad;
    EXPECT_THROW(Sampler(options, 4).choose_vocab_parallel(broken.narrow(1, comm.rank() * block, block), shard, active),
                 Error)
        << "rank " << comm.rank() << ", case " << bad;
  }

  options.temperature = 3.0;  // flat enough that the draws spread over many ids
  options.seed = 17;
  Sampler sharded(options, 4);
  Sampler whole(options, 4);
  for (int step = 0; step < 20; ++step) {
    std::vector<float> lp_sharded;
    std::vector<float> lp_whole;
    std::vector<int64_t> a = sharded.choose_vocab_parallel(local, shard, active, &lp_sharded);
    std::vector<int64_t> b = whole.choose(full.narrow(1, 0, vocab), active, &lp_whole);
    EXPECT_EQ(a, b) << "step " << step;
    EXPECT_EQ(lp_sharded, lp_whole) << "step " << step;
    for (int64_t id : a) EXPECT_TRUE(id != vocab - 2 && id != 3 && id < vocab) << id;
  }
}

TEST(DISABLED_TpModelFailureWorker, RankKilledMidGenerationRaisesOnTheOther) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = worker_context();
  const int64_t exiting = std::stoll(getenv_or("VLMGEN_TEST_EXITING_RANK", "1"));
  const QwenVlConfig config = test_config();
  Qwen2Vl model(config, 13, 0.02, par);
  GenerateRequest request = image_request(config);
  request.on_token = [&](const TokenEvent& e) {
    if (par.tp_rank() == exiting && e.step == 2) std::_Exit(0);  // dies between two steps
    return true;
  };
  Generator generator(model, par);
  const auto start = Clock::now();
  try {
    generator.generate(request, GenerationConfig().max_new_tokens(16));
    ADD_FAILURE() << "rank " << par.tp_rank() << ": generate returned although rank " << exiting << " died";
  } catch (const Error& e) {
    std::cerr << "rank " << par.tp_rank() << " got the expected error: " << e.what() << "\n";
    EXPECT_THAT(e.what(), HasSubstr("failed on rank " + std::to_string(par.tp_rank())));
  }
  const double elapsed = seconds_since(start);
  report("seconds until the surviving rank raised", elapsed);
  EXPECT_LT(elapsed, multiprocess::worker_timeout().count() / 1000.0 + 5.0);
}

// ---------------------------------------------------------------------------------------------
// The launching tests: two ranks (two_rank_env).

TEST(TensorParallelModel, ScoresTp2EqualTp1) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.ScoresEqualTp1", two_rank_env()), 0);
}

TEST(TensorParallelModel, RanksGivenDifferentRequestsAllRaise) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.RanksGivenDifferentRequestsAllRaise", two_rank_env()), 0);
}

TEST(TensorParallelModel, SeededSamplingTp2EqualsTp1) {
  // Both sampling workers in one launch: one process start-up for two tests.
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.SeededSamplingEqualsTp1", two_rank_env()), 0);
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.SamplerOnVocabShardsEqualsSamplerOnFullVocabulary", two_rank_env()),
            0);
}

TEST(TensorParallelModel, RankKilledMidGenerationRaisesOnTheOther) {
  for (const char* exiting : {"1", "0"}) {  // a peer, then the rank serving the store
    const auto start = Clock::now();
    EXPECT_EQ(run_workers(
                  2, "DISABLED_TpModelFailureWorker.RankKilledMidGenerationRaisesOnTheOther",
                  {{"VLMGEN_TEST_TP", "2"}, {"VLMGEN_TEST_TIMEOUT_MS", "5000"}, {"VLMGEN_TEST_EXITING_RANK", exiting}},
                  std::chrono::seconds(45)),
              0)
        << "exiting rank " << exiting;
    EXPECT_LT(seconds_since(start), 30.0) << "exiting rank " << exiting;
  }
}

}  // namespace
}  // namespace vlmgen
