// vlmgen::Engine's queue and caches at their edges: a request cancelled while it waits ends at
// once and holds no place in line; prompt scores are whole when the prompt is in the prefix
// cache; a max_new_tokens the booking arithmetic cannot hold is refused at submit.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "vlmgen/engine/engine.h"
#include "vlmgen/generator.h"
#include "vlmgen/testing/fake_vlm.h"

namespace vlmgen {
namespace {

using ::testing::HasSubstr;

// A request that decodes slowly (20 ms a token) until it is cancelled at the test's end, so the
// others' checks fit well within its life even on a loaded machine.
GenerateRequest slow_request(std::vector<int64_t> prompt) {
  GenerateRequest request({std::move(prompt)});
  request.on_token = [](const TokenEvent&) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return true;
  };
  return request;
}

TEST(EngineQueue, ARequestCancelledWhileWaitingEndsWithoutWaitingForASlot) {
  testing::FakeVlm model;
  Engine engine(model, EngineOptions().max_running(1));
  auto busy = engine.submit(slow_request({1, 2, 3}), GenerationConfig().max_new_tokens(3000));
  auto queued = engine.submit(GenerateRequest({{4, 5, 6}}), GenerationConfig().max_new_tokens(4));
  queued->cancel();
  const GenerationResult result = queued->wait();  // before: only once `busy` had ended
  EXPECT_FALSE(busy->done()) << "the cancelled request waited for the running one to end";
  EXPECT_EQ(result.sequences.at(0).finish_reason, FinishReason::kCancelled);
  EXPECT_TRUE(result.sequences[0].tokens.empty());
  busy->cancel();
  busy->wait();
  EXPECT_EQ(engine.metrics().kv_blocks_used, 0);
  EXPECT_EQ(engine.metrics().waiting, 0);
}

TEST(EngineQueue, ACancelledRequestAtTheHeadOfTheQueueDoesNotHoldUpTheOnesBehind) {
  testing::FakeVlm model;
  const int64_t per_token = model.traits().kv_cache.bytes_per_token();
  ASSERT_GT(per_token, 0);
  // Blocks of 10 columns, 20 in the budget. The running request books 10 (3-token prompt + 98
  // new: 100 columns), the big one 15 (> what is left), the small one 1.
  Engine engine(model, EngineOptions().max_running(4).kv_block_columns(10).kv_cache_bytes(20 * 10 * per_token));
  ASSERT_EQ(engine.metrics().kv_blocks_total, 20);
  auto busy = engine.submit(slow_request({1, 2, 3}), GenerationConfig().max_new_tokens(98));
  // Wait until it runs, so the big request cannot be admitted beside it.
  for (int i = 0; i < 2000 && engine.metrics().running == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(engine.metrics().running, 1);
  auto big = engine.submit(GenerateRequest({std::vector<int64_t>(50, 7)}), GenerationConfig().max_new_tokens(100));
  auto small = engine.submit(GenerateRequest({{8, 9}}), GenerationConfig().max_new_tokens(3));
  big->cancel();
  EXPECT_EQ(small->wait().sequences.at(0).tokens.size(), 3u);  // before: only once `busy` had ended
  EXPECT_FALSE(busy->done()) << "the small request waited behind the cancelled one";
  EXPECT_EQ(big->wait().sequences.at(0).finish_reason, FinishReason::kCancelled);
  busy->cancel();
  busy->wait();
  EXPECT_EQ(engine.metrics().kv_blocks_used, 0);
}

TEST(EngineQueue, PromptScoresAreWholeWhenThePromptIsAlreadyCached) {
  testing::FakeVlm model;
  std::vector<int64_t> prompt;
  for (int k = 0; k < 70; ++k) prompt.push_back((k * 7 + 1) % 60);
  const auto config = GenerationConfig().max_new_tokens(3).prompt_logprobs(true);
  const GenerationResult alone = Generator(model).generate({{prompt}}, config);
  const std::vector<float>& expected = alone.sequences.at(0).prompt_logprobs;
  ASSERT_EQ(expected.size(), prompt.size());

  Engine engine(model, EngineOptions().prefix_block_columns(16));
  for (int round = 0; round < 2; ++round) {  // the second finds the prompt cached by the first
    const GenerationResult got = engine.submit(GenerateRequest({prompt}), config)->wait();
    const std::vector<float>& scores = got.sequences.at(0).prompt_logprobs;
    ASSERT_EQ(scores.size(), expected.size());
    for (size_t i = 1; i < scores.size(); ++i) {
      ASSERT_FALSE(std::isnan(scores[i])) << "round " << round << ", prompt token " << i;
      EXPECT_NEAR(scores[i], expected[i], 1e-9) << "round " << round << ", prompt token " << i;
    }
    EXPECT_EQ(got.sequences[0].tokens, alone.sequences[0].tokens);
  }
  // Its prompt was still cached for requests that do not ask for prompt scores.
  engine.submit(GenerateRequest({prompt}), GenerationConfig().max_new_tokens(3))->wait();
  EXPECT_EQ(engine.metrics().prefix_cache_hits, 1);
  EXPECT_EQ(engine.metrics().prefix_cache_hit_columns, 64);
}

TEST(EngineQueue, AMaxNewTokensPastTheColumnLimitIsRefusedAtSubmit) {
  testing::FakeVlm model;
  Engine engine(model, EngineOptions().max_running(4));
  const int64_t huge = std::numeric_limits<int64_t>::max();
  for (int64_t n : {huge, int64_t{1} << 62, GenerationConfig::kMaxSequenceColumns + 1, int64_t{-1}}) {
    try {
      GenerateRequest request(std::vector<std::vector<int64_t>>(32, std::vector<int64_t>{1, 2, 3}));
      engine.submit(request, GenerationConfig().max_new_tokens(n));
      FAIL() << "accepted max_new_tokens " << n;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("max_new_tokens must be in [0, 1048576]"));
    }
  }
  EXPECT_EQ(engine.metrics().kv_blocks_used, 0);
  EXPECT_EQ(
      engine.submit(GenerateRequest({{1, 2}}), GenerationConfig().max_new_tokens(2))->wait().sequences[0].tokens.size(),
      2u);  // still serving
}

}  // namespace
}  // namespace vlmgen
