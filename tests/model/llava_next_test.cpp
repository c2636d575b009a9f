// LLaVA-NeXT: parity with an independent PyTorch transcription of HF's modeling code (golden
// numbers in llava_next_golden.h), placeholder counts from image_sizes, the span rule on
// per-image tiles, step invariance, checkpoints.

#include "vlmgen/models/llava_next.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "llava_next_golden.h"
#include "qwen_test_util.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)
namespace golden = llava_next_test::golden;
using ::testing::HasSubstr;

constexpr double kParityTolerance = 2e-5;
constexpr double kCacheTolerance = 1e-5;
constexpr int64_t kImage = 90;

struct TestImage {
  int64_t key, height, width;
};
constexpr TestImage kA{1001, 10, 30}, kB{1002, 20, 12}, kC{1003, 20, 12}, kD{1004, 12, 20};

std::vector<int64_t> placeholders(int64_t count) { return std::vector<int64_t>(static_cast<size_t>(count), kImage); }

std::vector<int64_t> concat(std::initializer_list<std::vector<int64_t>> parts) {
  std::vector<int64_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// As the reference script fills them: norm weights 1 + U(-0.2, 0.2), position and class
// embeddings and image_newline U(-0.5, 0.5), the rest U(-0.1, 0.1).
void fill_hashed_weights(LlavaNext& model) {
  for (const auto& [weight_name, t] : model.named_weights()) {
    const std::string& name = weight_name;
    bool norm = false;
    for (const char* s : {"layernorm.weight", "layer_norm1.weight", "layer_norm2.weight", "pre_layrnorm.weight",
                          "post_layernorm.weight", "norm.weight"})
      norm = norm || ends_with(name, s);
    const bool wide = ends_with(name, "position_embedding.weight") || ends_with(name, "class_embedding") ||
                      ends_with(name, "image_newline");
    *t = hashed_tensor(t->numel(), name_key(name), norm ? 0.2 : wide ? 0.5 : 0.1, norm ? 1.0 : 0.0).view(t->sizes());
  }
}

// The reference's pixels: image K's tiles hashed(T * 3 * 8 * 8, K, 1.0), zero tiles after its own
// up to the batch's largest count (as transformers pads them).
VisionInputs hashed_images(const LlavaNextConfig& c, const std::vector<TestImage>& images) {
  std::vector<int64_t> tiles, sizes;
  for (const TestImage& im : images) {
    tiles.push_back(llava_next_grid(c, im.height, im.width).tiles());
    sizes.insert(sizes.end(), {im.height, im.width});
  }
  const int64_t most = *std::max_element(tiles.begin(), tiles.end());
  at::Tensor pixels = at::zeros({static_cast<int64_t>(images.size()), most, 3, 8, 8});
  for (size_t i = 0; i < images.size(); ++i) {
    pixels[static_cast<int64_t>(i)]
        .narrow(0, 0, tiles[i])
        .copy_(hashed_tensor(tiles[i] * 3 * 8 * 8, images[i].key, 1.0).view({tiles[i], 3, 8, 8}));
  }
  return VisionInputs::per_image(pixels, at::tensor(sizes, at::kLong).view({-1, 2}));
}

std::unique_ptr<LlavaNext> hashed_model(const LlavaNextConfig& config = LlavaNextConfig::tiny()) {
  auto model = std::make_unique<LlavaNext>(config, 0);
  fill_hashed_weights(*model);
  return model;
}

class LlavaNextTest : public ::testing::Test {
 protected:
  LlavaNextTest() : config_(LlavaNextConfig::tiny()), model_(hashed_model()) {}

  at::Tensor u_hidden() const { return hashed_tensor(64, 4343, 1.0).to(at::kDouble); }
  at::Tensor u_vocab() const { return hashed_tensor(96, 4242, 1.0).to(at::kDouble); }
  at::Tensor project(const at::Tensor& logits) const { return at::matmul(logits.to(at::kDouble), u_vocab()); }
  double embedding_error(const VisionInputs& vision, const std::vector<double>& golden) const {
    return max_abs_diff_to(at::matmul(model_->encode_images(vision).to(at::kDouble), u_hidden()), golden);
  }
  std::vector<int64_t> image(const TestImage& im) const {
    return placeholders(llava_next_placeholder_count(config_, im.height, im.width));
  }
  std::vector<std::vector<int64_t>> batch_rows() const {
    return {concat({{1, 3}, image(kA), {4}, image(kB), {5}}), concat({{1, 7}, image(kC), {8, 9}})};
  }
  VisionInputs batch_vision() const { return hashed_images(config_, {kA, kB, kC}); }
  std::vector<int64_t> turn1() const { return concat({{1, 9, 10, 11}, image(kA), {12}}); }
  std::vector<int64_t> turns_row() const { return concat({turn1(), {13}, image(kD), {14, 15}}); }

  double batch_logit_error(LlavaNext& model) const {
    Batch batch = left_pad(batch_rows());
    at::Tensor p = project(full_forward(model, batch, batch_vision()));
    const auto n0 = static_cast<int64_t>(batch_rows()[0].size()), n1 = static_cast<int64_t>(batch_rows()[1].size());
    return std::max(max_abs_diff_to(p[0].narrow(0, batch.pads[0], n0), golden::kBatchRow0),
                    max_abs_diff_to(p[1].narrow(0, batch.pads[1], n1), golden::kBatchRow1));
  }

  LlavaNextConfig config_;
  std::unique_ptr<LlavaNext> model_;
};

TEST_F(LlavaNextTest, PlaceholderCountsFromImageSizesEqualTheProcessorsTranscription) {
  EXPECT_EQ(llava_next_placeholder_count(config_, kA.height, kA.width), golden::kCountA);
  EXPECT_EQ(llava_next_placeholder_count(config_, kB.height, kB.width), golden::kCountB);
  EXPECT_EQ(llava_next_placeholder_count(config_, kD.height, kD.width), golden::kCountD);
  EXPECT_EQ(model_->placeholder_counts(batch_vision()),
            (std::vector<int64_t>{golden::kCountA, golden::kCountB, golden::kCountC}));
  // Hand-computed: 10x30 fits 8x24 best (1x3 tiles; 2x6 patches, all kept): 4 + 2 * (6 + 1).
  // 20x12 fits 16x16 (2x2 tiles; 4x4 patches, 2 of 4 columns kept after the padding): 4 + 4 * (2 + 1).
  EXPECT_EQ((select_best_resolution(10, 30, config_.image_grid_pinpoints)), (std::array<int64_t, 2>{8, 24}));
  EXPECT_EQ((select_best_resolution(20, 12, config_.image_grid_pinpoints)), (std::array<int64_t, 2>{16, 16}));
  const LlavaNextGrid g = llava_next_grid(config_, 20, 12);
  EXPECT_EQ(g.tiles(), 5);
  EXPECT_EQ(g.rows, 4);
  EXPECT_EQ(g.col_offset, 1);
  EXPECT_EQ(g.cols, 2);
}

TEST_F(LlavaNextTest, TextOnlyLogitsMatchHfTranscription) {
  Batch batch = left_pad({{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}});
  const double diff = max_abs_diff_to(project(full_forward(*model_, batch, VisionInputs()))[0], golden::kTextRow0);
  report("llava_next HF transcription parity, text-only logit projection max|diff|", diff);
  EXPECT_LE(diff, kParityTolerance);
}

TEST_F(LlavaNextTest, OneImageEmbeddingsAndLogitsMatchHfTranscription) {
  const VisionInputs vision = hashed_images(config_, {kA});
  const double embed = embedding_error(vision, golden::kOneImageEmbedding);
  Batch batch = left_pad({concat({{1, 5}, image(kA), {6, 7}})});
  const double logits = max_abs_diff_to(project(full_forward(*model_, batch, vision))[0], golden::kOneImageRow0);
  report("llava_next HF transcription parity, one image: embedding / logits max|diff|", std::max(embed, logits));
  EXPECT_LE(embed, kParityTolerance);
  EXPECT_LE(logits, kParityTolerance);
}

TEST_F(LlavaNextTest, ImagesOfDifferentAspectRatiosInARaggedBatchMatchHfTranscription) {
  // Row 0: a 1x3-tile image and a 2x2-tile one whose padding columns are cut; row 1 (left-padded):
  // another 2x2-tile image. pixel_values carry a zero padding tile for the 4-tile image.
  const double embed = embedding_error(batch_vision(), golden::kBatchEmbedding);
  const double logits = batch_logit_error(*model_);
  report("llava_next HF transcription parity, ragged batch: embedding / logits max|diff|", std::max(embed, logits));
  EXPECT_LE(embed, kParityTolerance);
  EXPECT_LE(logits, kParityTolerance);
}

TEST_F(LlavaNextTest, ContinuationWithANewImageMatchesHfTranscription) {
  const std::vector<int64_t> row = turns_row();
  const VisionInputs vision = hashed_images(config_, {kA, kD});
  Batch all = left_pad({row});
  const RopePlan plan = model_->plan_positions(all.ids, all.mask, vision);
  const auto split = static_cast<int64_t>(turn1().size());
  const int64_t len = all.ids.size(1);
  InferenceContext ctx(model_->traits().kv_cache, 1, len);
  std::vector<at::Tensor> pieces;
  for (const auto& [start, end, image] : {std::tuple<int64_t, int64_t, int64_t>{0, split, 0}, {split, len, 1}}) {
    ForwardArgs args;
    args.input_ids = all.ids.narrow(1, start, end - start);
    args.attention_mask = all.mask.narrow(1, 0, end);
    args.position_ids = plan.prompt_positions.narrow(1, start, end - start);
    args.context = &ctx;
    args.window_start = start;
    args.vision = vision.select({image});
    pieces.push_back(model_->forward(args));
    ctx.commit(args.input_ids, all.mask.narrow(1, start, end - start));
  }
  const double cached = max_abs_diff_to(project(at::cat(pieces, 1))[0], golden::kTurnsRow0);
  const double full = max_abs_diff_to(project(full_forward(*model_, all, vision))[0], golden::kTurnsRow0);
  const double embed = embedding_error(vision, golden::kTurnsEmbedding);
  report("llava_next HF transcription parity, continuation with a new image (KV) max|diff|", cached);
  EXPECT_LE(cached, kParityTolerance);
  EXPECT_LE(full, kParityTolerance);
  EXPECT_LE(embed, kParityTolerance);
}

TEST_F(LlavaNextTest, PlantedBugsMissTheGoldenNumbersByFar) {
  // image_newline zeroed (the rows kept), and the last CLIP layer instead of the one before.
  auto zeroed = hashed_model();
  zeroed->vision_tower().image_newline.zero_();
  const double newline = batch_logit_error(*zeroed);
  LlavaNextConfig last_layer = LlavaNextConfig::tiny();
  last_layer.vision_feature_layer = -1;
  const double layer = batch_logit_error(*hashed_model(last_layer));
  report("llava_next planted bug: image_newline zeroed, logit projection max|diff|", newline);
  report("llava_next planted bug: vision_feature_layer -1, logit projection max|diff|", layer);
  EXPECT_GT(newline, 50 * kParityTolerance);
  EXPECT_GT(layer, 50 * kParityTolerance);
}

TEST_F(LlavaNextTest, ImageSizesThatDisagreeWithThePlaceholdersAreRefusedNamingBothCounts) {
  // A's and B's sizes swapped: A's run of 18 placeholders now starts an image of 16 and the next
  // image (18) would begin inside the same run.
  VisionInputs swapped = batch_vision();
  swapped.image_sizes = at::tensor(std::vector<int64_t>{20, 12, 10, 30, 20, 12}, at::kLong).view({3, 2});
  Generator generator(*model_);
  try {
    generator.generate(make_request(batch_rows(), swapped), GenerationConfig().max_new_tokens(2));
    ADD_FAILURE() << "swapped image_sizes must be refused";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("needs 18 placeholder tokens but its run"));
  }
  // D (12x20: 14 placeholders) where the prompt holds A's 18.
  VisionInputs other = hashed_images(config_, {kD});
  try {
    generator.generate(make_request({concat({{1, 5}, image(kA), {6}})}, other), GenerationConfig().max_new_tokens(2));
    ADD_FAILURE() << "image_sizes giving another count must be refused";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("hold 18 image placeholder tokens"));
    EXPECT_THAT(e.what(), HasSubstr("need 14"));
  }
  // No image_sizes at all, and too few tiles for the sizes.
  VisionInputs no_sizes = VisionInputs::per_image(other.pixel_values);
  EXPECT_THROW(model_->placeholder_counts(no_sizes), Error);
  // Too few tiles for the second image's size: refused when the request is laid out, before the
  // first chunk (which holds only the first image) runs.
  VisionInputs few_tiles = hashed_images(config_, {kA, kA});
  few_tiles.image_sizes = at::tensor(std::vector<int64_t>{10, 30, 20, 12}, at::kLong).view({2, 2});
  testing::ForwardSpy spy(*model_);
  try {
    Generator(spy).generate(make_request({concat({{1, 5}, image(kA), {6, 7, 8}, image(kB), {9}})}, few_tiles),
                            GenerationConfig().max_new_tokens(2).prefill_chunk_size(22));
    ADD_FAILURE() << "4 tiles for a 5-tile image must be refused";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("image 1 of 20x12 (height x width) pixels takes 5 tiles"));
    EXPECT_THAT(e.what(), HasSubstr("pixel_values holds 4"));
  }
  EXPECT_EQ(spy.calls().size(), 0u) << "refused before any forward call";
  // The model stays usable.
  auto result = generator.generate(make_request(batch_rows(), batch_vision()), GenerationConfig().max_new_tokens(2));
  EXPECT_EQ(result.sequences[0].tokens.size(), 2u);
}

TEST_F(LlavaNextTest, GreedyTokensWithKvCacheEqualNoCacheAndChunkedAndTheTowerRunsOnce) {
  const GenerateRequest request = make_request(batch_rows(), batch_vision());
  const int64_t before = model_->vision_tower_calls();
  auto without = Generator(*model_).generate(request, GenerationConfig().max_new_tokens(8).enable_kv_cache(false));
  EXPECT_EQ(model_->vision_tower_calls(), before + 1);
  auto with_cache = Generator(*model_).generate(request, GenerationConfig().max_new_tokens(8));
  auto chunked = Generator(*model_).generate(request, GenerationConfig().max_new_tokens(8).prefill_chunk_size(5));
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(with_cache.sequences[r].tokens.size(), 8u);
    EXPECT_EQ(with_cache.sequences[r].tokens, without.sequences[r].tokens) << "row " << r;
    EXPECT_EQ(chunked.sequences[r].tokens, without.sequences[r].tokens) << "row " << r;
  }
}

TEST_F(LlavaNextTest, NoCachePromptLogitsAreStepInvariantAndStepZeroIsNot) {
  double agreement = 0.0;
  const double span_aware =
      prompt_logit_drift(*model_, batch_rows(), batch_vision(), ReplayMode::kSpanAware, &agreement);
  report("llava_next no-cache prompt logits, step k vs step 0 (span-aware) max|diff|", span_aware);
  EXPECT_LE(span_aware, kCacheTolerance);
  EXPECT_EQ(agreement, 1.0);
  const double step_zero = prompt_logit_drift(*model_, batch_rows(), batch_vision(), ReplayMode::kStepZero);
  report("llava_next no-cache prompt logits, step k vs step 0 (legacy step-zero) max|diff|", step_zero);
  EXPECT_GT(step_zero, 1e-3);
}

TEST_F(LlavaNextTest, CheckpointsRoundTripInBothSpellingsAndSixteenBit) {
  ScratchDir scratch;
  model_->save_checkpoint(scratch.dir("new"));
  auto loaded = load_model(scratch.dir("new"));
  auto* llava = dynamic_cast<LlavaNext*>(loaded.get());
  ASSERT_NE(llava, nullptr);
  EXPECT_LE(batch_logit_error(*llava), kParityTolerance);

  // transformers < 4.52 names: language_model.model.*, language_model.lm_head.weight,
  // vision_tower.*, multi_modal_projector.*, image_newline.
  std::map<std::string, at::Tensor> old;
  for (const auto& [name, tensor] : read_all_tensors(scratch.dir("new"))) {
    std::string renamed = name == "lm_head.weight"                      ? "language_model.lm_head.weight"
                          : name.rfind("model.language_model.", 0) == 0 ? "language_model.model." + name.substr(21)
                                                                        : name.substr(6);
    old.emplace(renamed, tensor.to(at::kBFloat16));
  }
  write_checkpoint_dir(scratch.dir("old"), config_.to_json(), old);
  LoadOptions options;
  options.weights_dtype = at::kBFloat16;
  auto bf16 = LlavaNext::from_checkpoint(scratch.dir("old"), ParallelContext::single(), options);
  EXPECT_EQ(bf16->language_model().weights_dtype(), at::kBFloat16);
  EXPECT_LE(batch_logit_error(*bf16), 0.2);  // bf16 weights: near the float32 model
  // A bfloat16 KV cache: the model and its decoder allocate it, and its cached decode stays near.
  options.kv_cache_dtype = at::kBFloat16;
  auto kv16 = LlavaNext::from_checkpoint(scratch.dir("old"), ParallelContext::single(), options);
  EXPECT_EQ(kv16->traits().kv_cache.dtype, at::kBFloat16);
  EXPECT_EQ(kv16->language_model().traits().kv_cache.dtype, at::kBFloat16);
  const GenerationConfig greedy = GenerationConfig().max_new_tokens(4).return_logprobs(true);
  const GenerateRequest request = make_request(batch_rows(), batch_vision());
  const GenerationResult with_kv16 = Generator(*kv16).generate(request, greedy);
  const GenerationResult with_f32 = Generator(*bf16).generate(request, greedy);
  EXPECT_EQ(with_kv16.sequences[0].tokens[0], with_f32.sequences[0].tokens[0]);
  EXPECT_NEAR(with_kv16.sequences[0].logprobs[0], with_f32.sequences[0].logprobs[0], 0.05);
  EXPECT_NE(with_kv16.sequences[0].logprobs[0], with_f32.sequences[0].logprobs[0]);  // the cache was rounded

  old.erase("vision_tower.vision_model.encoder.layers.1.mlp.fc2.weight");
  for (auto& [name, tensor] : old) tensor = tensor.to(at::kFloat);
  write_checkpoint_dir(scratch.dir("missing"), config_.to_json(), old);
  try {
    LlavaNext::from_checkpoint(scratch.dir("missing"));
    ADD_FAILURE() << "a missing tensor must be refused";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("model.vision_tower.vision_model.encoder.layers.1.mlp.fc2.weight"));
  }
}

}  // namespace
}  // namespace vlmgen
