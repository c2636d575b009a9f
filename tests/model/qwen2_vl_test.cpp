#include "vlmgen/models/qwen2_vl.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "qwen_test_util.h"
#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/positions.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// Tolerances, measured on this build (fp32, CPU, LibTorch 1.13) and kept well above what was
// seen so other BLAS builds do not flake, yet far below the effect of the bugs these tests were
// checked to catch (a padding key attended, a causal offset of one, a swapped rotary layout).
constexpr double kCacheTolerance = 1e-5;   // incremental vs full forward: measured max 2.1e-7
constexpr double kBatchTolerance = 1e-5;   // row in a padded batch vs alone: measured max 2.1e-7
constexpr double kReplayTolerance = 1e-5;  // no-cache prompt logits, step k vs step 0: measured max 1.8e-7
// Projections of logits (|value| < 5) against the PyTorch transcription printed to 7 significant
// digits: measured max 3.7e-6, mostly the printing.
constexpr double kParityTolerance = 2e-5;

class Qwen2VlTest : public ::testing::Test {
 protected:
  QwenVlConfig config_ = test_config();
  Qwen2Vl model_{config_, /*seed=*/7};
};

TEST_F(Qwen2VlTest, TraitsDescribeTheConfig) {
  const ModelTraits& t = model_.traits();
  EXPECT_EQ(t.vocab_size, 96);
  EXPECT_EQ(t.image_token_id, kImage);
  EXPECT_EQ(t.video_token_id, 91);
  EXPECT_EQ(t.spatial_merge_size, 2);
  EXPECT_EQ(t.vision_layout, VisionLayout::kPatchFlattened);
  EXPECT_TRUE(t.supports_kv_cache);
  EXPECT_TRUE(t.kv_cache_under_sequence_parallel);
  EXPECT_EQ(t.max_sequence_length, 512);
  EXPECT_EQ(t.kv_cache.num_layers, 2);
  EXPECT_EQ(t.kv_cache.num_kv_heads, 2);
  EXPECT_EQ(t.kv_cache.head_dim, 16);
  EXPECT_EQ(t.kv_cache.dtype, at::kFloat);
  EXPECT_TRUE(model_.can_encode_images());
}

TEST_F(Qwen2VlTest, SameSeedSameWeightsOtherSeedOtherWeights) {
  Qwen2Vl same(config_, 7);
  Qwen2Vl other(config_, 8);
  auto a = model_.named_weights();
  auto b = same.named_weights();
  auto c = other.named_weights();
  ASSERT_EQ(a.size(), b.size());
  bool any_differs = false;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(a[i].second->equal(*b[i].second)) << a[i].first;
    any_differs = any_differs || !a[i].second->equal(*c[i].second);
  }
  EXPECT_TRUE(any_differs);
}

TEST_F(Qwen2VlTest, NamedWeightsUseHfNamesAndShapes) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, t] : model_.named_weights()) shapes[name] = t->sizes().vec();
  const std::map<std::string, std::vector<int64_t>> expected = {
      {"visual.patch_embed.proj.weight", {32, 3, 2, 2, 2}},
      {"visual.blocks.1.norm1.weight", {32}},
      {"visual.blocks.1.norm2.bias", {32}},
      {"visual.blocks.0.attn.qkv.weight", {96, 32}},
      {"visual.blocks.0.attn.qkv.bias", {96}},
      {"visual.blocks.0.attn.proj.weight", {32, 32}},
      {"visual.blocks.0.mlp.fc1.weight", {64, 32}},
      {"visual.blocks.0.mlp.fc2.weight", {32, 64}},
      {"visual.merger.ln_q.weight", {32}},
      {"visual.merger.mlp.0.weight", {128, 128}},
      {"visual.merger.mlp.2.weight", {64, 128}},
      {"visual.merger.mlp.2.bias", {64}},
      {"model.embed_tokens.weight", {96, 64}},
      {"model.layers.1.self_attn.q_proj.weight", {64, 64}},
      {"model.layers.1.self_attn.q_proj.bias", {64}},
      {"model.layers.1.self_attn.k_proj.weight", {32, 64}},
      {"model.layers.1.self_attn.v_proj.bias", {32}},
      {"model.layers.1.self_attn.o_proj.weight", {64, 64}},
      {"model.layers.0.mlp.gate_proj.weight", {96, 64}},
      {"model.layers.0.mlp.up_proj.weight", {96, 64}},
      {"model.layers.0.mlp.down_proj.weight", {64, 96}},
      {"model.layers.0.input_layernorm.weight", {64}},
      {"model.layers.0.post_attention_layernorm.weight", {64}},
      {"model.norm.weight", {64}},
      {"lm_head.weight", {96, 64}},
  };
  for (const auto& [name, shape] : expected) {
    ASSERT_EQ(shapes.count(name), 1u) << name;
    EXPECT_EQ(shapes[name], shape) << name;
  }
  EXPECT_EQ(shapes.count("model.layers.0.self_attn.o_proj.bias"), 0u);
  EXPECT_EQ(shapes.count("model.layers.0.mlp.gate_proj.bias"), 0u);
  // 2 vision blocks x 12 + patch embed + merger 6; 2 layers x 12 + embed + norm + head.
  EXPECT_EQ(shapes.size(), 2u * 12 + 1 + 6 + 2 * 12 + 3);
}

TEST_F(Qwen2VlTest, IncrementalDecodingMatchesFullForward) {
  // Two left-padded rows, each with its own image, then 5 tokens fed one at a time; with a
  // float32 cache against the forward without one, and with a bfloat16 cache against one
  // forward of every column into such a cache (its queries see the rounded keys and values too).
  VisionInputs vision = make_vision(config_, {{1, 4, 4}, {1, 4, 8}}, 11);
  std::vector<std::vector<int64_t>> prompts = {image_prompt({1, 2, 3, 4, 5}, 4, {6, 7}),
                                               image_prompt({9}, 8, {10, 11, 12})};
  Batch prompt = left_pad(prompts);
  const int64_t len = prompt.ids.size(1);
  const int64_t extra = 5;
  const int64_t total = len + extra;
  Batch all{at::cat({prompt.ids, at::arange(20, 20 + extra, at::kLong).repeat({2, 1})}, 1),
            at::cat({prompt.mask, at::ones({2, extra}, at::kLong)}, 1), prompt.pads};
  RopePlan plan = model_.plan_positions(prompt.ids, prompt.mask, vision);
  at::Tensor positions = extend_positions(plan, prompt.pads, total);

  ForwardArgs full;
  full.input_ids = all.ids;
  full.attention_mask = all.mask;
  full.position_ids = positions;
  full.vision = vision;
  const at::Tensor without_cache = model_.forward(full);  // [2, total, vocab]
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kByte}) {
    SCOPED_TRACE(c10::toString(dtype));
    const std::string cache = dtype == at::kByte ? "FP8 cache" : "bfloat16 cache";
    model_.set_kv_cache_dtype(dtype);
    at::Tensor expected = without_cache;
    InferenceContext whole(model_.traits().kv_cache, 2, total);
    double rounding = 0.0;  // what the cache's rounding itself moves
    if (dtype != at::kFloat) {
      full.context = &whole;
      expected = model_.forward(full);
      rounding = max_abs_diff(expected, without_cache);
      report((cache + ": one cached forward vs the forward without a cache, max|diff|").c_str(), rounding);
      EXPECT_GT(rounding, 1e-4) << "the cache was not rounded";
    }
    InferenceContext ctx(model_.traits().kv_cache, 2, total);
    std::vector<at::Tensor> pieces;
    for (int64_t start = 0; start < total;) {
      const int64_t end = start == 0 ? len : start + 1;
      ForwardArgs args;
      args.input_ids = all.ids.narrow(1, start, end - start);
      args.attention_mask = all.mask.narrow(1, 0, end);
      args.position_ids = positions.narrow(-1, start, end - start);
      args.context = &ctx;
      args.window_start = start;
      if (start == 0) args.vision = vision;
      pieces.push_back(model_.forward(args));
      EXPECT_EQ(ctx.length(), start) << "the model must not commit";
      ctx.commit(args.input_ids, all.mask.narrow(1, start, end - start));
      start = end;
    }
    at::Tensor incremental = at::cat(pieces, 1);
    // Only real columns carry meaning; padding query rows are ignored by every consumer.
    at::Tensor real = all.mask.to(at::kBool).unsqueeze(-1);
    const double diff = max_abs_diff(expected.masked_fill(~real, 0), incremental.masked_fill(~real, 0));
    const std::string what = dtype == at::kFloat ? "incremental vs full forward max|diff|"
                                                 : cache + ": incremental vs one cached forward max|diff|";
    report(what.c_str(), diff);
    // bfloat16 rounding is a step function: last-bit differences between the calls can flip a
    // key's rounding (a 2^-9 change), so that bound is looser, still 5x below the rounding's own.
    // FP8's steps are 2^-3 of a row's largest binade: a flip moves one element by that, so the
    // bound is a fifth of what rounding every element moves.
    EXPECT_LE(diff, dtype == at::kFloat ? kCacheTolerance : dtype == at::kBFloat16 ? 2e-4 : 0.2 * rounding);
    EXPECT_FALSE(incremental.isnan().any().item<bool>());
    EXPECT_FALSE(expected.isnan().any().item<bool>()) << "padding query rows must not produce NaN";
  }
  model_.set_kv_cache_dtype(at::kFloat);
}

TEST_F(Qwen2VlTest, APromptOfManyTokensGivesTheLogitsOfTheSamePromptInShortWindows) {
  // 480 tokens in one window (within the config's 512 positions): the MLP runs over 128, 128 and
  // 224 rows (windows of 256 rows or more); windows of 160 tokens over a KV cache run it in one
  // pass. Every column's logits agree.
  ASSERT_GE(config_.max_position_embeddings, 480);
  const int64_t total = 480, window = 160;
  const at::Tensor ids = at::randint(1, 90, {1, total}, at::kLong);
  const at::Tensor positions = at::arange(total, at::kLong).view({1, 1, total}).expand({3, 1, total}).contiguous();
  auto run = [&](int64_t window) {
    InferenceContext ctx(model_.traits().kv_cache, 1, total);
    std::vector<at::Tensor> pieces;
    for (int64_t start = 0; start < total; start += window) {
      ForwardArgs args;
      args.input_ids = ids.narrow(1, start, window);
      args.attention_mask = at::ones({1, start + window}, at::kLong);
      args.position_ids = positions.narrow(-1, start, window);
      args.context = &ctx;
      args.window_start = start;
      pieces.push_back(model_.forward(args));
      ctx.commit(args.input_ids, at::ones({1, window}, at::kLong));
    }
    return at::cat(pieces, 1);
  };
  const at::Tensor whole = run(total), windows = run(window);
  ASSERT_EQ(whole.sizes(), windows.sizes());
  const double diff = max_abs_diff(whole, windows);
  report("480-token window vs three of 160, max|diff|", diff);
  EXPECT_LE(diff, kCacheTolerance);
  EXPECT_GT(whole.abs().max().item<double>(), 0.1);
}

TEST_F(Qwen2VlTest, PaddedBatchRowsMatchRowsAlone) {
  VisionInputs vision = make_vision(config_, {{1, 4, 4}, {1, 4, 8}}, 21);
  std::vector<std::vector<int64_t>> prompts = {image_prompt({1, 2, 3, 4, 5, 6, 7, 8, 9}, 4, {6, 7}),
                                               image_prompt({9}, 8, {10})};
  Batch batch = left_pad(prompts);
  at::Tensor together = full_forward(model_, batch, vision);
  double worst = 0.0;
  for (int64_t r = 0; r < 2; ++r) {
    Batch alone = left_pad({prompts[r]});
    at::Tensor own = full_forward(model_, alone, vision.select({r}));
    const int64_t n = alone.ids.size(1);
    at::Tensor in_batch = together[r].narrow(0, batch.pads[r], n);
    worst = std::max(worst, max_abs_diff(in_batch, own[0]));
  }
  report("row in padded batch vs alone max|diff|", worst);
  EXPECT_LE(worst, kBatchTolerance);
}

TEST_F(Qwen2VlTest, ImagesChangeTheLogitsAndOrderMatters) {
  // Guards the tests above against a model that ignores its images.
  VisionInputs a = make_vision(config_, {{1, 4, 4}}, 31);
  VisionInputs b = make_vision(config_, {{1, 4, 4}}, 32);
  Batch batch = left_pad({image_prompt({1, 2}, 4, {3})});
  at::Tensor with_a = full_forward(model_, batch, a);
  at::Tensor with_b = full_forward(model_, batch, b);
  ForwardArgs no_vision;
  no_vision.input_ids = batch.ids;
  no_vision.attention_mask = batch.mask;
  no_vision.position_ids = model_.plan_positions(batch.ids, batch.mask, a).prompt_positions;
  at::Tensor placeholders_as_text = model_.forward(no_vision);
  EXPECT_GT(max_abs_diff(with_a, with_b), 1e-3);
  EXPECT_GT(max_abs_diff(with_a, placeholders_as_text), 1e-3);
}

TEST_F(Qwen2VlTest, PlanPositionsFollowsTheMropeRule) {
  // Row 0: three text tokens, left-padded by 8. Row 1: text, <vs>, a (1,4,4) image merged 2x2
  // into 4 placeholders, <ve>, text.
  const std::vector<int64_t> row1 = image_prompt({1, 2, 3}, 4, {4, 5});
  Batch batch = left_pad({{7, 8, 9}, row1});
  ASSERT_EQ(batch.ids.size(1), 11);
  RopePlan plan = model_.plan_positions(batch.ids, batch.mask, make_vision(config_, {{1, 4, 4}}, 1));
  // By hand. Row 1: text 1 2 3 <vs> -> 0..3; the image starts at 4 and spans merged (t, h, w)
  // = (1, 2, 2): (4,4,4) (4,4,5) (4,5,4) (4,5,5); text resumes at max + 1 = 6: <ve> 4 5 -> 6 7 8.
  const std::vector<int64_t> t1 = {0, 1, 2, 3, 4, 4, 4, 4, 6, 7, 8};
  const std::vector<int64_t> h1 = {0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 8};
  const std::vector<int64_t> w1 = {0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8};
  // Row 0: padding columns hold 1, text counts 0 1 2 on every axis.
  const std::vector<int64_t> r0 = {1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2};
  at::Tensor expected =
      at::stack({at::stack({at::tensor(r0), at::tensor(t1)}), at::stack({at::tensor(r0), at::tensor(h1)}),
                 at::stack({at::tensor(r0), at::tensor(w1)})});
  ASSERT_EQ(plan.prompt_positions.sizes(), (std::vector<int64_t>{3, 2, 11}));
  EXPECT_EQ(plan.prompt_positions.scalar_type(), at::kLong);
  EXPECT_TRUE(plan.prompt_positions.equal(expected.to(at::kLong))) << plan.prompt_positions;
  // delta = (max position + 1) - real tokens: row 0: 3 - 3 = 0; row 1: 9 - 11 = -2.
  EXPECT_EQ(plan.delta, (std::vector<int64_t>{0, -2}));
}

TEST_F(Qwen2VlTest, PlanPositionsRejectsPlaceholdersThatDisagreeWithTheBundle) {
  Batch batch = left_pad({image_prompt({1}, 4, {2})});
  // A (1, 4, 8) image needs 8 placeholders, the prompt has 4.
  EXPECT_THAT(
      [&] {
        model_.plan_positions(batch.ids, batch.mask, make_vision(config_, {{1, 4, 8}}, 1));
      },
      ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("hold 4 image placeholder tokens"), HasSubstr("need 8"))));
  // Two images in the bundle, one placeholder run in the prompt.
  EXPECT_THAT(
      [&] {
        model_.plan_positions(batch.ids, batch.mask, make_vision(config_, {{1, 4, 4}, {1, 4, 4}}, 1));
      },
      ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("hold 4 image placeholder tokens"), HasSubstr("2 images"))));
}

TEST_F(Qwen2VlTest, PlaceholderCountMismatchIsAnError) {
  Batch batch = left_pad({image_prompt({1, 2}, 4, {3})});
  VisionInputs eight = make_vision(config_, {{1, 4, 8}}, 41);  // 8 embedding rows
  ForwardArgs args;
  args.input_ids = batch.ids;
  args.attention_mask = batch.mask;
  args.position_ids = plan_1d_positions(batch.mask).prompt_positions;
  args.vision = eight;
  EXPECT_THAT(
      [&] { model_.forward(args); },
      ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("4 image placeholder tokens"), HasSubstr("8 embedding rows"))));
  EXPECT_EQ(model_.vision_tower_calls(), 0) << "the counts are compared before the tower runs";

  args.vision = VisionInputs();
  args.image_embeddings = at::zeros({5, 64});
  EXPECT_THAT(
      [&] { model_.forward(args); },
      ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("4 image placeholder tokens"), HasSubstr("5 embedding rows"))));

  // Text only, with vision sent: 0 placeholders against 4 rows.
  Batch text = left_pad({{1, 2, 3}});
  ForwardArgs text_args;
  text_args.input_ids = text.ids;
  text_args.attention_mask = text.mask;
  text_args.position_ids = plan_1d_positions(text.mask).prompt_positions;
  text_args.vision = make_vision(config_, {{1, 4, 4}}, 42);
  EXPECT_THAT([&] { model_.forward(text_args); },
              ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("0 image placeholder"), HasSubstr("4 embedding rows"))));

  // Still usable afterwards.
  args.image_embeddings = at::Tensor();
  args.vision = make_vision(config_, {{1, 4, 4}}, 43);
  EXPECT_NO_THROW(model_.forward(args));
}

TEST_F(Qwen2VlTest, EncodedImagesGiveTheSameLogitsAsPixels) {
  VisionInputs vision = make_vision(config_, {{1, 4, 4}, {1, 8, 4}}, 51);
  Batch batch = left_pad({image_prompt({1, 2}, 4, {3}), image_prompt({4}, 8, {5, 6})});
  at::Tensor from_pixels = full_forward(model_, batch, vision);
  EXPECT_EQ(model_.vision_tower_calls(), 1);

  at::Tensor embeddings = model_.encode_images(vision);
  EXPECT_EQ(model_.vision_tower_calls(), 2);
  ASSERT_EQ(embeddings.sizes(), (std::vector<int64_t>{12, 64}));
  // Image by image gives the same rows: attention never crosses images.
  at::Tensor first = model_.encode_images(vision.select({0}));
  at::Tensor second = model_.encode_images(vision.select({1}));
  EXPECT_LE(max_abs_diff(at::cat({first, second}), embeddings), 1e-6);

  ForwardArgs args;
  args.input_ids = batch.ids;
  args.attention_mask = batch.mask;
  args.position_ids = model_.plan_positions(batch.ids, batch.mask, vision).prompt_positions;
  args.vision = vision;  // must be ignored in favour of the embeddings
  args.image_embeddings = embeddings;
  const int64_t calls = model_.vision_tower_calls();
  at::Tensor from_embeddings = model_.forward(args);
  EXPECT_EQ(model_.vision_tower_calls(), calls) << "embeddings given: the tower must not run";
  EXPECT_TRUE(from_embeddings.equal(from_pixels));
}

TEST_F(Qwen2VlTest, ImageEmbeddingsAreMergeWindowsOfTheRotaryOrder) {
  // A 4x4 image whose patches are permuted inside each 2x2 window gives different embeddings:
  // the tower sees positions, so the merge-window order of the rows matters.
  VisionInputs vision = make_vision(config_, {{1, 4, 4}}, 61);
  at::Tensor swapped_pixels = vision.pixel_values.clone();
  swapped_pixels[0].copy_(vision.pixel_values[1]);
  swapped_pixels[1].copy_(vision.pixel_values[0]);
  VisionInputs swapped = VisionInputs::patch_flattened(swapped_pixels, vision.image_grid_thw);
  EXPECT_GT(max_abs_diff(model_.encode_images(vision), model_.encode_images(swapped)), 1e-4);
}

TEST(Qwen2VlConfigTest, HeadDimIndependentOfHiddenOverHeads) {
  QwenVlConfig config = test_config();
  config.head_dim = 32;  // hidden 64 / 4 heads would be 16
  config.mrope_section = {4, 6, 6};
  Qwen2Vl model(config, 3);
  EXPECT_EQ(model.traits().kv_cache.head_dim, 32);
  EXPECT_EQ(model.language_model().layers[0].q_proj.weight.sizes(), (std::vector<int64_t>{128, 64}));
  EXPECT_EQ(model.language_model().layers[0].k_proj.weight.sizes(), (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(model.language_model().layers[0].o_proj.weight.sizes(), (std::vector<int64_t>{64, 128}));

  VisionInputs vision = make_vision(config, {{1, 4, 4}}, 5);
  Batch batch = left_pad({image_prompt({1, 2}, 4, {3, 4})});
  at::Tensor full = full_forward(model, batch, vision);
  InferenceContext ctx(model.traits().kv_cache, 1, batch.ids.size(1));
  ForwardArgs prefill;
  const int64_t split = batch.ids.size(1) - 1;
  RopePlan plan = model.plan_positions(batch.ids, batch.mask, vision);
  prefill.input_ids = batch.ids.narrow(1, 0, split);
  prefill.attention_mask = batch.mask.narrow(1, 0, split);
  prefill.position_ids = plan.prompt_positions.narrow(-1, 0, split);
  prefill.vision = vision;
  prefill.context = &ctx;
  at::Tensor first = model.forward(prefill);
  ctx.commit(prefill.input_ids, prefill.attention_mask);
  ForwardArgs last;
  last.input_ids = batch.ids.narrow(1, split, 1);
  last.attention_mask = batch.mask;
  last.position_ids = plan.prompt_positions.narrow(-1, split, 1);
  last.context = &ctx;
  last.window_start = split;
  at::Tensor second = model.forward(last);
  EXPECT_LE(max_abs_diff(at::cat({first, second}, 1), full), kCacheTolerance);
}

TEST(Qwen2VlConfigTest, BadConfigsAreRejectedWithTheNumbers) {
  QwenVlConfig config = test_config();
  config.mrope_section = {2, 3, 4};
  EXPECT_THAT([&] { Qwen2Vl m(config, 0); },
              ::testing::ThrowsMessage<Error>(AllOf(HasSubstr("mrope_section"), HasSubstr("sums to 9"))));
  config = test_config();
  config.num_key_value_heads = 3;
  EXPECT_THAT([&] { Qwen2Vl m(config, 0); }, ::testing::ThrowsMessage<Error>(HasSubstr("num_key_value_heads 3")));
  config = test_config();
  config.vision.hidden_size = 32;
  EXPECT_THAT([&] { Qwen2Vl m(config, 0); },
              ::testing::ThrowsMessage<Error>(HasSubstr("vision_config.hidden_size 32")));
}

// ---------------------------------------------------------------------------------------------
// Parity with HF transformers' Qwen2-VL
//
// The golden numbers below come from an independent PyTorch transcription of HF
// modeling_qwen2_vl.py (Conv3d patch embedding, rot_pos_emb, cu_seqlens vision attention,
// PatchMerger, get_rope_index, Qwen2VLRotaryEmbedding + apply_multimodal_rotary_pos_emb,
// repeat_kv, the 4-D causal mask, Qwen2RMSNorm, Qwen2MLP) run in fp32 on the same weights:
// every tensor is filled from a hash of its HF name, so no checkpoint is needed. They pin the
// formulas (rotary layouts, merge order, section split, positions) that self-consistency tests
// such as cache-vs-no-cache cannot see.

// The expected numbers below come from tests/model/reference/qwen2_vl_reference.py, an
// independent PyTorch transcription of HF's Qwen2-VL (run it with python3 + Debian's
// python3-torch to regenerate them), never from this C++ code.
TEST(Qwen2VlHfParityTest, LogitsEmbeddingsAndPositionsMatchHfTranscription) {
  // Row 0: text, a (1,4,4) image, text, a two-frame (2,4,4) image, text. Row 1, left-padded by 9:
  // text, a (1,4,8) image, text.
  QwenVlConfig config = test_config();
  Qwen2Vl model(config, 0);
  fill_hashed_weights(model);
  const std::vector<int64_t> row0 = image_prompt(image_prompt({1, 2, 3}, 4, {4, 5}), 8, {6});
  const std::vector<int64_t> row1 = image_prompt({7}, 8, {8, 9});
  Batch batch = left_pad({row0, row1});
  ASSERT_EQ(batch.ids.size(1), 22);
  const int64_t rows = 16 + 32 + 32;
  VisionInputs vision = VisionInputs::patch_flattened(
      hashed_tensor(rows * patch_dim(config), 1000, 1.0).view({rows, patch_dim(config)}),
      at::tensor(std::vector<int64_t>{1, 4, 4, 2, 4, 4, 1, 4, 8}, at::kLong).view({3, 3}));

  // HF get_rope_index on the same prompt.
  const std::vector<int64_t> t0 = {0, 1, 2, 3, 4, 4, 4, 4, 6, 7, 8, 9, 10, 10, 10, 10, 11, 11, 11, 11, 12, 13};
  const std::vector<int64_t> h0 = {0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 8, 9, 10, 10, 11, 11, 10, 10, 11, 11, 12, 13};
  const std::vector<int64_t> w0 = {0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9, 10, 11, 10, 11, 10, 11, 10, 11, 12, 13};
  const std::vector<int64_t> t1 = {1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 6, 7, 8};
  const std::vector<int64_t> h1 = {1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 6, 7, 8};
  const std::vector<int64_t> w1 = {1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7, 8};
  at::Tensor hf_positions =
      at::stack({at::stack({at::tensor(t0), at::tensor(t1)}), at::stack({at::tensor(h0), at::tensor(h1)}),
                 at::stack({at::tensor(w0), at::tensor(w1)})});
  RopePlan plan = model.plan_positions(batch.ids, batch.mask, vision);
  EXPECT_TRUE(plan.prompt_positions.equal(hf_positions.to(at::kLong))) << plan.prompt_positions;
  // HF's deltas (-8, -13) are against the padded length; RopePlan's against the real tokens.
  EXPECT_EQ(plan.delta, (std::vector<int64_t>{-8, -13 + 9}));

  const std::vector<double> kEmbeddingProjection = {-1.97335,    0.3388586,  -0.9395756, 1.143741,  0.3625345,
                                                    1.025446,    0.7207144,  -1.359594,  -1.038763, -0.1646353,
                                                    -0.09306031, 0.3654167,  -0.3896308, -1.098037, 1.575117,
                                                    -0.1846031,  -0.7017372, -0.9178553, 0.4726633, -0.0003033107};
  const std::vector<double> kLogitProjectionRow0 = {
      0.2853136,  0.3961991, 2.216877, 3.097401,   4.45696,   -0.04729189, 0.1297894,  -1.773901,
      0.7462976,  1.38364,   1.739641, 1.746724,   1.333765,  0.6142228,   0.08665251, -2.075671,
      -0.1980057, 2.431908,  1.347497, 0.06927121, 0.1067734, -1.526355};
  const std::vector<double> kLogitProjectionRow1 = {1.287049,  2.25303,     0.7801427, -0.4762253, -1.405766,
                                                    1.00197,   -0.01535936, -2.267184, 0.4514844,  -1.966756,
                                                    -1.942703, -0.2335647,  -0.1252035};
  const at::Tensor u_hidden = hashed_tensor(config.hidden_size, 4343, 1.0).to(at::kDouble);
  const at::Tensor u_vocab = hashed_tensor(config.vocab_size, 4242, 1.0).to(at::kDouble);

  at::Tensor embeddings = model.encode_images(vision);
  const double embed_diff = max_abs_diff_to(at::matmul(embeddings.to(at::kDouble), u_hidden), kEmbeddingProjection);
  at::Tensor logits = full_forward(model, batch, vision).to(at::kDouble);
  at::Tensor projected = at::matmul(logits, u_vocab);  // [2, 22]
  const double logit_diff = std::max(max_abs_diff_to(projected[0], kLogitProjectionRow0),
                                     max_abs_diff_to(projected[1].narrow(0, 9, 13), kLogitProjectionRow1));
  report("HF transcription parity, image embedding projection max|diff|", embed_diff);
  report("HF transcription parity, logit projection max|diff|", logit_diff);
  EXPECT_LE(embed_diff, kParityTolerance);
  EXPECT_LE(logit_diff, kParityTolerance);
}

// ---------------------------------------------------------------------------------------------
// Checkpoints

class Qwen2VlCheckpointTest : public ::testing::Test {
 protected:
  std::string dir(const std::string& name) const { return scratch_.dir(name); }
  static std::map<std::string, at::Tensor> read_all(const std::string& d) { return read_all_tensors(d); }
  static void write_checkpoint(const std::string& d, const QwenVlConfig& config,
                               const std::map<std::string, at::Tensor>& tensors) {
    write_checkpoint_dir(d, config.to_json(), tensors);
  }

  at::Tensor logits(Qwen2Vl& model) {
    Batch batch = left_pad({image_prompt({1, 2, 3}, 4, {4, 5}), image_prompt({6}, 4, {7})});
    return full_forward(model, batch, vision_);
  }

  ScratchDir scratch_;
  QwenVlConfig config_ = test_config();
  VisionInputs vision_ = make_vision(config_, {{1, 4, 4}, {1, 4, 4}}, 71);
};

TEST_F(Qwen2VlCheckpointTest, SaveThenLoadGivesIdenticalLogits) {
  Qwen2Vl model(config_, 9);
  model.save_checkpoint(dir("a"));
  EXPECT_TRUE(std::filesystem::exists(dir("a") + "/config.json"));
  auto loaded = Qwen2Vl::from_checkpoint(dir("a"));
  EXPECT_EQ(loaded->config(), model.config());
  EXPECT_FALSE(loaded->tied_embeddings());
  EXPECT_TRUE(logits(*loaded).equal(logits(model)));
  auto saved = read_all(dir("a"));
  EXPECT_EQ(saved.size(), model.named_weights().size());
  EXPECT_EQ(saved.count("lm_head.weight"), 1u);
}

TEST_F(Qwen2VlCheckpointTest, NewerHfSpellingLoadsTheSameModel) {
  Qwen2Vl model(config_, 9);
  model.save_checkpoint(dir("classic"));
  std::map<std::string, at::Tensor> renamed;
  for (auto& [name, t] : read_all(dir("classic"))) {
    std::string n = name;
    if (n.rfind("visual.", 0) == 0) {
      n = "model." + n;
    } else if (n.rfind("model.", 0) == 0) {
      n = "model.language_model." + n.substr(6);
    }
    renamed.emplace(n, t);
  }
  ASSERT_EQ(renamed.count("model.language_model.layers.0.self_attn.q_proj.weight"), 1u);
  ASSERT_EQ(renamed.count("model.visual.merger.mlp.0.weight"), 1u);
  write_checkpoint(dir("new"), model.config(), renamed);
  auto loaded = Qwen2Vl::from_checkpoint(dir("new"));
  EXPECT_TRUE(logits(*loaded).equal(logits(model)));
}

TEST_F(Qwen2VlCheckpointTest, CheckpointWithoutLmHeadLoadsTied) {
  QwenVlConfig tied_config = config_;
  tied_config.tie_word_embeddings = true;
  Qwen2Vl tied(tied_config, 4);
  EXPECT_TRUE(tied.tied_embeddings());
  EXPECT_TRUE(tied.language_model().lm_head.is_same(tied.language_model().embed_tokens));
  tied.save_checkpoint(dir("tied"));
  auto saved = read_all(dir("tied"));
  EXPECT_EQ(saved.count("lm_head.weight"), 0u);
  EXPECT_EQ(saved.count("model.embed_tokens.weight"), 1u);

  // The config claims an untied head, but the file has none: the embedding is the head.
  QwenVlConfig claims_untied = tied_config;
  claims_untied.tie_word_embeddings = false;
  write_checkpoint(dir("no_head"), claims_untied, saved);
  auto loaded = Qwen2Vl::from_checkpoint(dir("no_head"));
  EXPECT_TRUE(loaded->tied_embeddings());
  const qwen2_vl::LanguageModel& lm = loaded->language_model();
  EXPECT_EQ(lm.lm_head.data_ptr(), lm.embed_tokens.data_ptr()) << "tied: one copy of the matrix";
  for (const auto& [name, t] : loaded->named_weights()) EXPECT_NE(name, "lm_head.weight");
  EXPECT_TRUE(logits(*loaded).equal(logits(tied)));

  // Saving the loaded model writes it tied again.
  loaded->save_checkpoint(dir("again"));
  EXPECT_EQ(read_all(dir("again")).count("lm_head.weight"), 0u);
  EXPECT_TRUE(Qwen2Vl::from_checkpoint(dir("again"))->tied_embeddings());
}

TEST_F(Qwen2VlCheckpointTest, HalfPrecisionTensorsLoadAsFloat32) {
  Qwen2Vl model(config_, 9);
  model.save_checkpoint(dir("f32"));
  std::map<std::string, at::Tensor> half;
  bool bf16 = false;
  for (auto& [name, t] : read_all(dir("f32"))) {
    half.emplace(name, t.to(bf16 ? at::kBFloat16 : at::kHalf));
    bf16 = !bf16;
  }
  write_checkpoint(dir("half"), model.config(), half);
  auto loaded = Qwen2Vl::from_checkpoint(dir("half"));
  // The same rounding applied to the fp32 model gives the same logits.
  for (const auto& [name, t] : model.named_weights()) *t = half.at(name).to(at::kFloat);
  for (const auto& [name, t] : loaded->named_weights()) EXPECT_EQ(t->scalar_type(), at::kFloat) << name;
  EXPECT_TRUE(logits(*loaded).equal(logits(model)));
}

TEST_F(Qwen2VlCheckpointTest, MissingTensorsAreListedByName) {
  Qwen2Vl model(config_, 9);
  model.save_checkpoint(dir("full"));
  auto tensors = read_all(dir("full"));
  tensors.erase("model.layers.1.mlp.up_proj.weight");
  tensors.erase("visual.blocks.0.attn.qkv.bias");
  write_checkpoint(dir("partial"), model.config(), tensors);
  EXPECT_THAT([&] { Qwen2Vl::from_checkpoint(dir("partial")); },
              ::testing::ThrowsMessage<Error>(AllOf(
                  HasSubstr("lacks 2 of"), HasSubstr("model.layers.1.mlp.up_proj.weight"),
                  HasSubstr("visual.blocks.0.attn.qkv.bias"), Not(HasSubstr("model.layers.0.mlp.up_proj.weight")))));
}

TEST_F(Qwen2VlCheckpointTest, ShapeMismatchNamesBothShapes) {
  Qwen2Vl model(config_, 9);
  model.save_checkpoint(dir("full"));
  QwenVlConfig wider = config_;
  wider.intermediate_size = 128;
  write_checkpoint(dir("wider"), wider, read_all(dir("full")));
  EXPECT_THAT([&] { Qwen2Vl::from_checkpoint(dir("wider")); },
              ::testing::ThrowsMessage<Error>(
                  AllOf(HasSubstr("mlp.gate_proj.weight"), HasSubstr("[96, 64]"), HasSubstr("[128, 64]"))));
}

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
