// Bad input gets a vlmgen::Error naming the numbers, and the same Generator (and context)
// works on the next call.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "test_util.h"
#include "vlmgen/generator.h"
#include "vlmgen/testing/fake_vlm.h"

namespace vlmgen {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using testing::FakeVlm;
using testing::FakeVlmOptions;

constexpr int64_t kImage = 63;

/// Runs `bad`, expects a vlmgen::Error whose message contains every string in `parts`.
template <typename F>
void expect_error(F&& bad, const std::vector<std::string>& parts) {
  try {
    bad();
    ADD_FAILURE() << "expected vlmgen::Error";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_THAT(e.what(), HasSubstr(p));
  }
}

struct ErrorFixture : ::testing::Test {
  FakeVlm model;
  Generator generator{model};
  std::vector<int64_t> prompt = test::prompt_with_image({3, 7}, kImage, 4, {11});
  VisionInputs vision = test::make_images({{1, 4, 4}});
  std::vector<int64_t> expected;

  void SetUp() override { expected = good(); }
  std::vector<int64_t> good() {
    return generator.generate({{prompt}, vision}, GenerationConfig().max_new_tokens(4)).sequences[0].tokens;
  }
  void TearDown() override { EXPECT_EQ(good(), expected) << "the generator must stay usable"; }
};

TEST_F(ErrorFixture, PlaceholderCountDisagreesWithTheBundle) {
  auto short_prompt = test::prompt_with_image({3, 7}, kImage, 3, {11});
  expect_error([&] { generator.generate({{short_prompt}, vision}); }, {"3 image placeholder", "need 4"});
  expect_error([&] { generator.generate({{prompt}}); }, {"4 image placeholder", "0 images need 0"});
}

TEST_F(ErrorFixture, GridNotDivisibleByTheMergeSize) {
  auto bad = test::make_images({{1, 3, 4}});
  expect_error([&] { generator.generate({{prompt}, bad}); }, {"(1, 3, 4)", "spatial_merge_size 2"});
}

TEST_F(ErrorFixture, PixelRowsDisagreeWithTheGrid) {
  auto bad = vision;
  bad.pixel_values = vision.pixel_values.narrow(0, 0, 15);
  expect_error([&] { generator.generate({{prompt}, bad}); }, {"15 rows", "needs 16"});
}

TEST_F(ErrorFixture, ImageSizesRowsDisagreeWithTheImages) {
  auto bad = vision;
  bad.image_sizes = at::ones({2, 2}, at::kLong);
  expect_error([&] { generator.generate({{prompt}, bad}); }, {"image_sizes has 2 rows", "1 images"});
}

TEST_F(ErrorFixture, VisionTensorsForAModelWithoutAnImageToken) {
  FakeVlmOptions opts;
  opts.image_token_id = std::nullopt;
  FakeVlm text_only(opts);
  Generator g(text_only);
  expect_error([&] { g.generate({{{1, 2, 3}}, vision}); }, {"1 images", "no image token id"});
  EXPECT_EQ(g.generate({{{1, 2, 3}}}, GenerationConfig().max_new_tokens(2)).sequences[0].tokens.size(), 2u);
}

TEST_F(ErrorFixture, NegativeMaxNewTokens) {
  expect_error([&] { generator.generate({{prompt}, vision}, GenerationConfig().max_new_tokens(-3)); },
               {"max_new_tokens", "-3"});
}

TEST_F(ErrorFixture, PromptPlusNewTokensAboveTheCacheCapacity) {
  InferenceContext small(model.traits().kv_cache, 1, 8);
  expect_error([&] { generator.generate({{prompt}, vision, &small}, GenerationConfig().max_new_tokens(5)); },
               {"7 columns", "max_new_tokens 5", "needs 11", "capacity 8"});
  EXPECT_EQ(small.length(), 0) << "nothing was written to the context";
  // The same context works for a request that fits.
  auto out = generator.generate({{prompt}, vision, &small}, GenerationConfig().max_new_tokens(2));
  EXPECT_EQ(out.sequences[0].tokens, std::vector<int64_t>(expected.begin(), expected.begin() + 2));

  FakeVlmOptions opts;
  opts.max_sequence_length = 9;
  FakeVlm short_model(opts);
  expect_error([&] { Generator(short_model).generate({{prompt}, vision}, GenerationConfig().max_new_tokens(3)); },
               {"= 10", "maximum sequence length 9"});
}

TEST_F(ErrorFixture, EmptyBatchAndEmptyPrompt) {
  expect_error([&] { generator.generate(GenerateRequest{}); }, {"batch is empty"});
  expect_error([&] { generator.generate({{prompt, {}}, vision}); }, {"prompt 1 is empty"});
}

TEST_F(ErrorFixture, TokenOutsideTheVocabulary) {
  expect_error([&] { generator.generate({{{1, 64, 2}}}); }, {"prompt 0 token 1 is 64", "[0, 64)"});
  expect_error([&] { generator.generate({{{1, 2}, {-1}}}); }, {"prompt 1 token 0 is -1"});
  expect_error([&] { generator.generate({{{1, 2}}}, GenerationConfig().end_token_ids({70})); }, {"end token id 70"});
}

TEST_F(ErrorFixture, BadSamplingOptions) {
  expect_error([&] { generator.generate({{{1}}}, GenerationConfig().temperature(-1)); }, {"temperature", "-1"});
  expect_error([&] { generator.generate({{{1}}}, GenerationConfig().top_p(0)); }, {"top_p", "0"});
  expect_error([&] { generator.generate({{{1}}}, GenerationConfig().top_k(-2)); }, {"top_k", "-2"});
  expect_error([&] { generator.generate({{{1}}}, GenerationConfig().temperature(1).row_seeds({1, 2})); },
               {"row_seeds has 2 entries", "batch of 1"});
}

TEST_F(ErrorFixture, ContinuationThatDoesNotRepeatTheCachedPrefix) {
  InferenceContext context(model.traits().kv_cache, 1, 32);
  generator.generate({{{1, 2, 3, 4}}, {}, &context}, GenerationConfig().max_new_tokens(1));
  ASSERT_EQ(context.length(), 4);
  expect_error([&] { generator.generate({{{1, 2, 9, 4, 5}}, {}, &context}); },
               {"row 0 column 2", "cached token 3", "prompt token 9"});
  expect_error([&] { generator.generate({{{1, 2, 3, 4}}, {}, &context}); }, {"already holds 4 columns"});
  EXPECT_EQ(context.length(), 4) << "a refused request leaves the context as it was";
  auto out = generator.generate({{{1, 2, 3, 4, 5}}, {}, &context}, GenerationConfig().max_new_tokens(2));
  FakeVlm fresh;
  EXPECT_EQ(out.sequences[0].tokens,
            Generator(fresh).generate({{{1, 2, 3, 4, 5}}}, GenerationConfig().max_new_tokens(2)).sequences[0].tokens);
}

TEST_F(ErrorFixture, CachedPrefixThatEndsInsideAnImage) {
  InferenceContext context(model.traits().kv_cache, 1, 32);
  // Cache "3 7 P P" (half of the image), then ask for the whole prompt.
  generator.generate({{{3, 7, kImage, kImage}}, test::make_images({{1, 2, 4}}), &context},
                     GenerationConfig().max_new_tokens(1));
  expect_error([&] { generator.generate({{prompt}, vision, &context}); }, {"image 0", "[2, 6)", "[4, 7)"});
}

TEST_F(ErrorFixture, ContextGivenWithTheCacheDisabled) {
  InferenceContext context(model.traits().kv_cache, 1, 32);
  expect_error([&] { generator.generate({{prompt}, vision, &context}, GenerationConfig().enable_kv_cache(false)); },
               {"enable_kv_cache is false"});
}

TEST_F(ErrorFixture, ModelReturningLogitsOfTheWrongShape) {
  struct Broken : testing::FakeVlm {
    at::Tensor forward(const ForwardArgs& args) override { return FakeVlm::forward(args).narrow(1, 0, 1); }
  } broken;
  expect_error([&] { Generator(broken).generate({{{1, 2, 3}}}); }, {"[1, 1, 64]", "[1, 3, >= 64]"});
}

TEST_F(ErrorFixture, ModelThrowingMidGenerationLeavesAUsableContext) {
  struct Flaky : testing::FakeVlm {
    int calls = 0;
    at::Tensor forward(const ForwardArgs& args) override {
      if (++calls == 3) VLMGEN_FAIL("flaky model: call {}", calls);
      return FakeVlm::forward(args);
    }
  } flaky;
  Generator g(flaky);
  InferenceContext context(flaky.traits().kv_cache, 1, 32);
  expect_error([&] { g.generate({{{1, 2, 3}}, {}, &context}, GenerationConfig().max_new_tokens(5)); },
               {"flaky model: call 3"});
  EXPECT_EQ(context.length(), 4) << "prefill + one decode call were committed, the failed call was not";
}

}  // namespace
}  // namespace vlmgen
