// The replay rule end to end: which forward calls get the vision tensors, and what the
// generated tokens are, with and without a KV cache, under SP fallback and the legacy gate, in
// continuations, batches and with the encoder cache. Sampling, finishing, streaming and the
// rest of the decode loop are in generator_decoding_test.cpp.

#include "vlmgen/generator.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "generator_test_util.h"
#include "test_util.h"
#include "vlmgen/testing/fake_vlm.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using generator_test::kImage;
using generator_test::tokens_of;
using testing::FakeVlm;
using testing::FakeVlmOptions;
using testing::ForwardCall;
using testing::ForwardSpy;

struct ReplayFixture : ::testing::Test {
  FakeVlm model;
  ForwardSpy spy{model};
  Generator generator{spy};
  // One image of grid (1, 4, 4): 16 patch rows, 4 placeholders after the 2x2 merge.
  VisionInputs vision = test::make_images({{1, 4, 4}});
  std::vector<int64_t> prompt = test::prompt_with_image({3, 7, 9}, kImage, 4, {11, 12});

  GenerationResult run(const GenerationConfig& config, VisionInputs v = {}, std::vector<int64_t> p = {}) {
    spy.clear();
    GenerateRequest req;
    req.prompts = {p.empty() ? prompt : p};
    req.vision = v.empty() ? vision : v;
    return generator.generate(req, config);
  }
};

TEST_F(ReplayFixture, WithoutKvCacheEveryCallGetsAllThreeVisionTensors) {
  auto out = run(GenerationConfig().max_new_tokens(6).enable_kv_cache(false));
  ASSERT_EQ(out.sequences[0].tokens.size(), 6u);
  ASSERT_EQ(spy.calls().size(), 6u);
  const int64_t len = static_cast<int64_t>(prompt.size());
  for (const ForwardCall& c : spy.calls()) {
    EXPECT_FALSE(c.had_context);
    EXPECT_EQ(c.window_start, 0);
    EXPECT_EQ(c.window_end, len + c.step) << "each step recomputes the whole prefix";
    EXPECT_TRUE(c.has_all_vision()) << "step " << c.step;
    EXPECT_EQ(*c.pixel_values_shape, (std::vector<int64_t>{16, 12}));
    EXPECT_EQ(*c.image_grid_thw_shape, (std::vector<int64_t>{1, 3}));
    EXPECT_EQ(*c.image_sizes_shape, (std::vector<int64_t>{1, 2}));
    EXPECT_THAT(c.images, ::testing::ElementsAre(0));
  }
  EXPECT_FALSE(out.stats.used_kv_cache);
}

TEST_F(ReplayFixture, WithKvCacheOnlyThePrefillGetsVision) {
  auto out = run(GenerationConfig().max_new_tokens(6).enable_kv_cache(true));
  ASSERT_EQ(spy.calls().size(), 6u);
  EXPECT_TRUE(out.stats.used_kv_cache);
  const auto& prefill = spy.calls()[0];
  EXPECT_TRUE(prefill.had_context);
  EXPECT_EQ(prefill.window_start, 0);
  EXPECT_EQ(prefill.window_end, static_cast<int64_t>(prompt.size()));
  EXPECT_TRUE(prefill.has_all_vision());
  for (size_t i = 1; i < spy.calls().size(); ++i) {
    const auto& c = spy.calls()[i];
    EXPECT_TRUE(c.had_context);
    EXPECT_EQ(c.window_size(), 1) << "decode computes one column";
    EXPECT_FALSE(c.has_any_vision()) << "decode step " << c.step << " must not get the image again";
  }
}

TEST_F(ReplayFixture, KvCacheAndNoCacheGiveTheSameGreedyTokens) {
  auto cached = run(GenerationConfig().max_new_tokens(10).enable_kv_cache(true));
  auto recomputed = run(GenerationConfig().max_new_tokens(10).enable_kv_cache(false));
  EXPECT_EQ(tokens_of(cached), tokens_of(recomputed));
}

TEST_F(ReplayFixture, WithoutKvCacheThePromptLogitsAreStepInvariant) {
  spy.record_tensors(true);
  run(GenerationConfig().max_new_tokens(5).enable_kv_cache(false).full_logits(true));
  const int64_t len = static_cast<int64_t>(prompt.size());
  const at::Tensor step0 = spy.calls()[0].logits.narrow(1, 0, len);
  for (const auto& c : spy.calls()) {
    EXPECT_TRUE(at::equal(c.logits.narrow(1, 0, len), step0)) << "step " << c.step;
  }
}

TEST_F(ReplayFixture, LegacyStepZeroGateDropsTheImageAndChangesTheTokens) {
  spy.record_tensors(true);
  auto legacy = run(
      GenerationConfig().max_new_tokens(6).enable_kv_cache(false).replay_mode(ReplayMode::kStepZero).full_logits(true));
  ASSERT_EQ(spy.calls().size(), 6u);
  EXPECT_TRUE(spy.calls()[0].has_all_vision());
  const int64_t len = static_cast<int64_t>(prompt.size());
  const at::Tensor step0 = spy.calls()[0].logits.narrow(1, 0, len);
  for (size_t i = 1; i < spy.calls().size(); ++i) {
    EXPECT_FALSE(spy.calls()[i].has_any_vision()) << "the bug: step " << i << " runs without the image";
    EXPECT_FALSE(at::equal(spy.calls()[i].logits.narrow(1, 0, len), step0)) << "prompt logits drift at step " << i;
  }
  auto correct = run(GenerationConfig().max_new_tokens(6).enable_kv_cache(false));
  EXPECT_NE(tokens_of(legacy), tokens_of(correct));
  EXPECT_EQ(tokens_of(legacy)[0], tokens_of(correct)[0]) << "step 0 had the image in both";
}

TEST_F(ReplayFixture, LegacyStepZeroGateIsHarmlessOnlyWithAKvCache) {
  auto legacy = run(GenerationConfig().max_new_tokens(6).enable_kv_cache(true).replay_mode(ReplayMode::kStepZero));
  auto correct = run(GenerationConfig().max_new_tokens(6).enable_kv_cache(true));
  EXPECT_EQ(tokens_of(legacy), tokens_of(correct));
}

TEST_F(ReplayFixture, AlwaysModeWithoutCacheMatchesSpanAware) {
  auto always = run(GenerationConfig().max_new_tokens(5).enable_kv_cache(false).replay_mode(ReplayMode::kAlways));
  auto correct = run(GenerationConfig().max_new_tokens(5).enable_kv_cache(false));
  EXPECT_EQ(tokens_of(always), tokens_of(correct));
}

TEST(SequenceParallel, KvCacheRequestFallsBackAndReplaysVisionEveryStep) {
  FakeVlm model;  // cannot decode with a KV cache under SP
  ForwardSpy spy(model);
  std::vector<std::string> logged;
  auto previous = set_log_sink([&](LogLevel, const std::string& m) { logged.push_back(m); });
  Generator generator(spy, ParallelContext::single().sequence_parallel(true));
  auto vision = test::make_images({{1, 4, 4}});
  auto prompt = test::prompt_with_image({5}, kImage, 4, {6, 7});
  auto out = generator.generate({{prompt}, vision}, GenerationConfig().max_new_tokens(5).enable_kv_cache(true));
  generator.generate({{prompt}, vision}, GenerationConfig().max_new_tokens(2).enable_kv_cache(true));
  set_log_sink(previous);

  EXPECT_FALSE(out.stats.used_kv_cache);
  ASSERT_EQ(spy.calls().size(), 7u);
  for (const auto& c : spy.calls()) {
    EXPECT_FALSE(c.had_context);
    EXPECT_EQ(c.window_start, 0);
    EXPECT_TRUE(c.has_all_vision()) << "step " << c.step;
  }
  ASSERT_EQ(logged.size(), 1u) << "the fallback is logged once per generator";
  EXPECT_THAT(logged[0], ::testing::HasSubstr("sequence parallelism"));

  FakeVlm plain;
  auto reference =
      Generator(plain).generate({{prompt}, vision}, GenerationConfig().max_new_tokens(5).enable_kv_cache(false));
  EXPECT_EQ(tokens_of(out), tokens_of(reference));
}

TEST(SequenceParallel, ModelThatDecodesWithCacheUnderSpKeepsItsCache) {
  FakeVlmOptions opts;
  opts.kv_cache_under_sequence_parallel = true;
  FakeVlm model(opts);
  ForwardSpy spy(model);
  Generator generator(spy, ParallelContext::single().sequence_parallel(true));
  auto out = generator.generate({{test::prompt_with_image({5}, kImage, 4, {6})}, test::make_images({{1, 4, 4}})},
                                GenerationConfig().max_new_tokens(4));
  EXPECT_TRUE(out.stats.used_kv_cache);
  ASSERT_EQ(spy.calls().size(), 4u);
  EXPECT_TRUE(spy.calls()[0].has_all_vision());
  EXPECT_FALSE(spy.calls()[3].has_any_vision());
}

TEST(Continuation, CachedTextPrefixThenATurnWithAnImageGetsThatImage) {
  FakeVlm model;
  ForwardSpy spy(model);
  Generator generator(spy);
  const std::vector<int64_t> prefix = {1, 2, 3, 4, 5, 6};
  InferenceContext context(model.traits().kv_cache, 1, 64);
  // Cache the prefix: one forward call, the chosen token is not fed back.
  generator.generate({{prefix}, {}, &context}, GenerationConfig().max_new_tokens(1));
  ASSERT_EQ(context.length(), 6);

  spy.clear();
  auto turn = prefix;
  auto image_part = test::prompt_with_image({20}, kImage, 4, {21, 22});
  turn.insert(turn.end(), image_part.begin(), image_part.end());
  auto vision = test::make_images({{1, 4, 4}}, 7);
  auto out = generator.generate({{turn}, vision, &context}, GenerationConfig().max_new_tokens(4));

  ASSERT_EQ(spy.calls().size(), 4u);
  const auto& first = spy.calls()[0];
  EXPECT_EQ(first.window_start, 6) << "the cached prefix is not recomputed";
  EXPECT_EQ(first.window_end, static_cast<int64_t>(turn.size()));
  EXPECT_TRUE(first.has_all_vision()) << "the image arrives at a non-zero position and must be sent";
  for (size_t i = 1; i < spy.calls().size(); ++i) EXPECT_FALSE(spy.calls()[i].has_any_vision());

  FakeVlm fresh;
  auto reference =
      Generator(fresh).generate({{turn}, vision}, GenerationConfig().max_new_tokens(4).enable_kv_cache(false));
  EXPECT_EQ(tokens_of(out), tokens_of(reference));
}

TEST(Continuation, OnlyTheNewTurnsImagesAreSentSlicedFromTheBundle) {
  FakeVlm model;
  ForwardSpy spy(model);
  spy.record_tensors(true);
  Generator generator(spy);
  // Turn 1: an image of grid (1, 2, 4) (2 placeholders); turn 2: an image of grid (1, 4, 4).
  auto turn1 = test::prompt_with_image({1, 2}, kImage, 2, {3});
  auto vision = test::make_images({{1, 2, 4}, {1, 4, 4}}, 3);
  InferenceContext context(model.traits().kv_cache, 1, 64);
  generator.generate({{turn1}, vision.select({0}), &context}, GenerationConfig().max_new_tokens(1));
  ASSERT_EQ(context.length(), static_cast<int64_t>(turn1.size()));

  spy.clear();
  auto turn2 = turn1;
  auto more = test::prompt_with_image({4}, kImage, 4, {5, 6});
  turn2.insert(turn2.end(), more.begin(), more.end());
  auto out = generator.generate({{turn2}, vision, &context}, GenerationConfig().max_new_tokens(3));

  const auto& first = spy.calls().at(0);
  EXPECT_THAT(first.images, ::testing::ElementsAre(1));
  EXPECT_EQ(*first.pixel_values_shape, (std::vector<int64_t>{16, 12})) << "image 1's rows only";
  EXPECT_TRUE(at::equal(first.image_grid_thw, vision.image_grid_thw.narrow(0, 1, 1)));
  EXPECT_EQ(*first.image_sizes_shape, (std::vector<int64_t>{1, 2}));
  for (size_t i = 1; i < spy.calls().size(); ++i) EXPECT_FALSE(spy.calls()[i].has_any_vision());

  FakeVlm fresh;
  auto reference =
      Generator(fresh).generate({{turn2}, vision}, GenerationConfig().max_new_tokens(3).enable_kv_cache(false));
  EXPECT_EQ(tokens_of(out), tokens_of(reference));
}

TEST(Batching, OnlyOneRowHasImagesAndEachCallGetsTheImagesInItsWindow) {
  FakeVlm model;
  ForwardSpy spy(model);
  spy.record_tensors(true);
  Generator generator(spy);
  // Row 0: text only. Row 1: two images, grids (1,2,4) -> 2 tokens and (1,4,4) -> 4 tokens.
  std::vector<int64_t> row0 = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14};
  auto row1 = test::prompt_with_image({1}, kImage, 2, {2, 3, 4});
  row1.insert(row1.end(), 4, kImage);
  row1.push_back(5);  // row1: 1 P P 2 3 4 P P P P 5  (11 tokens, left-padded by 3)
  auto vision = test::make_images({{1, 2, 4}, {1, 4, 4}}, 11);

  // Chunked prefill of 5 columns: [0,5) holds image 0 at columns [4,6) -> moved to [0,4).
  auto chunked = generator.generate({{row0, row1}, vision}, GenerationConfig().max_new_tokens(3).prefill_chunk_size(5));
  std::vector<std::vector<int64_t>> sent;
  for (const auto& c : spy.calls()) {
    if (c.step == 0) sent.push_back(c.images);
  }
  ASSERT_GE(sent.size(), 3u);
  for (const auto& c : spy.calls()) {
    if (c.images.empty()) {
      EXPECT_FALSE(c.has_any_vision());
      continue;
    }
    int64_t rows = 0;
    for (int64_t i : c.images) rows += (i == 0 ? 8 : 16);
    EXPECT_EQ((*c.pixel_values_shape)[0], rows) << "call " << c.index;
    EXPECT_TRUE(at::equal(c.image_grid_thw, vision.image_grid_thw.index_select(0, at::tensor(c.images))));
  }
  std::vector<int64_t> all_sent;
  for (const auto& s : sent) all_sent.insert(all_sent.end(), s.begin(), s.end());
  EXPECT_THAT(all_sent, ::testing::ElementsAre(0, 1)) << "each image exactly once over the prefill chunks";
  for (const auto& c : spy.calls()) {
    if (c.step == 0) {
      EXPECT_LE(c.window_size(), 5) << "chunk " << c.index;
    }
  }

  auto whole = generator.generate({{row0, row1}, vision}, GenerationConfig().max_new_tokens(3));
  auto nocache =
      generator.generate({{row0, row1}, vision}, GenerationConfig().max_new_tokens(3).enable_kv_cache(false));
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(tokens_of(chunked, r), tokens_of(whole, r));
    EXPECT_EQ(tokens_of(nocache, r), tokens_of(whole, r));
  }
}

TEST(Batching, RaggedRowsGetTheSameTokensAsAlone) {
  FakeVlm model;
  Generator generator(model);
  auto row0 = test::prompt_with_image({4, 5}, kImage, 4, {6, 7, 8, 9, 10});
  auto row1 = test::prompt_with_image({}, kImage, 2, {12});
  auto img0 = test::make_images({{1, 4, 4}}, 21);
  auto img1 = test::make_images({{1, 2, 4}}, 22);
  auto both = VisionInputs::patch_flattened(at::cat({img0.pixel_values, img1.pixel_values}),
                                            at::cat({img0.image_grid_thw, img1.image_grid_thw}),
                                            at::cat({img0.image_sizes, img1.image_sizes}));
  for (bool kv : {true, false}) {
    auto config = GenerationConfig().max_new_tokens(8).enable_kv_cache(kv);
    auto batched = generator.generate({{row0, row1}, both}, config);
    auto alone0 = generator.generate({{row0}, img0}, config);
    auto alone1 = generator.generate({{row1}, img1}, config);
    EXPECT_EQ(tokens_of(batched, 0), tokens_of(alone0)) << "kv " << kv;
    EXPECT_EQ(tokens_of(batched, 1), tokens_of(alone1)) << "kv " << kv;
  }
}

TEST(EncoderCache, VisionTowerRunsOncePerImageAndTokensMatchPixelReplay) {
  FakeVlmOptions opts;
  opts.can_encode_images = true;
  FakeVlm model(opts);
  ForwardSpy spy(model);
  Generator generator(spy);
  auto vision = test::make_images({{1, 2, 4}, {1, 4, 4}}, 5);
  auto prompt = test::prompt_with_image({1}, kImage, 2, {2});
  prompt.insert(prompt.end(), 4, kImage);
  prompt.push_back(3);
  auto config = GenerationConfig().max_new_tokens(6).enable_kv_cache(false);
  auto cached = generator.generate({{prompt}, vision}, config);
  EXPECT_EQ(model.vision_tower_runs(), 1) << "one encode call for both images";
  EXPECT_EQ(cached.stats.images_encoded, 2);
  for (const auto& c : spy.calls()) {
    ASSERT_TRUE(c.image_embeddings_shape.has_value()) << "step " << c.step;
    EXPECT_EQ((*c.image_embeddings_shape)[0], 6);
  }
  auto replayed = generator.generate({{prompt}, vision}, GenerationConfig(config).encoder_cache(false));
  EXPECT_EQ(model.vision_tower_runs(), 1 + 6) << "pixel replay runs the tower at every step";
  EXPECT_EQ(tokens_of(cached), tokens_of(replayed));
}

}  // namespace
}  // namespace vlmgen
