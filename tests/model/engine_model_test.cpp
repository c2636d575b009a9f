// The engine on the reference model: decode calls of several requests fused into one decoder
// pass (QwenVl::forward_batch) give each request the logits of its own forward call, and the
// engine's requests, batched that way, get the tokens the synchronous Generator gives each alone.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "qwen_test_util.h"
#include "vlmgen/engine/engine.h"
#include "vlmgen/generator.h"
#include "vlmgen/kernels/cpu.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/models/quantization.h"
#include "vlmgen/models/qwen_vl.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using namespace qwen_test;

// A KV cache holding `prompt` (rows of equal length), computed by the generator.
std::unique_ptr<InferenceContext> cached(CausalVlm& model, const std::vector<std::vector<int64_t>>& prompts) {
  auto context = std::make_unique<InferenceContext>(model.traits().kv_cache, static_cast<int64_t>(prompts.size()), 64);
  Generator(model).generate(make_request(prompts, {}, context.get()), GenerationConfig().max_new_tokens(0));
  return context;
}

// A text window of `ids` (one row each) after the context's columns, positions going on from there.
ForwardArgs window_after(InferenceContext& context, const std::vector<std::vector<int64_t>>& ids, bool last_only) {
  const int64_t rows = static_cast<int64_t>(ids.size()), cols = static_cast<int64_t>(ids[0].size());
  const int64_t start = context.length();
  std::vector<int64_t> flat;
  for (const auto& row : ids) flat.insert(flat.end(), row.begin(), row.end());
  ForwardArgs args;
  args.input_ids = at::tensor(flat, at::kLong).view({rows, cols});
  args.position_ids = at::arange(start, start + cols, at::kLong).expand({3, rows, cols}).contiguous();
  args.attention_mask = at::ones({rows, start + cols}, at::kLong);
  args.context = &context;
  args.window_start = start;
  args.last_column_logits = last_only;
  args.step = 1;
  return args;
}

class ForwardBatchTest : public ::testing::TestWithParam<QwenFamily> {
 protected:
  QwenVlConfig config() const {
    QwenVlConfig c = GetParam() == QwenFamily::kQwen2Vl ? test_config() : QwenVlConfig::tiny(GetParam());
    c.max_position_embeddings = 512;
    return c;
  }
};

TEST_P(ForwardBatchTest, EachCallOfAFusedBatchGetsTheLogitsOfItsOwnForward) {
  QwenVl model(config(), 5);
  auto a = cached(model, {{1, 2, 3, 4, 5}});
  auto b = cached(model, {{7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}});
  auto c = cached(model, {{20, 21, 22}, {23, 24, 25}});  // two rows
  auto d = cached(model, {{30, 31, 32, 33, 34, 35, 36}});
  const std::vector<ForwardArgs> calls = {
      window_after(*a, {{40}}, true),
      window_after(*b, {{41, 42, 43}}, false),  // every column's logits
      window_after(*c, {{44}, {45}}, true),
      window_after(*d, {{46, 47}}, true),
  };
  std::vector<at::Tensor> alone;
  for (const ForwardArgs& call : calls) alone.push_back(model.forward(call));  // appends, never commits
  std::vector<const ForwardArgs*> pointers;
  for (const ForwardArgs& call : calls) pointers.push_back(&call);
  const std::vector<at::Tensor> fused = model.forward_batch(pointers);
  ASSERT_EQ(fused.size(), calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    ASSERT_EQ(fused[i].sizes(), alone[i].sizes()) << "call " << i;
    EXPECT_LE(max_abs_diff(fused[i], alone[i]), 1e-5) << "call " << i;
  }
  // The calls' logits differ from one another, so a mixed-up segment could not pass.
  EXPECT_GT(max_abs_diff(alone[0].select(1, 0), alone[3].select(1, 0)), 1e-3);
  EXPECT_EQ(a->length(), 5);  // nothing committed
}

TEST_P(ForwardBatchTest, TwentyRequestsGetBitIdenticalLogitsToTheirOwnForwardCalls) {
  // More tokens than the CPU's few-row linear takes at once (16): the batch is cut into passes
  // that stay on it, so no call's logits depend on what it was batched with.
  QwenVl model(config(), 7);
  std::vector<std::unique_ptr<InferenceContext>> contexts;
  std::vector<ForwardArgs> calls;
  for (int64_t i = 0; i < 20; ++i) {
    std::vector<int64_t> prompt;
    for (int64_t k = 0; k < 2 + i % 5; ++k) prompt.push_back((i * 7 + k * 3) % 80);
    contexts.push_back(cached(model, {prompt}));
  }
  for (int64_t i = 0; i < 20; ++i) calls.push_back(window_after(*contexts[static_cast<size_t>(i)], {{i + 1}}, true));
  std::vector<const ForwardArgs*> pointers;
  for (const ForwardArgs& call : calls) pointers.push_back(&call);
  const std::vector<at::Tensor> fused = model.forward_batch(pointers);
  ASSERT_EQ(fused.size(), calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    const at::Tensor alone = model.forward(calls[i]);
    if (kernels::enabled()) {
      EXPECT_TRUE(at::equal(fused[i], alone)) << "call " << i;
    } else {  // ATen's products (VLMGEN_CPU_ISA=aten) sum in an order that depends on the row count
      EXPECT_LE(max_abs_diff(fused[i], alone), 1e-5) << "call " << i;
    }
  }
}

TEST_P(ForwardBatchTest, ThirtyRequestsWithFp8WeightsGetBitIdenticalLogitsToTheirOwnForwardCalls) {
  // FP8 weights: from 24 rows a product widens its weights (other roundings than the few-row
  // kernel's), so the passes stay below that.
  ScratchDir scratch;
  QwenVl(config(), 8).save_checkpoint(scratch.dir("f32"));
  QuantizeOptions quantize;
  quantize.block = {16, 16};
  quantize_checkpoint(scratch.dir("f32"), scratch.dir("fp8"), quantize);
  LoadOptions options;
  options.keep_fp8 = true;
  std::unique_ptr<CausalVlm> model = load_model(scratch.dir("fp8"), ParallelContext::single(), options);
  auto* qwen = dynamic_cast<QwenVl*>(model.get());
  ASSERT_NE(qwen, nullptr);
  ASSERT_TRUE(qwen->keeps_fp8());
  std::vector<std::unique_ptr<InferenceContext>> contexts;
  std::vector<ForwardArgs> calls;
  for (int64_t i = 0; i < 30; ++i) {
    std::vector<int64_t> prompt;
    for (int64_t k = 0; k < 2 + i % 5; ++k) prompt.push_back((i * 7 + k * 3) % 80);
    contexts.push_back(cached(*qwen, {prompt}));
  }
  for (int64_t i = 0; i < 30; ++i) calls.push_back(window_after(*contexts[static_cast<size_t>(i)], {{i + 1}}, true));
  std::vector<const ForwardArgs*> pointers;
  for (const ForwardArgs& call : calls) pointers.push_back(&call);
  const std::vector<at::Tensor> fused = qwen->forward_batch(pointers);
  ASSERT_EQ(fused.size(), calls.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    const at::Tensor alone = qwen->forward(calls[i]);
    if (kernels::enabled()) {
      EXPECT_TRUE(at::equal(fused[i], alone)) << "call " << i << ": max |diff| " << max_abs_diff(fused[i], alone);
    } else {
      EXPECT_LE(max_abs_diff(fused[i], alone), 1e-5) << "call " << i;
    }
  }
}

TEST_P(ForwardBatchTest, ACallWithImagesOrWithoutACacheRunsOnItsOwnWithTheSameLogits) {
  QwenVl model(config(), 6);
  auto a = cached(model, {{1, 2, 3, 4}});
  const VisionInputs vision = make_vision(config(), {{1, 4, 4}}, 3);
  ForwardArgs with_image;
  const std::vector<int64_t> prompt = image_prompt({5, 6}, 4, {7});
  const int64_t n = static_cast<int64_t>(prompt.size());
  with_image.input_ids = at::tensor(prompt, at::kLong).view({1, n});
  with_image.position_ids =
      model.plan_positions(with_image.input_ids, at::ones({1, n}, at::kLong), vision).prompt_positions;
  with_image.attention_mask = at::ones({1, n}, at::kLong);
  with_image.vision = vision;
  with_image.images = {0};
  const ForwardArgs text = window_after(*a, {{9}}, true);
  const at::Tensor image_alone = model.forward(with_image);
  const at::Tensor text_alone = model.forward(text);
  const std::vector<at::Tensor> both = model.forward_batch({&text, &with_image});
  EXPECT_LE(max_abs_diff(both[0], text_alone), 1e-5);
  EXPECT_LE(max_abs_diff(both[1], image_alone), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Families, ForwardBatchTest,
                         ::testing::Values(QwenFamily::kQwen2Vl, QwenFamily::kQwen2_5Vl, QwenFamily::kQwen3Vl));

// Ten requests (text, an image, two rows, greedy and sampled) through the engine, their decode
// steps fused, against the Generator alone, over a KV cache of `kv_dtype`.
void expect_engine_tokens_equal_the_generators(at::ScalarType kv_dtype) {
  QwenVlConfig config = test_config();
  QwenVl model(config, 17);
  model.set_kv_cache_dtype(kv_dtype);
  struct Case {
    GenerateRequest request;
    GenerationConfig config;
  };
  std::vector<Case> all;
  for (int i = 0; i < 10; ++i) {
    std::vector<int64_t> text;
    for (int k = 0; k < 3 + (i * 5) % 17; ++k) text.push_back((i * 11 + k * 7) % 80);
    Case c;
    if (i % 3 == 1) {
      c.request = make_request({image_prompt(text, 4, {6, 7})}, make_vision(config, {{1, 4, 4}}, 50 + i));
    } else if (i == 5) {  // two rows
      c.request = make_request({text, std::vector<int64_t>(text.rbegin(), text.rend())}, {});
    } else {
      c.request = make_request({text}, {});
    }
    c.config.max_new_tokens(3 + i % 6);
    if (i % 2 == 1) c.config.temperature(0.9).top_p(0.95).seed(static_cast<uint64_t>(300 + i));
    all.push_back(std::move(c));
  }
  std::vector<GenerationResult> expected;
  for (const Case& c : all) expected.push_back(Generator(model).generate(c.request, c.config));

  testing::ForwardSpy spy(model);
  std::vector<std::shared_ptr<RequestHandle>> handles;
  {
    Engine engine(spy, EngineOptions().max_running(8));
    // Request 0's first token waits until every request is in, so that they decode together.
    std::atomic<int> submitted{0};
    for (size_t i = 0; i < all.size(); ++i) {
      GenerateRequest request = all[i].request;
      if (i == 0) {
        request.on_token = [&submitted, n = static_cast<int>(all.size())](const TokenEvent&) {
          while (submitted.load() < n) std::this_thread::yield();
          return true;
        };
      }
      handles.push_back(engine.submit(request, all[i].config));
      ++submitted;
    }
    for (size_t i = 0; i < all.size(); ++i) {
      const GenerationResult got = handles[i]->wait();
      ASSERT_EQ(got.sequences.size(), expected[i].sequences.size());
      for (size_t r = 0; r < got.sequences.size(); ++r) {
        EXPECT_EQ(got.sequences[r].tokens, expected[i].sequences[r].tokens) << "request " << i << " row " << r;
      }
    }
    const EngineMetrics m = engine.metrics();
    EXPECT_EQ(m.finished, 10);
    EXPECT_GE(m.max_decode_batch, 4);  // decode steps were fused
    EXPECT_GT(m.decode_batches, 0);
  }
  // The span rule under fusion: a batched call is a decode window over a KV cache and carries
  // no image; the image requests' prefills carried theirs.
  int64_t batched = 0, prefills_with_images = 0;
  for (const testing::ForwardCall& call : spy.calls()) {
    if (call.batch_group >= 0) {
      ++batched;
      EXPECT_TRUE(call.had_context);
      EXPECT_FALSE(call.has_any_vision());
      EXPECT_GT(call.step, 0);
    } else if (call.step == 0 && call.has_any_vision()) {
      ++prefills_with_images;
    }
  }
  EXPECT_GT(batched, 0);
  EXPECT_EQ(prefills_with_images, 3);
}

TEST(EngineOnQwenVl, FusedDecodeStepsGiveEveryRequestTheTokensOfTheGeneratorAlone) {
  expect_engine_tokens_equal_the_generators(at::kFloat);
}

// A bfloat16 KV cache: the engine allocates it (half the bytes a column) and its fused steps read
// it as the Generator's calls do.
TEST(EngineOnQwenVl, WithABfloat16KvCacheTheRequestsGetTheGeneratorsTokens) {
  expect_engine_tokens_equal_the_generators(at::kBFloat16);
  QwenVl model(test_config(), 17);
  const int64_t f32_blocks = Engine(model, EngineOptions()).metrics().kv_blocks_total;
  model.set_kv_cache_dtype(at::kBFloat16);
  EXPECT_GT(f32_blocks, 0);
  EXPECT_EQ(Engine(model, EngineOptions()).metrics().kv_blocks_total, 2 * f32_blocks);  // the same budget
}

// An FP8 KV cache: the engine allocates it (68 bytes a row of 64 against 256) and its fused steps
// read it as the Generator's calls do.
TEST(EngineOnQwenVl, WithAnFp8KvCacheTheRequestsGetTheGeneratorsTokens) {
  expect_engine_tokens_equal_the_generators(at::kByte);
  QwenVl model(test_config(), 17);
  const int64_t f32_blocks = Engine(model, EngineOptions()).metrics().kv_blocks_total;
  model.set_kv_cache_dtype(at::kByte);
  const int64_t d = model.traits().kv_cache.head_dim;
  EXPECT_NEAR(Engine(model, EngineOptions()).metrics().kv_blocks_total,
              static_cast<double>(f32_blocks) * 4 * d / (d + 4), 1.0);  // the same budget
}

}  // namespace
}  // namespace vlmgen
