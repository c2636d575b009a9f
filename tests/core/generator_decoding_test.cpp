// The generator's decode loop on a fake model: seeded sampling with top-k and top-p, rows
// finished by end and stop ids or length and masked after, streaming and cancelling, generated
// image placeholders suppressed, and the stats reported. The replay rule is in generator_test.cpp.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "generator_test_util.h"
#include "test_util.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/testing/fake_vlm.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using generator_test::kImage;
using generator_test::tokens_of;
using testing::FakeVlm;
using testing::ForwardCall;
using testing::ForwardSpy;

TEST(Sampling, SameSeedSameTokensAndTopKOneIsGreedy) {
  FakeVlm model;
  Generator generator(model);
  std::vector<int64_t> prompt = {1, 2, 3};
  auto sample = [&](uint64_t seed) {
    return tokens_of(generator.generate({{prompt}}, GenerationConfig().max_new_tokens(12).temperature(1.0).seed(seed)));
  };
  EXPECT_EQ(sample(7), sample(7));
  bool any_differs = sample(7) != sample(8) || sample(7) != sample(9) || sample(7) != sample(10);
  EXPECT_TRUE(any_differs) << "different seeds should not all give the same 12 tokens";
  auto greedy = tokens_of(generator.generate({{prompt}}, GenerationConfig().max_new_tokens(12)));
  auto top1 = tokens_of(
      generator.generate({{prompt}}, GenerationConfig().max_new_tokens(12).temperature(0.8).top_k(1).seed(3)));
  EXPECT_EQ(top1, greedy);
  auto tiny_p = tokens_of(
      generator.generate({{prompt}}, GenerationConfig().max_new_tokens(12).temperature(0.8).top_p(1e-6).seed(3)));
  EXPECT_EQ(tiny_p, greedy) << "top_p that keeps one token is greedy";
  auto cold =
      tokens_of(generator.generate({{prompt}}, GenerationConfig().max_new_tokens(12).temperature(1e-30).seed(3)));
  EXPECT_EQ(cold, greedy) << "a vanishing temperature is greedy, not an overflow";
  // top_k and top_p together: every token is in the top 5 of its step and inside the nucleus.
  ForwardSpy spy(model);
  spy.record_tensors(true);
  auto both = tokens_of(Generator(spy).generate(
      {{prompt}}, GenerationConfig().max_new_tokens(12).temperature(0.8).top_k(5).top_p(0.5).seed(3)));
  ASSERT_EQ(both.size(), 12u);
  for (size_t step = 0; step < both.size(); ++step) {
    at::Tensor last = spy.calls()[step].logits.select(1, -1)[0];
    auto [values, ids] = at::topk(last, 5);
    at::Tensor probs = at::softmax(values / 0.8, 0);
    at::Tensor before = probs.cumsum(0) - probs;
    bool inside = false;
    for (int64_t i = 0; i < 5; ++i)
      inside |= ids[i].item<int64_t>() == both[step] && (i == 0 || before[i].item<double>() < 0.5);
    EXPECT_TRUE(inside) << "step " << step << " token " << both[step];
  }
}

TEST(Sampling, ARowSamplesTheSameInABatchAsAlone) {
  FakeVlm model;
  Generator generator(model);
  std::vector<int64_t> a = {1, 2, 3, 4}, b = {9};
  auto config = GenerationConfig().max_new_tokens(10).temperature(1.0).top_k(20).seed(42);
  auto batched = generator.generate({{a, b}}, config);
  EXPECT_EQ(tokens_of(batched, 0), tokens_of(generator.generate({{a}}, config)));
  EXPECT_EQ(tokens_of(batched, 1), tokens_of(generator.generate({{b}}, config)));
  auto seeded = generator.generate({{a, b}}, GenerationConfig(config).row_seeds({42, 5}));
  EXPECT_EQ(tokens_of(seeded, 0), tokens_of(batched, 0));
  EXPECT_EQ(tokens_of(seeded, 1), tokens_of(generator.generate({{b}}, GenerationConfig(config).seed(5))));
}

TEST(Finishing, EndIdStopIdAndLengthEndRowsWithTheirReason) {
  FakeVlm model;
  Generator generator(model);
  std::vector<int64_t> a = {1, 2, 3}, b = {4, 5, 6, 7};
  auto free_run = generator.generate({{a, b}}, GenerationConfig().max_new_tokens(8));
  ASSERT_EQ(tokens_of(free_run, 0).size(), 8u);
  for (const auto& s : free_run.sequences) EXPECT_EQ(s.finish_reason, FinishReason::kLength);

  // End row 0 at its 3rd token and row 1 at its 5th, by naming those tokens as end/stop ids.
  const int64_t end_id = tokens_of(free_run, 0)[2];
  const int64_t stop_id = tokens_of(free_run, 1)[4];
  auto first_index = [](const std::vector<int64_t>& v, int64_t t) {
    return static_cast<size_t>(std::find(v.begin(), v.end(), t) - v.begin());
  };
  auto out = generator.generate({{a, b}},
                                GenerationConfig().max_new_tokens(8).end_token_ids({end_id}).stop_token_ids({stop_id}));
  for (size_t r = 0; r < 2; ++r) {
    const auto& full = tokens_of(free_run, r);
    const size_t cut = std::min(first_index(full, end_id), first_index(full, stop_id));
    const auto& got = out.sequences[r];
    ASSERT_LT(cut, full.size());
    EXPECT_EQ(got.tokens, std::vector<int64_t>(full.begin(), full.begin() + cut + 1)) << "row " << r;
    EXPECT_EQ(got.finish_reason, full[cut] == end_id ? FinishReason::kEndId : FinishReason::kStopWords);
  }
}

TEST(Finishing, ZeroNewTokensRunsNoForwardCall) {
  FakeVlm model;
  ForwardSpy spy(model);
  auto out = Generator(spy).generate({{{1, 2}}}, GenerationConfig().max_new_tokens(0));
  EXPECT_TRUE(spy.calls().empty());
  EXPECT_TRUE(out.sequences[0].tokens.empty());
  EXPECT_EQ(out.sequences[0].finish_reason, FinishReason::kLength);
}

TEST(Streaming, CallbackSeesEveryTokenInOrderAndLogprobsMatchTheLogits) {
  FakeVlm model;
  ForwardSpy spy(model);
  spy.record_tensors(true);
  Generator generator(spy);
  std::vector<TokenEvent> events;
  GenerateRequest req{{{1, 2, 3}, {4, 5}}, {}, nullptr, [&](const TokenEvent& e) {
                        events.push_back(e);
                        return true;
                      }};
  auto out = generator.generate(req, GenerationConfig().max_new_tokens(5).return_logprobs(true));
  std::vector<std::vector<int64_t>> streamed(2);
  int64_t last_step = 0;
  for (const auto& e : events) {
    EXPECT_GE(e.step, last_step);
    last_step = e.step;
    EXPECT_EQ(e.step, static_cast<int64_t>(streamed[e.row].size()));
    streamed[e.row].push_back(e.token);
  }
  EXPECT_EQ(streamed[0], tokens_of(out, 0));
  EXPECT_EQ(streamed[1], tokens_of(out, 1));
  EXPECT_EQ(events.back().finish_reason, FinishReason::kLength);
  // Log-probabilities: log_softmax of the last column's logits at the chosen token.
  ASSERT_EQ(out.sequences[0].logprobs.size(), 5u);
  for (size_t step = 0; step < 5; ++step) {
    at::Tensor last = spy.calls()[step].logits.select(1, -1)[0];
    const float expected = at::log_softmax(last, -1)[tokens_of(out, 0)[step]].item<float>();
    EXPECT_FLOAT_EQ(out.sequences[0].logprobs[step], expected);
    EXPECT_EQ(last.argmax().item<int64_t>(), tokens_of(out, 0)[step]);
  }
}

TEST(Streaming, CallbackCancelsItsRowAndTheFlagCancelsAll) {
  FakeVlm model;
  ForwardSpy spy(model);
  Generator generator(spy);
  GenerateRequest req;
  req.prompts = {{1, 2, 3}, {4, 5}};
  req.on_token = [](const TokenEvent& e) { return !(e.row == 0 && e.step == 2); };
  auto out = generator.generate(req, GenerationConfig().max_new_tokens(6));
  EXPECT_EQ(out.sequences[0].tokens.size(), 3u);
  EXPECT_EQ(out.sequences[0].finish_reason, FinishReason::kCancelled);
  EXPECT_EQ(out.sequences[1].tokens.size(), 6u);
  EXPECT_EQ(out.sequences[1].finish_reason, FinishReason::kLength);

  spy.clear();
  std::atomic<bool> stop{false};
  req.cancel = &stop;
  req.on_token = [&](const TokenEvent& e) {
    if (e.step == 1) stop = true;
    return true;
  };
  out = generator.generate(req, GenerationConfig().max_new_tokens(6));
  EXPECT_EQ(spy.calls().size(), 2u) << "no forward call after the flag is set";
  for (const auto& s : out.sequences) {
    EXPECT_EQ(s.tokens.size(), 2u);
    EXPECT_EQ(s.finish_reason, FinishReason::kCancelled);
  }
}

TEST(Placeholders, GeneratedPlaceholderTokensAreSuppressedUnlessAllowed) {
  FakeVlm model;
  Generator generator(model);
  auto vision = test::make_images({{1, 4, 4}});
  auto prompt = test::prompt_with_image({5}, kImage, 4, {6, 7});
  // This prompt makes the fake model's favourite next-but-one token the image placeholder.
  auto allowed =
      generator.generate({{prompt}, vision}, GenerationConfig().max_new_tokens(5).allow_placeholder_tokens(true));
  ASSERT_THAT(tokens_of(allowed), ::testing::Contains(kImage));
  // Fed back without a cache, that token is a placeholder with no image: a strict model refuses.
  EXPECT_THROW(
      generator.generate({{prompt}, vision},
                         GenerationConfig().max_new_tokens(5).enable_kv_cache(false).allow_placeholder_tokens(true)),
      Error);
  for (bool kv : {true, false}) {
    auto out = generator.generate({{prompt}, vision}, GenerationConfig().max_new_tokens(5).enable_kv_cache(kv));
    EXPECT_THAT(tokens_of(out), ::testing::Not(::testing::Contains(kImage)));
    EXPECT_EQ(tokens_of(out).size(), 5u);
  }
  auto sampled = generator.generate({{prompt}, vision}, GenerationConfig().max_new_tokens(30).temperature(5.0).seed(1));
  EXPECT_THAT(tokens_of(sampled), ::testing::Not(::testing::Contains(kImage)));
}

TEST(Streaming, CancellingBetweenPrefillChunksStopsBeforeTheNextChunk) {
  FakeVlm model;
  ForwardSpy spy(model);
  std::atomic<bool> stop{false};
  spy.on_call([&](const ForwardCall&) { stop = true; });  // set during the first chunk
  GenerateRequest req({{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}});
  req.cancel = &stop;
  auto out = Generator(spy).generate(req, GenerationConfig().max_new_tokens(4).prefill_chunk_size(3));
  EXPECT_EQ(spy.calls().size(), 1u);
  EXPECT_TRUE(out.sequences[0].tokens.empty());
  EXPECT_EQ(out.sequences[0].finish_reason, FinishReason::kCancelled);
}

TEST(Finishing, ColumnsAfterARowEndsAreMasked) {
  FakeVlm model;
  ForwardSpy spy(model);
  Generator generator(spy);
  std::vector<int64_t> a = {1, 2, 3}, b = {4, 5};
  auto free_run = generator.generate({{a, b}}, GenerationConfig().max_new_tokens(6));
  const int64_t end_id = free_run.sequences[1].tokens[1];  // row 1 ends at its 2nd token
  spy.clear();
  auto out = generator.generate({{a, b}}, GenerationConfig().max_new_tokens(6).end_token_ids({end_id}));
  ASSERT_EQ(out.sequences[1].finish_reason, FinishReason::kEndId);
  const size_t ended_at = out.sequences[1].tokens.size();  // row 1's last token sits at column 3 + ended_at - 1
  // The row's later filler columns arrive with mask 0 (the model sees no fake tokens).
  std::vector<at::Tensor> seen;
  struct MaskRecorder : testing::FakeVlm {
    std::vector<at::Tensor>* seen;
    at::Tensor forward(const ForwardArgs& args) override {
      seen->push_back(args.attention_mask.clone());
      return FakeVlm::forward(args);
    }
  } recorder;
  recorder.seen = &seen;
  Generator(recorder).generate({{a, b}}, GenerationConfig().max_new_tokens(6).end_token_ids({end_id}));
  const at::Tensor last = seen.back();  // [2, columns]
  const int64_t last_real = 3 + static_cast<int64_t>(ended_at) - 1;
  EXPECT_EQ(last[1][last_real].item<int64_t>(), 1) << "the end token itself is real";
  if (last.size(1) > last_real + 1) {
    EXPECT_EQ(last[1].narrow(0, last_real + 1, last.size(1) - last_real - 1).sum().item<int64_t>(), 0);
  }
  EXPECT_EQ(last[0].narrow(0, 0, last.size(1)).sum().item<int64_t>(), last.size(1)) << "row 0 is still running";
}

TEST(Stats, TimesAndCountsAreReported) {
  FakeVlm model;
  auto out = Generator(model).generate({{{1, 2, 3}, {4}}}, GenerationConfig().max_new_tokens(4));
  EXPECT_EQ(out.stats.forward_calls, 4);
  EXPECT_EQ(out.stats.generated_tokens, 8);
  EXPECT_EQ(out.stats.prompt_columns, 3);
  EXPECT_GT(out.stats.time_to_first_token_s, 0.0);
  EXPECT_GE(out.stats.total_s, out.stats.time_to_first_token_s);
  EXPECT_GT(out.stats.decode_tokens_per_s, 0.0);
}

}  // namespace
}  // namespace vlmgen
