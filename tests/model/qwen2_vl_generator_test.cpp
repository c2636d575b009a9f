// Qwen2-VL through the generator: KV cache against none, per-step logits, the encoder cache,
// batches against rows alone, and the no-cache replay of the prompt.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "qwen2_vl_test_util.h"
#include "qwen_test_util.h"
#include "vlmgen/generator.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/models/qwen2_vl.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)
using qwen2_vl_test::kCacheTolerance;
using qwen2_vl_test::kReplayTolerance;

// ---------------------------------------------------------------------------------------------
// Through the generator

class Qwen2VlGeneratorTest : public ::testing::Test {
 protected:
  QwenVlConfig config_ = test_config();
  Qwen2Vl model_{config_, 13};
  VisionInputs vision_ = make_vision(config_, {{1, 4, 4}, {1, 4, 8}}, 81);
  std::vector<std::vector<int64_t>> prompts_ = {image_prompt({1, 2, 3, 4, 5}, 4, {6, 7}),
                                                image_prompt({9}, 8, {10, 11, 12})};
};

TEST_F(Qwen2VlGeneratorTest, GreedyTokensWithKvCacheEqualTokensWithout) {
  Generator generator(model_);
  GenerateRequest request = make_request(prompts_, vision_);
  auto with_cache = generator.generate(request, GenerationConfig().max_new_tokens(8).enable_kv_cache(true));
  auto without = generator.generate(request, GenerationConfig().max_new_tokens(8).enable_kv_cache(false));
  ASSERT_TRUE(with_cache.stats.used_kv_cache);
  ASSERT_FALSE(without.stats.used_kv_cache);
  for (size_t r = 0; r < prompts_.size(); ++r) {
    EXPECT_EQ(with_cache.sequences[r].tokens.size(), 8u);
    EXPECT_EQ(with_cache.sequences[r].tokens, without.sequences[r].tokens) << "row " << r;
  }
  // The generator's own context vs a caller's: same tokens.
  InferenceContext ctx(model_.traits().kv_cache, 2, 64);
  GenerateRequest with_context = make_request(prompts_, vision_, &ctx);
  auto own = generator.generate(with_context, GenerationConfig().max_new_tokens(8));
  for (size_t r = 0; r < prompts_.size(); ++r) EXPECT_EQ(own.sequences[r].tokens, with_cache.sequences[r].tokens);
}

TEST_F(Qwen2VlGeneratorTest, PerStepLogitsWithKvCacheAgreeWithNoCache) {
  // The last column's logits of every step, both ways, for 10 new tokens.
  auto last_logits = [&](bool kv) {
    testing::ForwardSpy spy(model_);
    spy.record_tensors(true);
    auto out = Generator(spy).generate(make_request(prompts_, vision_),
                                       GenerationConfig().max_new_tokens(10).enable_kv_cache(kv));
    std::vector<at::Tensor> steps;
    for (const auto& call : spy.calls()) steps.push_back(call.logits.select(1, -1));
    return std::make_pair(out, steps);
  };
  auto [cached, cached_logits] = last_logits(true);
  auto [recomputed, recomputed_logits] = last_logits(false);
  ASSERT_EQ(cached_logits.size(), 10u);
  ASSERT_EQ(recomputed_logits.size(), 10u);
  double worst = 0.0;
  for (size_t i = 0; i < cached_logits.size(); ++i) {
    worst = std::max(worst, max_abs_diff(cached_logits[i], recomputed_logits[i]));
  }
  report("generator per-step logits, KV cache vs no cache, max|diff| over 10 steps", worst);
  EXPECT_LE(worst, kCacheTolerance);
  for (size_t r = 0; r < prompts_.size(); ++r) EXPECT_EQ(cached.sequences[r].tokens, recomputed.sequences[r].tokens);
}

TEST_F(Qwen2VlGeneratorTest, OnlyTheLastColumnsLogitsAreComputedUnlessAsked) {
  testing::ForwardSpy spy(model_);
  spy.record_tensors(true);
  auto lean = Generator(spy).generate(make_request(prompts_, vision_), GenerationConfig().max_new_tokens(4));
  ASSERT_EQ(spy.calls().size(), 4u);
  EXPECT_EQ(spy.calls()[0].logits.size(1), 1) << "the prefill returns one column, not the whole prompt";
  const at::Tensor lean_first = spy.calls()[0].logits.select(1, 0);
  spy.clear();
  auto full =
      Generator(spy).generate(make_request(prompts_, vision_), GenerationConfig().max_new_tokens(4).full_logits(true));
  EXPECT_EQ(spy.calls()[0].logits.size(1), static_cast<int64_t>(left_pad(prompts_).ids.size(1)));
  EXPECT_LE(max_abs_diff(spy.calls()[0].logits.select(1, -1), lean_first), kCacheTolerance);
  for (size_t r = 0; r < prompts_.size(); ++r) EXPECT_EQ(lean.sequences[r].tokens, full.sequences[r].tokens);
}

TEST_F(Qwen2VlGeneratorTest, EncoderCacheRunsTheTowerOncePerRequest) {
  Generator generator(model_);
  auto cached =
      generator.generate(make_request(prompts_, vision_), GenerationConfig().max_new_tokens(4).enable_kv_cache(false));
  EXPECT_EQ(model_.vision_tower_calls(), 1);
  EXPECT_EQ(cached.stats.images_encoded, 2) << "each image once";
  auto replayed = generator.generate(make_request(prompts_, vision_),
                                     GenerationConfig().max_new_tokens(4).enable_kv_cache(false).encoder_cache(false));
  EXPECT_EQ(model_.vision_tower_calls(), 1 + 4) << "without the encoder cache every no-cache step reruns it";
  for (size_t r = 0; r < prompts_.size(); ++r) EXPECT_EQ(cached.sequences[r].tokens, replayed.sequences[r].tokens);
}

TEST_F(Qwen2VlGeneratorTest, SuccessiveCallsWithDifferentImagesMatchFreshRuns) {
  // Same prompt shape, different pictures (and grids): no rope delta or encoder state may leak
  // from one call into the next.
  const VisionInputs first = make_vision(config_, {{1, 4, 4}}, 5);
  const VisionInputs second = make_vision(config_, {{1, 4, 8}}, 6);
  const auto prompt_a = image_prompt({1, 2}, 4, {3});
  const auto prompt_b = image_prompt({1, 2}, 8, {3});
  for (bool kv : {true, false}) {
    const auto config = GenerationConfig().max_new_tokens(8).enable_kv_cache(kv);
    Generator shared(model_);
    auto a = shared.generate(make_request({prompt_a}, first), config);
    auto b = shared.generate(make_request({prompt_b}, second), config);
    auto a_again = shared.generate(make_request({prompt_a}, first), config);
    Qwen2Vl fresh_model(config_, 13);
    auto fresh_b = Generator(fresh_model).generate(make_request({prompt_b}, second), config);
    EXPECT_EQ(b.sequences[0].tokens, fresh_b.sequences[0].tokens) << "kv " << kv;
    EXPECT_EQ(a.sequences[0].tokens, a_again.sequences[0].tokens) << "kv " << kv;
    EXPECT_NE(a.sequences[0].tokens, b.sequences[0].tokens) << "the pictures should matter";
  }
}

TEST_F(Qwen2VlGeneratorTest, BatchRowsWithDifferentImagesAndLengthsMatchRowsAlone) {
  for (bool kv : {true, false}) {
    const auto config = GenerationConfig().max_new_tokens(8).enable_kv_cache(kv);
    Generator generator(model_);
    auto batched = generator.generate(make_request(prompts_, vision_), config);
    for (int64_t r = 0; r < 2; ++r) {
      auto alone = generator.generate(make_request({prompts_[r]}, vision_.select({r})), config);
      EXPECT_EQ(batched.sequences[r].tokens, alone.sequences[0].tokens) << "row " << r << " kv " << kv;
    }
  }
}

TEST_F(Qwen2VlGeneratorTest, NoCachePromptLogitsAreStepInvariant) {
  double agreement = 0.0;
  const double span_aware = prompt_logit_drift(model_, prompts_, vision_, ReplayMode::kSpanAware, &agreement);
  report("no-cache prompt logits, step k vs step 0 (span-aware) max|diff|", span_aware);
  report("no-cache prompt argmax agreement, worst step (span-aware)", agreement);
  EXPECT_LE(span_aware, kReplayTolerance);
  EXPECT_EQ(agreement, 1.0);
}

TEST_F(Qwen2VlGeneratorTest, StepZeroReplayDropsTheImageFromLaterSteps) {
  double agreement = 1.0;
  const double step_zero = prompt_logit_drift(model_, prompts_, vision_, ReplayMode::kStepZero, &agreement);
  report("no-cache prompt logits, step k vs step 0 (legacy step-zero) max|diff|", step_zero);
  report("no-cache prompt argmax agreement, worst step (legacy step-zero)", agreement);
  EXPECT_GT(step_zero, 1e-3);
  EXPECT_LT(agreement, 1.0) << "without the image the prompt's argmax tokens must change somewhere";
}

}  // namespace
}  // namespace vlmgen
