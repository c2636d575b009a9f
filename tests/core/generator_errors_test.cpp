// Bad input gets a vlmgen::Error naming the numbers, and the same Generator (and context)
// works on the next call.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"
#include "vlmgen/generator.h"
#include "vlmgen/testing/fake_vlm.h"

namespace vlmgen {
namespace {

using ::testing::AllOf;
using testing::FakeVlm;
using testing::FakeVlmOptions;
using ::testing::HasSubstr;

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
  // A caller's context holding the text prefix "3 7": the state a failed call could corrupt.
  InferenceContext cached{model.traits().kv_cache, 1, 32};

  void SetUp() override {
    generator.generate({{{3, 7}}, {}, &cached}, GenerationConfig().max_new_tokens(0));
    expected = good();
  }
  /// A continuation of the cached prefix, which is kept for the next one.
  std::vector<int64_t> good() {
    auto out = generator.generate({{prompt}, vision, &cached}, GenerationConfig().max_new_tokens(4));
    cached.truncate(2);
    return out.sequences[0].tokens;
  }
  void TearDown() override {
    ASSERT_EQ(cached.length(), 2) << "a failed call must leave a caller's context as it was";
    EXPECT_EQ(good(), expected) << "the generator and the context must stay usable";
    FakeVlm fresh;
    EXPECT_EQ(expected,
              Generator(fresh).generate({{prompt}, vision}, GenerationConfig().max_new_tokens(4)).sequences[0].tokens)
        << "the continuation equals a one-shot run";
  }
};

TEST_F(ErrorFixture, PlaceholderCountDisagreesWithTheBundle) {
  auto short_prompt = test::prompt_with_image({3, 7}, kImage, 3, {11});
  expect_error([&] { generator.generate({{short_prompt}, vision, &cached}); }, {"3 image placeholder", "need 4"});
  expect_error([&] { generator.generate({{prompt}}); }, {"4 image placeholder", "0 images need 0"});
}

TEST_F(ErrorFixture, GridNotDivisibleByTheMergeSize) {
  auto bad = test::make_images({{1, 3, 4}});
  expect_error([&] { generator.generate({{prompt}, bad, &cached}); }, {"(1, 3, 4)", "spatial_merge_size 2"});
}

TEST_F(ErrorFixture, PixelRowsDisagreeWithTheGrid) {
  auto bad = vision;
  bad.pixel_values = vision.pixel_values.narrow(0, 0, 15);
  expect_error([&] { generator.generate({{prompt}, bad, &cached}); }, {"15 rows", "needs 16"});
}

TEST_F(ErrorFixture, ImageSizesRowsDisagreeWithTheImages) {
  auto bad = vision;
  bad.image_sizes = at::ones({2, 2}, at::kLong);
  expect_error([&] { generator.generate({{prompt}, bad, &cached}); }, {"image_sizes has 2 rows", "1 images"});
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
  expect_error(
      [&] {
        generator.generate({{prompt}, vision}, GenerationConfig().max_new_tokens(-3));
      },
      {"max_new_tokens", "-3"});
}

TEST_F(ErrorFixture, PromptPlusNewTokensAboveTheCacheCapacity) {
  InferenceContext small(model.traits().kv_cache, 1, 8);
  expect_error(
      [&] {
        generator.generate({{prompt}, vision, &small}, GenerationConfig().max_new_tokens(5));
      },
      {"7 columns", "max_new_tokens 5", "needs 11", "capacity 8"});
  EXPECT_EQ(small.length(), 0) << "nothing was written to the context";
  // The same context works for a request that fits.
  auto out = generator.generate({{prompt}, vision, &small}, GenerationConfig().max_new_tokens(2));
  EXPECT_EQ(out.sequences[0].tokens, std::vector<int64_t>(expected.begin(), expected.begin() + 2));

  FakeVlmOptions opts;
  opts.max_sequence_length = 9;
  FakeVlm short_model(opts);
  expect_error(
      [&] {
        Generator(short_model).generate({{prompt}, vision}, GenerationConfig().max_new_tokens(3));
      },
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
  expect_error(
      [&] {
        generator.generate({{{1}}}, GenerationConfig().temperature(1).row_seeds({1, 2}));
      },
      {"row_seeds has 2 entries", "batch of 1"});
}

TEST_F(ErrorFixture, ContinuationThatDoesNotRepeatTheCachedPrefix) {
  InferenceContext context(model.traits().kv_cache, 1, 32);
  generator.generate({{{1, 2, 3, 4}}, {}, &context}, GenerationConfig().max_new_tokens(1));
  ASSERT_EQ(context.length(), 4);
  expect_error(
      [&] {
        generator.generate({{{1, 2, 9, 4, 5}}, {}, &context});
      },
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
  generator.generate({{prompt}, vision, &context}, GenerationConfig().max_new_tokens(1));
  context.truncate(4);  // keep "3 7 P P": half of the image, which the context then forgets
  EXPECT_TRUE(context.cached_images().empty());
  expect_error([&] { generator.generate({{prompt}, vision, &context}); }, {"image 0", "[2, 6)", "[4, 7)"});
  EXPECT_EQ(context.length(), 4);
}

TEST_F(ErrorFixture, ContinuationMustBringTheCachedImage) {
  // Cache "3 7 <image A> 11", then continue with the same tokens and a different picture of the
  // same grid: token ids alone cannot tell, the image fingerprints can.
  InferenceContext context(model.traits().kv_cache, 1, 32);
  generator.generate({{prompt}, vision, &context}, GenerationConfig().max_new_tokens(1));
  auto longer = prompt;
  longer.push_back(12);
  auto other_picture = test::make_images({{1, 4, 4}}, 99);
  expect_error(
      [&] {
        generator.generate({{longer}, other_picture, &context});
      },
      {"image 0 (row 0 columns [2, 6)) is not the picture cached there"});
  EXPECT_EQ(context.length(), 7);
  // The cached picture itself continues, and gives what a fresh run gives.
  auto out = generator.generate({{longer}, vision, &context}, GenerationConfig().max_new_tokens(3));
  FakeVlm fresh;
  EXPECT_EQ(out.sequences[0].tokens,
            Generator(fresh).generate({{longer}, vision}, GenerationConfig().max_new_tokens(3)).sequences[0].tokens);
  // A text-only context cannot stand for placeholders cached without pixels.
  InferenceContext text_context(model.traits().kv_cache, 1, 32);
  auto plain = prompt;
  std::replace(plain.begin(), plain.end(), kImage, int64_t{5});
  generator.generate({{plain}, {}, &text_context}, GenerationConfig().max_new_tokens(1));
  expect_error([&] { generator.generate({{longer}, vision, &text_context}); }, {"differ from the prompt"});
}

TEST_F(ErrorFixture, ContextOnAnotherDtypeOrWithAnotherShape) {
  KvCacheSpec wrong = model.traits().kv_cache;
  wrong.dtype = at::kFloat;
  InferenceContext context(wrong, 1, 32);
  expect_error([&] { generator.generate({{prompt}, vision, &context}); }, {"stores Float", "needs Long"});
  KvCacheSpec heads = model.traits().kv_cache;
  heads.num_kv_heads = 2;
  InferenceContext other(heads, 1, 32);
  expect_error([&] { generator.generate({{prompt}, vision, &other}); }, {"kv_heads=2", "1 / 1"});
}

TEST_F(ErrorFixture, PadTokenThatIsThePlaceholder) {
  expect_error(
      [&] {
        generator.generate({{prompt, {1, 2}}, vision}, GenerationConfig().pad_token_id(kImage));
      },
      {"pad_token_id 63", "placeholder"});
}

TEST_F(ErrorFixture, AlwaysModeWithAKvCache) {
  expect_error(
      [&] {
        generator.generate({{prompt}, vision}, GenerationConfig().replay_mode(ReplayMode::kAlways));
      },
      {"'always'", "KV-cache"});
}

TEST_F(ErrorFixture, MaxNewTokensBeyondAnySequence) {
  expect_error(
      [&] {
        generator.generate({{prompt}, vision}, GenerationConfig().max_new_tokens(std::numeric_limits<int64_t>::max()));
      },
      {"exceeds the limit of 1048576 columns"});
  // Far beyond memory but far from overflow: refused before anything is allocated.
  expect_error(
      [&] {
        generator.generate({{prompt}, vision}, GenerationConfig().max_new_tokens((int64_t{1} << 40) - 100));
      },
      {"max_new_tokens 1099511627676", "kMaxSequenceColumns"});
}

TEST_F(ErrorFixture, ContextGivenWithTheCacheDisabled) {
  InferenceContext context(model.traits().kv_cache, 1, 32);
  expect_error(
      [&] {
        generator.generate({{prompt}, vision, &context}, GenerationConfig().enable_kv_cache(false));
      },
      {"enable_kv_cache is false"});
}

TEST_F(ErrorFixture, ModelReturningLogitsOfTheWrongShape) {
  struct Broken : testing::FakeVlm {
    at::Tensor forward(const ForwardArgs& args) override { return FakeVlm::forward(args).narrow(1, 0, 1); }
  } broken;
  // One column is fine when only the last is asked for, not when every column is.
  expect_error(
      [&] {
        Generator(broken).generate({{{1, 2, 3}}}, GenerationConfig().full_logits(true));
      },
      {"[1, 1, 64]", "[1, 3, >= 64]"});
  EXPECT_EQ(Generator(broken).generate({{{1, 2, 3}}}, GenerationConfig().max_new_tokens(2)).sequences[0].tokens.size(),
            2u);
  struct TwoColumns : testing::FakeVlm {
    at::Tensor forward(const ForwardArgs& args) override {
      return at::cat({FakeVlm::forward(args), FakeVlm::forward(args)}, 1).narrow(1, 0, 2);
    }
  } two;
  expect_error([&] { Generator(two).generate({{{1, 2, 3}}}); }, {"[1, 2, 64]", "[1, 3, >= 64]"});
}

TEST_F(ErrorFixture, ModelThrowingMidGenerationLeavesTheContextAsItWas) {
  struct Flaky : testing::FakeVlm {
    int calls = 0;
    at::Tensor forward(const ForwardArgs& args) override {
      if (++calls == 3) VLMGEN_FAIL("flaky model: call {}", calls);
      return FakeVlm::forward(args);
    }
  } flaky;
  Generator g(flaky);
  InferenceContext context(flaky.traits().kv_cache, 1, 32);
  g.generate({{{1, 2}}, {}, &context}, GenerationConfig().max_new_tokens(1));
  ASSERT_EQ(context.length(), 2);
  expect_error(
      [&] {
        g.generate({{{1, 2, 3}}, {}, &context}, GenerationConfig().max_new_tokens(5));
      },
      {"flaky model: call 3"});
  EXPECT_EQ(context.length(), 2) << "the failed call's prefill and decode columns are rolled back";
  // The same request succeeds on retry and matches a fresh run.
  auto retry = g.generate({{{1, 2, 3}}, {}, &context}, GenerationConfig().max_new_tokens(5));
  FakeVlm fresh;
  EXPECT_EQ(retry.sequences[0].tokens,
            Generator(fresh).generate({{{1, 2, 3}}}, GenerationConfig().max_new_tokens(5)).sequences[0].tokens);
  // A throwing streaming callback rolls back too.
  context.truncate(2);
  expect_error(
      [&] {
        GenerateRequest req({{1, 2, 3}}, {}, &context);
        req.on_token = [](const TokenEvent& e) -> bool {
          if (e.step == 2) VLMGEN_FAIL("client went away");
          return true;
        };
        g.generate(req, GenerationConfig().max_new_tokens(5));
      },
      {"client went away"});
  EXPECT_EQ(context.length(), 2);
}

}  // namespace
}  // namespace vlmgen
