// Content hashing, prefill-only calls, the spy on a failing call, NaN logits, the encoder cache
// sending embeddings only, and windows near the int64 limit.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "test_util.h"
#include "vlmgen/content_hash.h"
#include "vlmgen/generator.h"
#include "vlmgen/logging.h"
#include "vlmgen/testing/fake_vlm.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using testing::CallOutcome;
using testing::FakeVlm;
using testing::FakeVlmOptions;
using testing::ForwardSpy;
using ::testing::HasSubstr;

constexpr int64_t kImage = 63;

std::string sha256_hex(const std::string& text) { return to_hex(Sha256().update(text).finish()); }

// The test vectors of FIPS 180-2 (appendix B) and the one-million-'a' message.
TEST(ContentHash, Sha256MatchesThePublishedTestVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  Sha256 million;
  const std::string chunk(1000, 'a');
  for (int i = 0; i < 1000; ++i) million.update(chunk);
  EXPECT_EQ(to_hex(million.finish()), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Split points must not matter.
  Sha256 pieces;
  const std::string text = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  for (char c : text) pieces.update(&c, 1);
  EXPECT_EQ(to_hex(pieces.finish()), sha256_hex(text));
}

TEST(ContentHash, ImageFingerprintsSeeEveryByteShapeAndDtype) {
  VisionInputs a = test::make_images({{1, 4, 4}, {1, 2, 2}}, 3);
  const auto base = a.fingerprints();
  ASSERT_EQ(base.size(), 2u);
  EXPECT_NE(base[0], base[1]);
  EXPECT_EQ(a.select({1}).fingerprints()[0], base[1]) << "an image's identity does not depend on its neighbours";
  // Four pixels edited so that every position-weighted sum modulo 127 or 8191 is unchanged.
  VisionInputs b = a;
  b.pixel_values = a.pixel_values.clone();
  auto flat = b.pixel_values.view({-1});
  flat[0] += 0.25;
  flat[1] -= 0.25;
  flat[127] -= 0.25;
  flat[128] += 0.25;
  EXPECT_NE(b.fingerprints()[0], base[0]);
  EXPECT_EQ(b.fingerprints()[1], base[1]);
  VisionInputs half = a;
  half.pixel_values = a.pixel_values.to(at::kDouble);
  EXPECT_NE(half.fingerprints()[0], base[0]) << "same values, other dtype";
  VisionInputs resized = a;
  resized.image_sizes = a.image_sizes + 1;
  EXPECT_NE(resized.fingerprints()[0], base[0]) << "same pixels, other image size";
}

TEST(ContentHash, FingerprintsOfABundleWithoutAGridAreAnErrorNotACrash) {
  VisionInputs v = test::make_images({{1, 4, 4}});
  v.image_grid_thw = at::Tensor();
  EXPECT_THROW(v.fingerprints(), Error);
}

TEST(VisionInputs, MergeSizeZeroIsAnErrorNotADivisionByZero) {
  VisionInputs v = test::make_images({{1, 4, 4}});
  EXPECT_THROW(v.placeholder_counts(0), Error);
  EXPECT_THROW(v.validate(0), Error);
}

TEST(VisionInputs, PixelChecksCanBeTurnedOffByACallerWhoChecksItself) {
  FakeVlm model;
  Generator generator(model);
  auto prompt = test::prompt_with_image({3, 7}, kImage, 4, {11});
  VisionInputs vision = test::make_images({{1, 4, 4}});
  vision.pixel_values[5][5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(generator.generate({{prompt}, vision}), Error);
  // The fake model hashes rounded pixels, so a NaN goes through it; what matters is that the
  // opt-out lets the call reach the model.
  EXPECT_NO_THROW(generator.generate({{prompt}, vision}, GenerationConfig().check_pixel_values(false)));
}

// The prefix-cache report's workflow: compute a system prompt once, then continue from it with
// several image turns.
TEST(Prefill, ASystemPromptCachedOnceServesThreeImageTurns) {
  FakeVlm model;
  ForwardSpy spy(model);
  Generator generator(spy);
  const std::vector<int64_t> system = {1, 2, 3, 4, 5};
  InferenceContext cached(model.traits().kv_cache, 1, 64);
  auto out = generator.generate({{system}, {}, &cached}, GenerationConfig().max_new_tokens(0));
  ASSERT_EQ(spy.calls().size(), 1u) << "max_new_tokens(0) with a context computes the prompt";
  EXPECT_EQ(spy.calls()[0].window_start, 0);
  EXPECT_EQ(spy.calls()[0].window_end, 5);
  EXPECT_TRUE(out.sequences[0].tokens.empty());
  EXPECT_EQ(out.sequences[0].finish_reason, FinishReason::kLength);
  ASSERT_EQ(cached.length(), 5);

  for (uint64_t seed : {11u, 12u, 13u}) {
    auto turn = system;
    auto image_part = test::prompt_with_image({20}, kImage, 4, {21, static_cast<int64_t>(seed)});
    turn.insert(turn.end(), image_part.begin(), image_part.end());
    auto vision = test::make_images({{1, 4, 4}}, seed);
    InferenceContext context = cached.clone();
    spy.clear();
    auto result = generator.generate({{turn}, vision, &context}, GenerationConfig().max_new_tokens(4));
    ASSERT_EQ(spy.calls().size(), 4u);
    EXPECT_EQ(spy.calls()[0].window_start, 5) << "the system prompt is not recomputed";
    EXPECT_EQ(spy.calls()[0].window_end, static_cast<int64_t>(turn.size()));
    EXPECT_TRUE(spy.calls()[0].has_all_vision()) << "the turn's image is sent";
    for (size_t i = 1; i < spy.calls().size(); ++i) EXPECT_FALSE(spy.calls()[i].has_any_vision());
    EXPECT_EQ(cached.length(), 5) << "a clone leaves the shared prefix alone";

    FakeVlm fresh;
    auto one_shot = Generator(fresh).generate({{turn}, vision}, GenerationConfig().max_new_tokens(4));
    EXPECT_EQ(result.sequences[0].tokens, one_shot.sequences[0].tokens) << "seed " << seed;
  }
}

TEST(Prefill, ChunkSizeNearTheInt64LimitAfterACachedPrefixIsOneWindow) {
  FakeVlm model;
  ForwardSpy spy(model);
  Generator generator(spy);
  InferenceContext context(model.traits().kv_cache, 1, 64);
  generator.generate({{{1, 2, 3}}, {}, &context}, GenerationConfig().max_new_tokens(0));
  spy.clear();
  auto prompt = test::prompt_with_image({1, 2, 3, 9}, kImage, 4, {10});
  auto vision = test::make_images({{1, 4, 4}});
  auto out = generator.generate({{prompt}, vision, &context}, GenerationConfig().max_new_tokens(3).prefill_chunk_size(
                                                                  std::numeric_limits<int64_t>::max() - 1));
  ASSERT_GE(spy.calls().size(), 1u);
  EXPECT_EQ(spy.calls()[0].window_start, 3);
  EXPECT_EQ(spy.calls()[0].window_end, static_cast<int64_t>(prompt.size()));
  FakeVlm fresh;
  EXPECT_EQ(out.sequences[0].tokens,
            Generator(fresh).generate({{prompt}, vision}, GenerationConfig().max_new_tokens(3)).sequences[0].tokens);
}

/// A model that throws on its n-th forward call.
class ThrowingVlm : public FakeVlm {
 public:
  explicit ThrowingVlm(int64_t throw_at) : throw_at_(throw_at) {}
  at::Tensor forward(const ForwardArgs& args) override {
    if (calls_++ == throw_at_) VLMGEN_FAIL("planted failure at call {}", throw_at_);
    return FakeVlm::forward(args);
  }

 private:
  int64_t throw_at_;
  int64_t calls_ = 0;
};

TEST(ForwardSpy, RecordsTheCallThatThrowsAndHowEachCallEnded) {
  ThrowingVlm model(2);
  ForwardSpy spy(model);
  std::vector<CallOutcome> seen;
  spy.on_call([&](const testing::ForwardCall& c) { seen.push_back(c.outcome); });
  auto prompt = test::prompt_with_image({3}, kImage, 4, {11});
  EXPECT_THROW(Generator(spy).generate({{prompt}, test::make_images({{1, 4, 4}})},
                                       GenerationConfig().max_new_tokens(5).enable_kv_cache(false)),
               Error);
  ASSERT_EQ(spy.calls().size(), 3u) << "the failing call is recorded too";
  EXPECT_EQ(spy.calls()[0].outcome, CallOutcome::kReturned);
  EXPECT_EQ(spy.calls()[1].outcome, CallOutcome::kReturned);
  const auto& failed = spy.calls()[2];
  EXPECT_EQ(failed.outcome, CallOutcome::kThrew);
  EXPECT_THAT(failed.error, HasSubstr("planted failure at call 2"));
  EXPECT_EQ(failed.step, 2);
  EXPECT_TRUE(failed.has_all_vision()) << "what the failing call received is there to inspect";
  EXPECT_EQ(seen, (std::vector<CallOutcome>{CallOutcome::kReturned, CallOutcome::kReturned, CallOutcome::kThrew}));
}

/// A model whose logits turn NaN from its n-th call on.
class NanVlm : public FakeVlm {
 public:
  explicit NanVlm(int64_t from) : from_(from) {}
  at::Tensor forward(const ForwardArgs& args) override {
    at::Tensor logits = FakeVlm::forward(args);
    if (calls_++ >= from_) logits.fill_(std::numeric_limits<float>::quiet_NaN());
    return logits;
  }

 private:
  int64_t from_;
  int64_t calls_ = 0;
};

TEST(Sampling, NanLogitsAreAnErrorNotAToken) {
  for (double temperature : {0.0, 0.8}) {
    NanVlm model(1);
    Generator generator(model);
    InferenceContext context(model.traits().kv_cache, 1, 32);
    try {
      generator.generate({{{1, 2, 3}}, {}, &context},
                         GenerationConfig().max_new_tokens(4).temperature(temperature).seed(3));
      ADD_FAILURE() << "expected vlmgen::Error at temperature " << temperature;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("the model's logits for row 0 hold NaN"));
    }
    EXPECT_EQ(context.length(), 0) << "the failed call's columns are rolled back";
  }
  Sampler sampler(SamplingOptions{}, 2);
  at::Tensor logits = at::zeros({2, 8});
  logits[1][3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(sampler.choose(logits, {true, true}), Error);
  EXPECT_EQ(sampler.choose(logits, {true, false})[0], 0) << "a finished row's logits are not read";
}

TEST(Sampling, InfiniteLogitsOrNoAllowedTokenAreAnErrorNotAToken) {
  const float inf = std::numeric_limits<float>::infinity();
  for (double temperature : {0.0, 0.8}) {
    SamplingOptions options;
    options.temperature = temperature;
    options.seed = 3;
    options.suppressed_tokens = {5};
    const auto row = [](std::initializer_list<std::pair<int64_t, float>> set, float rest) {
      at::Tensor t = at::full({1, 8}, rest);
      for (const auto& [id, v] : set) t[0][id] = v;
      return t;
    };
    const std::vector<std::pair<const char*, at::Tensor>> bad = {
        {"+inf", row({{2, inf}}, 0.0f)},                          // softmax would be NaN; argmax an artefact
        {"all -inf", row({}, -inf)},                              // nothing to choose
        {"only a suppressed id finite", row({{5, 1.0f}}, -inf)},  // argmax would pick id 0
    };
    for (const auto& [what, logits] : bad) {
      Sampler sampler(options, 1);
      try {
        const std::vector<int64_t> got = sampler.choose(logits, {true});
        ADD_FAILURE() << what << " at temperature " << temperature << " gave token " << got[0];
      } catch (const Error& e) {
        EXPECT_THAT(e.what(), HasSubstr("the model's logits for row 0 hold NaN or +inf, or no allowed token"));
      }
    }
    // -inf is fine where a token is left: that token.
    Sampler sampler(options, 1);
    EXPECT_EQ(sampler.choose(row({{3, 0.5f}, {5, 9.0f}}, -inf), {true})[0], 3) << temperature;
  }
}

TEST(EncoderCache, CallsGetTheEmbeddingsAndNotThePixels) {
  FakeVlmOptions opts;
  opts.can_encode_images = true;
  FakeVlm model(opts);
  ForwardSpy spy(model);
  auto prompt = test::prompt_with_image({1}, kImage, 4, {2});
  auto vision = test::make_images({{1, 4, 4}});
  Generator(spy).generate({{prompt}, vision}, GenerationConfig().max_new_tokens(3).enable_kv_cache(false));
  ASSERT_EQ(spy.calls().size(), 3u);
  for (const auto& c : spy.calls()) {
    EXPECT_TRUE(c.image_embeddings_shape.has_value());
    EXPECT_FALSE(c.has_pixel_values()) << "the embeddings are authoritative; pixels stay behind";
    EXPECT_TRUE(c.image_grid_thw_shape.has_value()) << "the grid (small) still says which images they are";
  }
}

}  // namespace
}  // namespace vlmgen

namespace vlmgen {
namespace {

// log_softmax of the model's own logits over a full, uncached forward of `row`.
at::Tensor reference_logprobs(testing::FakeVlm& model, const std::vector<int64_t>& row) {
  const int64_t n = static_cast<int64_t>(row.size());
  ForwardArgs args;
  args.input_ids = at::tensor(row, at::kLong).unsqueeze(0);
  args.position_ids = at::arange(n, at::kLong).unsqueeze(0);
  args.attention_mask = at::ones({1, n}, at::kLong);
  return at::log_softmax(model.forward(args)[0], -1);  // [n, V]
}

TEST(Scores, PromptLogprobsAreTheModelsOwnLogSoftmaxWithCacheChunksAndPadding) {
  const std::vector<std::vector<int64_t>> prompts = {{5, 9, 2, 7, 7, 1, 30}, {4, 8, 15}};
  testing::FakeVlm model;
  for (auto config :
       {GenerationConfig().max_new_tokens(2).enable_kv_cache(false),
        GenerationConfig().max_new_tokens(2).prefill_chunk_size(3), GenerationConfig().max_new_tokens(0)}) {
    auto out = Generator(model).generate({prompts}, config.prompt_logprobs(true));
    for (size_t r = 0; r < prompts.size(); ++r) {
      const auto& got = out.sequences[r].prompt_logprobs;
      ASSERT_EQ(got.size(), prompts[r].size());
      EXPECT_TRUE(std::isnan(got[0])) << "the first token has no prefix";
      at::Tensor ref = reference_logprobs(model, prompts[r]);
      for (size_t i = 1; i < got.size(); ++i) {
        EXPECT_NEAR(got[i], ref[static_cast<int64_t>(i) - 1][prompts[r][i]].item<float>(), 1e-5)
            << "row " << r << " token " << i;
      }
    }
  }
}

TEST(Scores, TopLogprobsAndLogitsAreThoseEachTokenWasChosenFrom) {
  testing::FakeVlm model;
  ForwardSpy spy(model);
  spy.record_tensors(true);
  auto out = Generator(spy).generate(
      {{{5, 9, 2, 7}}}, GenerationConfig().max_new_tokens(4).top_logprobs(3).return_logits(true).return_logprobs(true));
  const auto& seq = out.sequences[0];
  ASSERT_EQ(seq.top_logprobs.size(), 4u);
  ASSERT_EQ(seq.logits.sizes(), (at::IntArrayRef{4, 64}));
  for (size_t step = 0; step < 4; ++step) {
    at::Tensor last = spy.calls()[step].logits.select(1, -1)[0];
    EXPECT_TRUE(at::equal(seq.logits[static_cast<int64_t>(step)], last)) << "step " << step;
    auto [values, ids] = at::log_softmax(last, -1).topk(3);
    ASSERT_EQ(seq.top_logprobs[step].size(), 3u);
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_EQ(seq.top_logprobs[step][j].first, ids[j].item<int64_t>());
      EXPECT_NEAR(seq.top_logprobs[step][j].second, values[j].item<float>(), 1e-6);
    }
    EXPECT_EQ(seq.top_logprobs[step][0].first, seq.tokens[step]) << "greedy picks the most likely";
    EXPECT_NEAR(seq.top_logprobs[step][0].second, seq.logprobs[step], 1e-6);
  }
}

// A streaming caller gets each step's alternatives with its token, the same as the result's, for
// every row of a ragged batch (rows end at different steps).
TEST(Scores, EachTokenEventCarriesTheTopLogprobsOfItsStep) {
  testing::FakeVlm model;
  std::vector<TokenEvent> events;
  GenerateRequest request({{5, 9, 2, 7}, {3, 4}});
  request.on_token = [&](const TokenEvent& e) {
    events.push_back(e);
    return !(e.row == 1 && e.step == 1);  // row 1 stops early
  };
  auto out = Generator(model).generate(request, GenerationConfig().max_new_tokens(4).top_logprobs(2));
  ASSERT_EQ(events.size(), 6u);
  for (const TokenEvent& e : events) {
    const auto& seq = out.sequences[static_cast<size_t>(e.row)];
    ASSERT_LT(static_cast<size_t>(e.step), seq.top_logprobs.size());
    EXPECT_EQ(e.top_logprobs, seq.top_logprobs[static_cast<size_t>(e.step)]) << "row " << e.row << " step " << e.step;
    EXPECT_EQ(e.top_logprobs.size(), 2u);
  }
  std::vector<TokenEvent> plain;
  request.on_token = [&](const TokenEvent& e) {
    plain.push_back(e);
    return true;
  };
  Generator(model).generate(request, GenerationConfig().max_new_tokens(2));
  for (const TokenEvent& e : plain) EXPECT_TRUE(e.top_logprobs.empty());
}

TEST(Scores, TopLogprobsBeyondTheVocabularyIsRefused) {
  testing::FakeVlm model;
  EXPECT_THROW(Generator(model).generate({{{1, 2}}}, GenerationConfig().top_logprobs(65)), Error);
  EXPECT_THROW(Generator(model).generate({{{1, 2}}}, GenerationConfig().top_logprobs(-1)), Error);
}

}  // namespace
}  // namespace vlmgen

namespace {
// Counts how often {fmt} formats it.
struct Counted {
  int* formatted;
};
}  // namespace

template <>
struct fmt::formatter<Counted> : fmt::formatter<int> {
  auto format(const Counted& c, fmt::format_context& ctx) const -> decltype(ctx.out()) {
    ++*c.formatted;
    return fmt::formatter<int>::format(*c.formatted, ctx);
  }
};

namespace vlmgen {
namespace {

TEST(Logging, ADroppedMessageIsNeverFormatted) {
  int formatted = 0;
  std::vector<std::string> seen;
  LogSink previous = set_log_sink([&](LogLevel, const std::string& m) { seen.push_back(m); });
  set_log_level(LogLevel::kWarning);
  log(LogLevel::kInfo, "dropped {}", Counted{&formatted});
  EXPECT_EQ(formatted, 0);
  EXPECT_TRUE(seen.empty());
  log(LogLevel::kError, "kept {}", Counted{&formatted});
  EXPECT_EQ(formatted, 1);
  EXPECT_EQ(seen, (std::vector<std::string>{"kept 1"}));
  set_log_level(LogLevel::kInfo);
  set_log_sink(previous);
}

}  // namespace
}  // namespace vlmgen
