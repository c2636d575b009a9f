// The Qwen2-VL model on the tiny test config: traits, weights, cached and batched forwards, M-RoPE
// positions, images, config checks. HF parity and checkpoints are in qwen2_vl_hf_test.cpp, the
// generator in qwen2_vl_generator_test.cpp.

#include "vlmgen/models/qwen2_vl.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "qwen2_vl_test_util.h"
#include "qwen_test_util.h"
#include "vlmgen/error.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/positions.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)
using qwen2_vl_test::kBatchTolerance;
using qwen2_vl_test::kCacheTolerance;

using ::testing::AllOf;
using ::testing::HasSubstr;

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

}  // namespace
}  // namespace vlmgen
