// vlmgen::Engine: requests from several threads at staggered times get the tokens the
// synchronous Generator gives each alone; the KV budget bounds admission without losing a
// request; cancellation and a failing model end only their own request.

#include "vlmgen/engine/engine.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "test_util.h"
#include "vlmgen/generator.h"
#include "vlmgen/testing/fake_vlm.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using ::testing::HasSubstr;

struct Case {
  GenerateRequest request;
  GenerationConfig config;
};

// 32 requests: text-only and with one or two images, prompt lengths 3..40, different budgets,
// greedy and seeded sampling, with and without a KV cache.
std::vector<Case> cases(int64_t image_token) {
  std::vector<Case> out;
  for (int i = 0; i < 32; ++i) {
    std::vector<int64_t> text;
    for (int k = 0; k < 3 + (i * 7) % 38; ++k) text.push_back((i * 13 + k * 5) % 60);
    Case c;
    if (i % 3 == 1) {
      c.request.prompts = {test::prompt_with_image(text, image_token, 4, {7, 8})};
      c.request.vision = test::make_images({{1, 4, 4}}, static_cast<uint64_t>(i));
    } else if (i % 3 == 2) {
      auto p = test::prompt_with_image(text, image_token, 4, {9});
      c.request.prompts = {test::prompt_with_image(p, image_token, 2, {10, 11})};
      c.request.vision = test::make_images({{1, 4, 4}, {1, 2, 4}}, static_cast<uint64_t>(100 + i));
    } else {
      c.request.prompts = {text};
    }
    c.config.max_new_tokens(4 + i % 9).enable_kv_cache(i % 4 != 3);
    if (i % 2 == 1) c.config.temperature(0.8).top_p(0.9).seed(static_cast<uint64_t>(1000 + i));
    out.push_back(std::move(c));
  }
  return out;
}

TEST(Engine, StaggeredRequestsFromFourThreadsEqualTheGeneratorAlone) {
  testing::FakeVlm model;
  const std::vector<Case> all = cases(*model.traits().image_token_id);
  std::vector<GenerationResult> expected;
  for (const Case& c : all) expected.push_back(Generator(model).generate(c.request, c.config));

  Engine engine(model, EngineOptions().max_running(6));
  std::vector<std::shared_ptr<RequestHandle>> handles(all.size());
  std::vector<std::vector<int64_t>> streamed(all.size());
  // Request 0's first token waits until every request is in, so that requests overlap however
  // fast the model is; the others arrive while it runs.
  std::atomic<int> submitted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = static_cast<size_t>(t); i < all.size(); i += 4) {
        GenerateRequest request = all[i].request;
        request.on_token = [&streamed, &submitted, i](const TokenEvent& e) {
          while (i == 0 && submitted.load() < 32) std::this_thread::yield();
          streamed[i].push_back(e.token);
          return true;
        };
        handles[i] = engine.submit(request, all[i].config);
        ++submitted;
        std::this_thread::sleep_for(std::chrono::milliseconds(1 + (i * 3) % 5));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < all.size(); ++i) {
    const GenerationResult got = handles[i]->wait();
    ASSERT_EQ(got.sequences.size(), 1u);
    EXPECT_EQ(got.sequences[0].tokens, expected[i].sequences[0].tokens) << "request " << i;
    EXPECT_EQ(got.sequences[0].finish_reason, expected[i].sequences[0].finish_reason) << "request " << i;
    EXPECT_EQ(streamed[i], got.sequences[0].tokens) << "request " << i;
  }
  const EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.finished, 32);
  EXPECT_EQ(m.failed, 0);
  EXPECT_EQ(m.kv_bytes_used, 0);
  EXPECT_LE(m.max_running_seen, 6);
  EXPECT_EQ(m.max_running_seen, 6);  // requests did overlap, up to the limit
  int64_t with_tokens = 0, tokens = 0;
  for (const GenerationResult& r : expected) {
    with_tokens += r.stats.generated_tokens > 0;
    tokens += r.stats.generated_tokens;
  }
  EXPECT_EQ(m.first_tokens, with_tokens);
  EXPECT_EQ(m.generated_tokens, tokens);
  EXPECT_GT(m.mean_time_to_first_token_s(), 0.0);
  EXPECT_GT(m.tokens_per_s(), 0.0);
  EXPECT_GT(m.decode_batches, 0);  // decoding requests stepped together
}

TEST(Engine, AKvBudgetForThreeRunsTenToTheEndAndRefusesOneThatCanNeverFit) {
  testing::FakeVlm model;
  const int64_t per_token = model.traits().kv_cache.bytes_per_token();
  ASSERT_GT(per_token, 0);
  // Each request: 10-token prompt + 6 new tokens → 15 columns: 3 blocks of 5 columns. The
  // budget holds 10 blocks: 3 requests.
  const int64_t per_request = per_token * 15;
  Engine engine(model,
                EngineOptions().max_running(16).kv_block_columns(5).kv_cache_bytes(3 * per_request + per_request / 2));
  EXPECT_EQ(engine.metrics().kv_blocks_total, 10);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  std::vector<GenerationResult> expected;
  std::vector<std::vector<int64_t>> prompts;
  const auto config = GenerationConfig().max_new_tokens(6);
  for (int i = 0; i < 10; ++i) {
    std::vector<int64_t> prompt;
    for (int k = 0; k < 10; ++k) prompt.push_back((i * 11 + k) % 60);
    expected.push_back(Generator(model).generate({{prompt}}, config));
    prompts.push_back(prompt);
  }
  // The first request's first token waits until all ten are in, so the budget is what limits.
  std::atomic<bool> all_in{false};
  for (int i = 0; i < 10; ++i) {
    GenerateRequest request({prompts[static_cast<size_t>(i)]});
    if (i == 0) {
      request.on_token = [&all_in](const TokenEvent&) {
        while (!all_in.load()) std::this_thread::yield();
        return true;
      };
    }
    handles.push_back(engine.submit(request, config));
  }
  all_in = true;
  for (int i = 0; i < 10; ++i) EXPECT_EQ(handles[i]->wait().sequences[0].tokens, expected[i].sequences[0].tokens);
  EXPECT_EQ(engine.metrics().max_running_seen, 3);
  EXPECT_EQ(engine.metrics().kv_bytes_used, 0);
  EXPECT_EQ(engine.metrics().kv_blocks_used, 0);

  std::vector<int64_t> long_prompt(100, 5);
  try {
    engine.submit({{long_prompt}}, GenerationConfig().max_new_tokens(10));
    FAIL() << "accepted a request larger than the whole budget";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("needs 22 KV blocks"));  // 109 columns in blocks of 5
    EXPECT_THAT(e.what(), HasSubstr("whole budget"));
  }
}

TEST(Engine, CancellingMidDecodeEndsThatRequestAndFreesItsCache) {
  testing::FakeVlm model;
  Engine engine(model, EngineOptions().max_running(2));
  std::shared_ptr<RequestHandle> victim;
  std::atomic<int> seen{0};
  std::atomic<bool> submitted{false};
  GenerateRequest request({{1, 2, 3, 4}});
  request.on_token = [&](const TokenEvent&) {
    if (++seen == 3) {
      while (!submitted.load()) std::this_thread::yield();
      victim->cancel();
    }
    return true;
  };
  victim = engine.submit(request, GenerationConfig().max_new_tokens(50));
  submitted = true;
  auto other = engine.submit(GenerateRequest({{5, 6, 7}}), GenerationConfig().max_new_tokens(8));
  const GenerationResult cancelled = victim->wait();
  EXPECT_EQ(cancelled.sequences[0].finish_reason, FinishReason::kCancelled);
  EXPECT_GE(cancelled.sequences[0].tokens.size(), 3u);
  EXPECT_LT(cancelled.sequences[0].tokens.size(), 50u);
  EXPECT_EQ(other->wait().sequences[0].tokens,
            Generator(model)
                .generate(GenerateRequest({{5, 6, 7}}), GenerationConfig().max_new_tokens(8))
                .sequences[0]
                .tokens);
  EXPECT_EQ(engine.metrics().kv_bytes_used, 0);
  EXPECT_EQ(engine.metrics().kv_blocks_used, 0);  // the cancelled request's blocks are back
}

// Throws on any window holding token 50; otherwise FakeVlm.
class PoisonedVlm : public testing::FakeVlm {
 public:
  at::Tensor forward(const ForwardArgs& args) override {
    if ((args.input_ids == 50).any().item<bool>()) throw std::runtime_error("poisoned window");
    return FakeVlm::forward(args);
  }
};

TEST(Engine, AModelErrorEndsOnlyItsRequestAndBadInputEndsOnlyItsOwn) {
  PoisonedVlm model;
  Engine engine(model, EngineOptions().max_running(4));
  auto good = engine.submit(GenerateRequest({{1, 2, 3}}), GenerationConfig().max_new_tokens(6));
  auto poisoned = engine.submit(GenerateRequest({{4, 50, 6}}), GenerationConfig().max_new_tokens(6));
  auto bad =
      engine.submit(GenerateRequest({{1, 2, 999}}), GenerationConfig().max_new_tokens(6));  // outside the vocabulary
  EXPECT_THROW(
      {
        try {
          poisoned->wait();
        } catch (const std::runtime_error& e) {
          EXPECT_STREQ(e.what(), "poisoned window");
          throw;
        }
      },
      std::runtime_error);
  try {
    bad->wait();
    FAIL() << "ran a prompt with a token outside the vocabulary";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("outside the vocabulary"));
  }
  EXPECT_EQ(good->wait().sequences[0].tokens.size(), 6u);
  auto after = engine.submit(GenerateRequest({{7, 8}}), GenerationConfig().max_new_tokens(3));  // still serving
  EXPECT_EQ(after->wait().sequences[0].tokens.size(), 3u);
  const EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.failed, 2);
  EXPECT_EQ(m.finished, 2);
  EXPECT_EQ(m.kv_bytes_used, 0);
}

// Throws on a decode window at column 7; otherwise FakeVlm.
class ThrowsAtColumnSevenVlm : public testing::FakeVlm {
 public:
  at::Tensor forward(const ForwardArgs& args) override {
    if (args.step > 0 && args.window_start == 7) throw std::runtime_error("column 7");
    return FakeVlm::forward(args);
  }
};

TEST(Engine, AFailingCallInAFusedDecodeStepEndsOnlyItsOwnRequest) {
  ThrowsAtColumnSevenVlm model;
  const std::vector<int64_t> longer(20, 3);
  const auto config = GenerationConfig().max_new_tokens(8);
  const GenerationResult expected = Generator(model).generate({{longer}}, config);
  testing::ForwardSpy spy(model);
  Engine engine(spy);
  // Both decode together: the second request's first token waits until the first is in.
  std::atomic<bool> both_in{false};
  GenerateRequest survivor({longer});
  survivor.on_token = [&both_in](const TokenEvent&) {
    while (!both_in.load()) std::this_thread::yield();
    return true;
  };
  auto good = engine.submit(survivor, config);
  auto failing = engine.submit(GenerateRequest({{1, 2, 3, 4, 5, 6}}), config);  // decodes at column 7 on step 2
  both_in = true;
  EXPECT_THROW(failing->wait(), std::runtime_error);
  EXPECT_EQ(good->wait().sequences[0].tokens, expected.sequences[0].tokens);
  bool batch_threw = false;
  for (const testing::ForwardCall& call : spy.calls()) {
    batch_threw = batch_threw || (call.batch_group >= 0 && call.outcome == testing::CallOutcome::kThrew);
  }
  EXPECT_TRUE(batch_threw);  // the failure came from a fused step
  EXPECT_EQ(engine.metrics().failed, 1);
  EXPECT_EQ(engine.metrics().kv_blocks_used, 0);
}

TEST(Engine, ALongPromptIsComputedAFewColumnsPerStepWhileAnotherRequestDecodes) {
  testing::FakeVlm model;
  const int64_t image = *model.traits().image_token_id;
  std::vector<int64_t> before, after;
  for (int k = 0; k < 14; ++k) before.push_back((k * 7) % 60);
  for (int k = 0; k < 40; ++k) after.push_back((k * 11) % 60);
  GenerateRequest long_request({test::prompt_with_image(before, image, 12, after)}, test::make_images({{1, 4, 12}}, 3));
  const int64_t prompt = static_cast<int64_t>(long_request.prompts[0].size());  // 66 columns; image at [14, 26)
  GenerateRequest short_request({{1, 2, 3}});
  const auto long_config = GenerationConfig().max_new_tokens(4);
  const auto short_config = GenerationConfig().max_new_tokens(40);
  const GenerationResult long_alone = Generator(model).generate(long_request, long_config);
  const GenerationResult short_alone = Generator(model).generate(short_request, short_config);

  testing::ForwardSpy spy(model);
  std::shared_ptr<RequestHandle> long_handle, short_handle;
  {
    Engine engine(spy, EngineOptions().prefill_columns_per_step(10));
    // The short request decodes while the long one arrives: its first token waits for it.
    std::atomic<bool> long_in{false};
    short_request.on_token = [&long_in](const TokenEvent&) {
      while (!long_in.load()) std::this_thread::yield();
      return true;
    };
    short_handle = engine.submit(short_request, short_config);
    long_handle = engine.submit(long_request, long_config);
    long_in = true;
    EXPECT_EQ(long_handle->wait().sequences[0].tokens, long_alone.sequences[0].tokens);
    EXPECT_EQ(short_handle->wait().sequences[0].tokens, short_alone.sequences[0].tokens);
  }
  // The long prompt's windows, 10 columns a step: [0, 10), then [10, 14) (a chunk never ends
  // inside the image), then [14, 26) (the image is longer than the budget: the chunk takes all
  // of it), then on in tens; the short request's decode calls come between them.
  std::vector<std::pair<int64_t, int64_t>> windows;
  int64_t decodes_between = 0;
  for (const testing::ForwardCall& call : spy.calls()) {
    if (call.step == 0 && call.window_end > 3) {
      windows.emplace_back(call.window_start, call.window_end);
      EXPECT_EQ(call.has_any_vision(), call.window_start < 26 && call.window_end > 14) << call.window_start;
    } else if (call.step > 0 && !windows.empty() && windows.back().second < prompt) {
      ++decodes_between;
    }
  }
  const std::vector<std::pair<int64_t, int64_t>> want = {{0, 10},  {10, 14}, {14, 26}, {26, 36},
                                                         {36, 46}, {46, 56}, {56, 66}};
  EXPECT_EQ(windows, want);
  EXPECT_GE(decodes_between, 4);  // the short request kept decoding during the long prefill
}

TEST(Engine, APictureSeenBeforeIsNotEncodedAgainAndADifferentOneIs) {
  testing::FakeVlmOptions options;
  options.can_encode_images = true;
  testing::FakeVlm model(options);
  const int64_t image = *model.traits().image_token_id;
  const VisionInputs beach = test::make_images({{1, 4, 4}}, 7), dogs = test::make_images({{1, 4, 4}}, 8);
  const GenerateRequest first({test::prompt_with_image({1, 2}, image, 4, {3})}, beach);
  const GenerateRequest again({test::prompt_with_image({5, 6, 7}, image, 4, {8, 9})}, beach);  // other text
  const GenerateRequest other({test::prompt_with_image({1, 2}, image, 4, {3})}, dogs);
  const auto config = GenerationConfig().max_new_tokens(5);
  std::vector<std::vector<int64_t>> expected;
  for (const auto* r : {&first, &again, &other})
    expected.push_back(Generator(model).generate(*r, config).sequences[0].tokens);

  Engine engine(model, EngineOptions().encoder_cache_bytes(1 << 20));
  const int64_t runs = model.vision_tower_runs();
  EXPECT_EQ(engine.submit(first, config)->wait().sequences[0].tokens, expected[0]);
  EXPECT_EQ(model.vision_tower_runs(), runs + 1);
  EXPECT_EQ(engine.submit(again, config)->wait().sequences[0].tokens, expected[1]);
  EXPECT_EQ(model.vision_tower_runs(), runs + 1);  // the same pixels: taken from the cache
  EXPECT_EQ(engine.submit(other, config)->wait().sequences[0].tokens, expected[2]);
  EXPECT_EQ(model.vision_tower_runs(), runs + 2);  // a different picture is encoded
  const EngineMetrics m = engine.metrics();
  EXPECT_EQ(m.encoder_cache_hits, 1);
  EXPECT_EQ(m.encoder_cache_misses, 2);

  // Without the cross-request cache every request encodes its picture.
  Engine plain(model, EngineOptions().encoder_cache_bytes(0));
  plain.submit(first, config)->wait();
  plain.submit(again, config)->wait();
  EXPECT_EQ(model.vision_tower_runs(), runs + 4);
}

TEST(Engine, ASharedSystemPromptWithAnImageIsComputedOnceAndADifferentPictureMisses) {
  testing::FakeVlm fake;
  testing::ForwardSpy spy(fake);
  const int64_t image = *fake.traits().image_token_id;
  std::vector<int64_t> system;
  for (int k = 0; k < 100; ++k) system.push_back((k * 7) % 60);
  system = test::prompt_with_image(system, image, 4, {});           // placeholders at columns [100, 104)
  for (int k = 0; k < 96; ++k) system.push_back((k * 5 + 3) % 60);  // 200 columns in all
  const auto turn = [&](std::vector<int64_t> user) {
    std::vector<int64_t> p = system;
    p.insert(p.end(), user.begin(), user.end());
    return p;
  };
  const VisionInputs beach = test::make_images({{1, 4, 4}}, 21), dogs = test::make_images({{1, 4, 4}}, 22);
  const GenerateRequest a({turn({1, 2, 3, 4, 5, 6, 7, 8, 9, 10})}, beach);
  const GenerateRequest b({turn({11, 12, 13})}, beach);
  const GenerateRequest c({turn({11, 12, 13})}, dogs);  // b's ids, another picture
  const auto config = GenerationConfig().max_new_tokens(5);
  std::vector<std::vector<int64_t>> cold;
  for (const auto* r : {&a, &b, &c}) cold.push_back(Generator(fake).generate(*r, config).sequences[0].tokens);

  Engine engine(spy, EngineOptions().prefix_block_columns(16));
  EXPECT_EQ(engine.submit(a, config)->wait().sequences[0].tokens, cold[0]);
  spy.clear();
  EXPECT_EQ(engine.submit(b, config)->wait().sequences[0].tokens, cold[1]);
  ASSERT_FALSE(spy.calls().empty());
  EXPECT_EQ(spy.calls()[0].window_start, 192);  // 12 whole blocks of the shared 200 columns
  EXPECT_TRUE(spy.calls()[0].images.empty());   // the cached columns hold the picture already
  EXPECT_EQ(engine.metrics().prefix_cache_hit_columns, 192);

  spy.clear();
  EXPECT_EQ(engine.submit(c, config)->wait().sequences[0].tokens, cold[2]);
  ASSERT_FALSE(spy.calls().empty());
  EXPECT_EQ(spy.calls()[0].window_start, 96);  // up to the block holding the other picture
  EXPECT_THAT(spy.calls()[0].images, ::testing::ElementsAre(0));
  EXPECT_EQ(engine.metrics().prefix_cache_hits, 2);
}

TEST(EncoderCache, EvictsTheLeastRecentlyUsedToStayWithinItsBudget) {
  EncoderCache cache(3 * 16 * 8);  // three [16, 1] float64 entries
  ContentHash a{}, b{}, c{}, d{};
  a[0] = 1, b[0] = 2, c[0] = 3, d[0] = 4;
  const at::Tensor e = at::zeros({16, 1}, at::kDouble);
  cache.insert(a, e);
  cache.insert(b, e);
  cache.insert(c, e);
  EXPECT_TRUE(cache.find(a).defined());  // a is now the most recent
  cache.insert(d, e);                    // evicts b
  EXPECT_FALSE(cache.find(b).defined());
  EXPECT_TRUE(cache.find(c).defined());
  EXPECT_TRUE(cache.find(d).defined());
  cache.insert(ContentHash{9}, at::zeros({64, 1}, at::kDouble));  // larger than the budget: not kept
  EXPECT_FALSE(cache.find(ContentHash{9}).defined());
  const auto stats = cache.stats();
  EXPECT_EQ(stats.entries, 3);
  EXPECT_EQ(stats.bytes, 3 * 16 * 8);
  EXPECT_EQ(stats.evictions, 1);
  EXPECT_EQ(stats.hits, 3);
  EXPECT_EQ(stats.misses, 2);
}

TEST(Engine, DestroyingItCancelsWhatIsLeft) {
  testing::FakeVlm model;
  std::shared_ptr<RequestHandle> handle;
  {
    Engine engine(model, EngineOptions().max_running(1));
    handle = engine.submit(GenerateRequest({{1, 2, 3}}), GenerationConfig().max_new_tokens(100000));
    engine.submit(GenerateRequest({{4, 5}}), GenerationConfig().max_new_tokens(3));
  }
  EXPECT_EQ(handle->wait().sequences[0].finish_reason, FinishReason::kCancelled);
}

// The step plan of a tensor-parallel engine carries a request to the other ranks: what arrives
// must be the same request (request_digest covers every option, the prompts and the images), and
// a plan cut short or holding nonsense is a vlmgen::Error, not a half-read request.
TEST(StepPlan, ARequestWithEveryOptionSetArrivesUnchanged) {
  GenerateRequest request({{1, 2, 3}, {4, 5}}, VisionInputs::patch_flattened(
                                                   at::randn({8, 6}), at::tensor({1, 2, 4}, at::kLong).view({1, 3}),
                                                   at::tensor({28, 56}, at::kInt).view({1, 2})));
  const auto config = GenerationConfig()
                          .max_new_tokens(7)
                          .enable_kv_cache(false)
                          .replay_mode(ReplayMode::kAlways)
                          .end_token_ids({9, 10})
                          .stop_token_ids({11})
                          .pad_token_id(3)
                          .temperature(0.7)
                          .top_k(5)
                          .top_p(0.8)
                          .seed(123456789012345ULL)
                          .row_seeds({1, 2})
                          .return_logprobs(true)
                          .prefill_chunk_size(4)
                          .encoder_cache(false)
                          .allow_placeholder_tokens(true)
                          .full_logits(true)
                          .check_pixel_values(false)
                          .prompt_logprobs(true)
                          .top_logprobs(3)
                          .return_logits(true);
  detail::ByteWriter writer;
  detail::write_request(writer, request, config);
  detail::StepPlan plan;
  plan.state.values[3] = 42;
  plan.cancelled = {7};
  plan.cancelled_rows = {{7, 1}};
  plan.failed = {8};
  plan.admitted.emplace_back(5, writer.bytes());
  const detail::StepPlan back = detail::StepPlan::decode(plan.encode());
  EXPECT_EQ(back.state.values, plan.state.values);
  EXPECT_EQ(back.cancelled, plan.cancelled);
  ASSERT_EQ(back.cancelled_rows.size(), 1u);
  EXPECT_EQ(back.cancelled_rows[0].id, 7u);
  EXPECT_EQ(back.cancelled_rows[0].row, 1);
  EXPECT_EQ(back.failed, plan.failed);
  ASSERT_EQ(back.admitted.size(), 1u);
  EXPECT_EQ(back.admitted[0].first, 5u);
  detail::ByteReader reader(back.admitted[0].second);
  const auto [got, got_config] = detail::read_request(reader, at::kCPU);
  EXPECT_TRUE(reader.done());
  EXPECT_EQ(got.prompts, request.prompts);
  EXPECT_TRUE(at::equal(got.vision.pixel_values, request.vision.pixel_values));
  EXPECT_EQ(got.vision.image_sizes.scalar_type(), at::kInt);
  EXPECT_EQ(detail::request_digest(got, got_config), detail::request_digest(request, config));
  EXPECT_NE(detail::request_digest(got, GenerationConfig()), detail::request_digest(request, config));

  const std::string bytes = plan.encode();
  for (size_t cut : {size_t{0}, size_t{1}, bytes.size() / 2, bytes.size() - 1}) {
    EXPECT_THAT([&] { detail::StepPlan::decode(bytes.substr(0, cut)); },
                ::testing::ThrowsMessage<Error>(
                    ::testing::AnyOf(HasSubstr("a step plan ends after"), HasSubstr("a step plan announces"))))
        << cut;
  }
  EXPECT_THAT([&] { detail::StepPlan::decode(bytes + "x"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("bytes left after its last field")));
  std::string not_a_bool = bytes;
  not_a_bool[0] = 2;
  EXPECT_THAT([&] { detail::StepPlan::decode(not_a_bool); },
              ::testing::ThrowsMessage<Error>(HasSubstr("holds 2 where true or false was expected")));
  std::string many_requests = bytes;  // the admitted count, after stop, state and three empty-or-short lists
  const size_t count_at = 1 + sizeof(detail::StepState::values) + (8 + 8) + (8 + 16) + (8 + 8);
  const uint64_t huge = uint64_t{1} << 60;
  std::memcpy(&many_requests[count_at], &huge, sizeof huge);
  EXPECT_THAT([&] { detail::StepPlan::decode(many_requests); },
              ::testing::ThrowsMessage<Error>(HasSubstr("announces 1152921504606846976 entries")));
}

TEST(Engine, JoinIsOnlyForTheRanksThatFollowRankZero) {
  testing::FakeVlm model;
  Engine engine(model);
  EXPECT_THAT([&] { engine.join(); }, ::testing::ThrowsMessage<Error>(HasSubstr("this engine is rank 0")));
}

}  // namespace
}  // namespace vlmgen
