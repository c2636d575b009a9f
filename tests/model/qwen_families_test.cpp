// Qwen2.5-VL and Qwen3-VL: parity with an independent PyTorch transcription of HF's modeling
// code, the span rule with DeepStack, step invariance, checkpoints and bad configs. Each test
// runs for both families (TEST_P); Qwen2-VL has its own file (qwen2_vl_test.cpp).

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <array>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "qwen_families_golden.h"
#include "qwen_test_util.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/models/qwen_vl.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)
using ::testing::AllOf;
using ::testing::HasSubstr;

// Projections of logits and embeddings (|value| < 5) against numbers printed to 7 significant
// digits: measured max 3.1e-6, mostly the printing.
constexpr double kParityTolerance = 2e-5;
constexpr double kCacheTolerance = 1e-5;
// What a planted bug must move the projections by, at least, for the parity test to be
// meaningful: 50 times its tolerance.
constexpr double kBugEffect = 50 * kParityTolerance;

using Grid = std::array<int64_t, 3>;

// The reference script's cases (its image(), pixels_for() and prompts).
std::vector<int64_t> image(const Grid& g) {
  std::vector<int64_t> out = {kVisionStart};
  out.insert(out.end(), static_cast<size_t>(g[0] * g[1] * g[2] / 4), kImage);
  out.push_back(kVisionEnd);
  return out;
}

std::vector<int64_t> concat(std::initializer_list<std::vector<int64_t>> parts) {
  std::vector<int64_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

VisionInputs hashed_vision(const QwenVlConfig& c, const std::vector<Grid>& grids, const std::vector<int64_t>& keys) {
  std::vector<at::Tensor> pixels;
  std::vector<int64_t> flat;
  for (size_t i = 0; i < grids.size(); ++i) {
    const int64_t n = grids[i][0] * grids[i][1] * grids[i][2];
    pixels.push_back(hashed_tensor(n * patch_dim(c), keys[i], 1.0).view({n, patch_dim(c)}));
    flat.insert(flat.end(), grids[i].begin(), grids[i].end());
  }
  return VisionInputs::patch_flattened(at::cat(pixels, 0),
                                       at::tensor(flat, at::kLong).view({static_cast<int64_t>(grids.size()), 3}));
}

const Grid kGridA = {1, 4, 4};  // 2x2 merged tokens: one window
const Grid kGridB = {1, 6, 8};  // 3x4 merged tokens: 2x2 windows, partial last row
const Grid kGridC = {2, 4, 6};  // two frames of 2x3 merged tokens: partial last column
const Grid kGridD = {1, 8, 4};  // 4x2 merged tokens; 8x4 patches against a 4x4 position table

struct Golden {
  const char* name;
  QwenFamily family;
  const std::vector<double>& text;
  const std::vector<double>& batch_embedding;
  const std::vector<double>& batch_deepstack0;
  const std::vector<double>& batch_deepstack1;
  const std::vector<double>& batch_row0;
  const std::vector<double>& batch_row1;
  const std::vector<double>& turns_embedding;
  const std::vector<double>& turns_deepstack0;
  const std::vector<double>& turns_deepstack1;
  const std::vector<double>& turns_row0;
};

void PrintTo(const Golden& g, std::ostream* os) { *os << g.name; }

#define VLMGEN_GOLDEN(ns, family)                                                                                \
  Golden {                                                                                                       \
#ns, family, ns::kTextRow0, ns::kBatchEmbedding, ns::kBatchDeepStack0, ns::kBatchDeepStack1, ns::kBatchRow0, \
        ns::kBatchRow1, ns::kTurnsEmbedding, ns::kTurnsDeepStack0, ns::kTurnsDeepStack1, ns::kTurnsRow0          \
  }

class QwenFamilyTest : public ::testing::TestWithParam<Golden> {
 protected:
  QwenFamilyTest() : config_(QwenVlConfig::tiny(GetParam().family)), model_(config_, 0) { fill_hashed_weights(model_); }

  at::Tensor u_hidden() const { return hashed_tensor(config_.hidden_size, 4343, 1.0).to(at::kDouble); }
  at::Tensor u_vocab() const { return hashed_tensor(config_.vocab_size, 4242, 1.0).to(at::kDouble); }
  // Logits [B, L, V] projected on u_vocab: [B, L].
  at::Tensor project(const at::Tensor& logits) const { return at::matmul(logits.to(at::kDouble), u_vocab()); }

  std::vector<std::vector<int64_t>> batch_rows() const {
    return {concat({{1, 2}, image(kGridA), {3, 4}, image(kGridB), {5}}), concat({{6}, image(kGridC), {7, 8}})};
  }
  VisionInputs batch_vision() const { return hashed_vision(config_, {kGridA, kGridB, kGridC}, {1001, 1002, 1003}); }
  std::vector<int64_t> turn1() const { return concat({{9, 10}, image(kGridA), {11, 12, 13}}); }
  std::vector<int64_t> turns_row() const { return concat({turn1(), {14, 15}, image(kGridD), {16, 17}}); }
  VisionInputs turns_vision() const { return hashed_vision(config_, {kGridA, kGridD}, {1001, 1004}); }

  // Max |diff| of the batch case's logit projections against the golden rows.
  double batch_logit_error(QwenVl& model) {
    Batch batch = left_pad(batch_rows());
    at::Tensor p = project(full_forward(model, batch, batch_vision()));
    const int64_t n0 = static_cast<int64_t>(batch_rows()[0].size());
    const int64_t n1 = static_cast<int64_t>(batch_rows()[1].size());
    return std::max(max_abs_diff_to(p[0].narrow(0, batch.pads[0], n0), GetParam().batch_row0),
                    max_abs_diff_to(p[1].narrow(0, batch.pads[1], n1), GetParam().batch_row1));
  }

  QwenVlConfig config_;
  QwenVl model_;
};

TEST_P(QwenFamilyTest, TextOnlyLogitsMatchHfTranscription) {
  Batch batch = left_pad({{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}});
  const double diff = max_abs_diff_to(project(full_forward(model_, batch, VisionInputs()))[0], GetParam().text);
  report("HF transcription parity, text-only logit projection max|diff|", diff);
  EXPECT_LE(diff, kParityTolerance);
}

TEST_P(QwenFamilyTest, ImagesOfDifferentGridsInARaggedBatchMatchHfTranscription) {
  // Row 0: two images (one window; 2x2 windows with partial edges), row 1 (left-padded): a
  // two-frame image. Embeddings, DeepStack features and logits.
  at::Tensor rows = model_.encode_images(batch_vision());
  const int64_t h = config_.hidden_size;
  ASSERT_EQ(rows.size(1), config_.image_embedding_width());
  double embed_diff =
      max_abs_diff_to(at::matmul(rows.narrow(1, 0, h).to(at::kDouble), u_hidden()), GetParam().batch_embedding);
  if (config_.deepstack_count() > 0) {
    ASSERT_EQ(config_.deepstack_count(), 2);
    for (int64_t k = 0; k < 2; ++k) {
      const auto& expected = k == 0 ? GetParam().batch_deepstack0 : GetParam().batch_deepstack1;
      embed_diff =
          std::max(embed_diff,
                   max_abs_diff_to(at::matmul(rows.narrow(1, h * (k + 1), h).to(at::kDouble), u_hidden()), expected));
    }
  }
  const double logit_diff = batch_logit_error(model_);
  report("HF transcription parity, image embedding (+DeepStack) projection max|diff|", embed_diff);
  report("HF transcription parity, ragged batch logit projection max|diff|", logit_diff);
  EXPECT_LE(embed_diff, kParityTolerance);
  EXPECT_LE(logit_diff, kParityTolerance);
}

TEST_P(QwenFamilyTest, ContinuationWithANewImageMatchesHfTranscription) {
  // Turn 1 (with image A) through a KV cache, then turn 2's window with only image B: its logits
  // equal HF's full forward over both turns.
  const std::vector<int64_t> row = turns_row();
  const VisionInputs vision = turns_vision();
  Batch all = left_pad({row});
  RopePlan plan = model_.plan_positions(all.ids, all.mask, vision);
  const int64_t split = static_cast<int64_t>(turn1().size());
  const int64_t len = all.ids.size(1);
  InferenceContext ctx(model_.traits().kv_cache, 1, len);
  std::vector<at::Tensor> pieces;
  for (auto [start, end, image] : {std::array<int64_t, 3>{0, split, 0}, std::array<int64_t, 3>{split, len, 1}}) {
    ForwardArgs args;
    args.input_ids = all.ids.narrow(1, start, end - start);
    args.attention_mask = all.mask.narrow(1, 0, end);
    args.position_ids = plan.prompt_positions.narrow(2, start, end - start);
    args.context = &ctx;
    args.window_start = start;
    args.vision = vision.select({image});
    pieces.push_back(model_.forward(args));
    ctx.commit(args.input_ids, all.mask.narrow(1, start, end - start));
  }
  const double cached = max_abs_diff_to(project(at::cat(pieces, 1))[0], GetParam().turns_row0);
  const double full = max_abs_diff_to(project(full_forward(model_, all, vision))[0], GetParam().turns_row0);
  at::Tensor rows = model_.encode_images(vision);
  const double embed = max_abs_diff_to(at::matmul(rows.narrow(1, 0, config_.hidden_size).to(at::kDouble), u_hidden()),
                                       GetParam().turns_embedding);
  report("HF transcription parity, continuation with a new image (KV) max|diff|", cached);
  EXPECT_LE(cached, kParityTolerance);
  EXPECT_LE(full, kParityTolerance);
  EXPECT_LE(embed, kParityTolerance);
}

TEST_P(QwenFamilyTest, PlantedArchitectureBugsMissTheGoldenNumbersByFar) {
  // The parity tests above catch these bugs: each moves the logits by far more than their
  // tolerance. (Bugs in code paths a config cannot switch, such as a missing reverse reorder or
  // a dropped q_norm, were planted in the source by hand; see the closing note of issue 10.)
  auto error_with = [&](QwenVlConfig changed) {
    QwenVl variant(changed, 0);
    fill_hashed_weights(variant);
    return batch_logit_error(variant);
  };
  if (config_.family == QwenFamily::kQwen2_5Vl) {
    QwenVlConfig full_attention = config_;
    full_attention.vision.fullatt_block_indexes = {0, 1};
    const double e = error_with(full_attention);
    report("planted bug: full attention instead of windows, parity error", e);
    EXPECT_GT(e, kBugEffect);
  }
  if (config_.family == QwenFamily::kQwen3Vl) {
    QwenVlConfig chunked = config_;
    chunked.mrope_interleaved = false;
    const double e = error_with(chunked);
    report("planted bug: chunked instead of interleaved M-RoPE, parity error", e);
    EXPECT_GT(e, kBugEffect);
    // DeepStack features zeroed: the same embeddings without their DeepStack columns.
    Batch batch = left_pad(batch_rows());
    at::Tensor rows = model_.encode_images(batch_vision());
    rows.narrow(1, config_.hidden_size, rows.size(1) - config_.hidden_size).zero_();
    ForwardArgs args;
    args.input_ids = batch.ids;
    args.attention_mask = batch.mask;
    args.position_ids = model_.plan_positions(batch.ids, batch.mask, batch_vision()).prompt_positions;
    args.image_embeddings = rows;
    at::Tensor p = project(model_.forward(args));
    const double zeroed =
        max_abs_diff_to(p[0].narrow(0, batch.pads[0], p.size(1) - batch.pads[0]), GetParam().batch_row0);
    report("planted bug: DeepStack features zeroed, parity error", zeroed);
    EXPECT_GT(zeroed, kBugEffect);
  }
}

TEST_P(QwenFamilyTest, PositionsFromTheGeneratorsSpansEqualPlanPositionsAndBadSpansAreRefused) {
  // The generator hands its spans (padded columns) to the model; the model must place the
  // images exactly where its own search would.
  const auto rows = batch_rows();
  Batch batch = left_pad(rows);
  const VisionInputs vision = batch_vision();
  const std::vector<ImageSpan> spans = find_image_spans(rows, kImage, model_.placeholder_counts(vision), batch.pads);
  ASSERT_EQ(spans.size(), 3u);
  RopePlan own = model_.plan_positions(batch.ids, batch.mask, vision);
  RopePlan given = model_.plan_positions_with_spans(batch.ids, batch.mask, vision, spans);
  EXPECT_TRUE(own.prompt_positions.equal(given.prompt_positions));
  EXPECT_EQ(own.delta, given.delta);
  std::vector<ImageSpan> on_padding = spans;
  on_padding[2].begin = 0;  // row 1 is left-padded: column 0 is padding
  on_padding[2].end = spans[2].size();
  EXPECT_THROW(model_.plan_positions_with_spans(batch.ids, batch.mask, vision, on_padding), Error);
  std::vector<ImageSpan> short_span = spans;
  short_span[0].end -= 1;
  EXPECT_THAT([&] { model_.plan_positions_with_spans(batch.ids, batch.mask, vision, short_span); },
              ::testing::ThrowsMessage<Error>(HasSubstr("its span claims 3")));
  EXPECT_THROW(model_.plan_positions_with_spans(batch.ids, batch.mask, vision, {spans[0], spans[1]}), Error);
}

TEST_P(QwenFamilyTest, GreedyTokensWithKvCacheEqualTokensWithout) {
  GenerateRequest request = make_request(batch_rows(), batch_vision());
  Generator generator(model_);
  auto with_cache = generator.generate(request, GenerationConfig().max_new_tokens(8).enable_kv_cache(true));
  auto without = generator.generate(request, GenerationConfig().max_new_tokens(8).enable_kv_cache(false));
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(with_cache.sequences[r].tokens.size(), 8u);
    EXPECT_EQ(with_cache.sequences[r].tokens, without.sequences[r].tokens) << "row " << r;
  }
}

TEST_P(QwenFamilyTest, NoCachePromptLogitsAreStepInvariantAndStepZeroIsNot) {
  double agreement = 0.0;
  const double span_aware =
      prompt_logit_drift(model_, batch_rows(), batch_vision(), ReplayMode::kSpanAware, &agreement);
  report("no-cache prompt logits, step k vs step 0 (span-aware) max|diff|", span_aware);
  EXPECT_LE(span_aware, kCacheTolerance);
  EXPECT_EQ(agreement, 1.0);
  double legacy_agreement = 1.0;
  const double step_zero =
      prompt_logit_drift(model_, batch_rows(), batch_vision(), ReplayMode::kStepZero, &legacy_agreement);
  report("no-cache prompt logits, step k vs step 0 (legacy step-zero) max|diff|", step_zero);
  EXPECT_GT(step_zero, 1e-3);
  EXPECT_LT(legacy_agreement, 1.0) << "without the image the prompt's argmax tokens must change somewhere";
}

// A model whose image embeddings lose their DeepStack columns after step 0: the bug of a loop
// that replays only the merged embeddings on a no-cache recompute.
class DropDeepStackAfterStepZero : public CausalVlm {
 public:
  explicit DropDeepStackAfterStepZero(QwenVl& inner) : inner_(inner) {}
  const ModelTraits& traits() const override { return inner_.traits(); }
  at::Tensor forward(const ForwardArgs& args) override {
    if (args.step == 0 || !args.image_embeddings.defined()) return inner_.forward(args);
    ForwardArgs changed = args;
    const int64_t h = inner_.config().hidden_size;
    changed.image_embeddings = args.image_embeddings.clone();
    changed.image_embeddings.narrow(1, h, changed.image_embeddings.size(1) - h).zero_();
    return inner_.forward(changed);
  }
  bool can_encode_images() const override { return true; }
  at::Tensor encode_images(const VisionInputs& vision) override { return inner_.encode_images(vision); }
  RopePlan plan_positions(const at::Tensor& ids, const at::Tensor& mask, const VisionInputs& vision) const override {
    return inner_.plan_positions(ids, mask, vision);
  }

 private:
  QwenVl& inner_;
};

TEST_P(QwenFamilyTest, EncoderCacheReplaysEverythingTheImagesNeedOnEveryRecompute) {
  // No cache: the prompt is recomputed every step from the encoder cache's rows. The tower runs
  // once per request, and the tokens equal the KV-cache run's.
  const int64_t before = model_.vision_tower_calls();
  auto no_cache = Generator(model_).generate(make_request(batch_rows(), batch_vision()),
                                             GenerationConfig().max_new_tokens(6).enable_kv_cache(false));
  EXPECT_EQ(model_.vision_tower_calls(), before + 1);
  EXPECT_EQ(no_cache.stats.images_encoded, 3);
  auto kv = Generator(model_).generate(make_request(batch_rows(), batch_vision()),
                                       GenerationConfig().max_new_tokens(6).enable_kv_cache(true));
  for (size_t r = 0; r < 2; ++r) EXPECT_EQ(no_cache.sequences[r].tokens, kv.sequences[r].tokens) << "row " << r;
  if (config_.deepstack_count() > 0) {
    // Losing the DeepStack features on the recomputes shows up as drift of the prompt logits.
    DropDeepStackAfterStepZero broken(model_);
    const double drift = prompt_logit_drift(broken, batch_rows(), batch_vision(), ReplayMode::kSpanAware);
    report("planted bug: DeepStack missing in no-cache recomputes, prompt logit drift", drift);
    EXPECT_GT(drift, 1e-3);
  }
}

TEST_P(QwenFamilyTest, ParameterCountIsWhatTheModelAllocates) {
  int64_t allocated = 0;
  for (const auto& [name, t] : model_.named_weights()) allocated += t->numel();
  EXPECT_EQ(config_.parameter_count(), allocated);
  QwenVlConfig tied = config_;
  tied.tie_word_embeddings = true;
  QwenVl tied_model(tied, 0);
  allocated = 0;
  for (const auto& [name, t] : tied_model.named_weights()) allocated += t->numel();
  EXPECT_EQ(tied.parameter_count(), allocated);
}

TEST_P(QwenFamilyTest, ConfigJsonRoundTripsAndNamesTheFamily) {
  const std::string json = config_.to_json();
  EXPECT_THAT(json, HasSubstr(std::string("\"model_type\": \"") + family_model_type(config_.family) + "\""));
  EXPECT_EQ(QwenVlConfig::from_json(json), config_);
}

// ---------------------------------------------------------------------------------------------
// Checkpoints

class QwenFamilyCheckpointTest : public QwenFamilyTest {
 protected:
  std::string dir(const std::string& name) const { return scratch_.dir(name); }
  static std::map<std::string, at::Tensor> read_all(const std::string& d) { return read_all_tensors(d); }
  static void write(const std::string& d, const std::string& json, const std::map<std::string, at::Tensor>& t) {
    write_checkpoint_dir(d, json, t);
  }
  at::Tensor logits(CausalVlm& model) {
    Batch batch = left_pad(batch_rows());
    ForwardArgs args;
    args.input_ids = batch.ids;
    args.attention_mask = batch.mask;
    args.position_ids = model.plan_positions(batch.ids, batch.mask, batch_vision()).prompt_positions;
    args.vision = batch_vision();
    return model.forward(args);
  }
  ScratchDir scratch_;
};

TEST_P(QwenFamilyCheckpointTest, RoundTripsInBothSpellingsTiedAndUntiedAndHalfPrecision) {
  model_.save_checkpoint(dir("classic"));
  auto loaded = load_model(dir("classic"));
  ASSERT_NE(dynamic_cast<QwenVl*>(loaded.get()), nullptr);
  EXPECT_EQ(dynamic_cast<QwenVl&>(*loaded).config(), config_);
  EXPECT_TRUE(logits(*loaded).equal(logits(model_)));

  // transformers >= 4.52 spelling: model.visual.*, model.language_model.*
  std::map<std::string, at::Tensor> renamed;
  for (auto& [name, t] : read_all(dir("classic"))) {
    std::string n = name;
    if (n.rfind("visual.", 0) == 0)
      n = "model." + n;
    else if (n.rfind("model.", 0) == 0)
      n = "model.language_model." + n.substr(6);
    renamed.emplace(n, t);
  }
  ASSERT_EQ(renamed.count("model.visual.blocks.0.attn.qkv.weight"), 1u);
  write(dir("new"), config_.to_json(), renamed);
  EXPECT_TRUE(logits(*load_model(dir("new"))).equal(logits(model_)));

  // Tied: no lm_head.weight in the file; loads tied.
  QwenVlConfig tied_config = config_;
  tied_config.tie_word_embeddings = true;
  QwenVl tied(tied_config, 3);
  tied.save_checkpoint(dir("tied"));
  EXPECT_EQ(read_all(dir("tied")).count("lm_head.weight"), 0u);
  auto tied_loaded = QwenVl::from_checkpoint(dir("tied"));
  EXPECT_TRUE(tied_loaded->tied_embeddings());
  EXPECT_TRUE(logits(*tied_loaded).equal(logits(tied)));

  // F16 and BF16 tensors (alternating) load as float32 equal to the same rounding in fp32.
  std::map<std::string, at::Tensor> half;
  bool bf16 = false;
  for (auto& [name, t] : read_all(dir("classic"))) {
    half.emplace(name, t.to(bf16 ? at::kBFloat16 : at::kHalf));
    bf16 = !bf16;
  }
  write(dir("half"), config_.to_json(), half);
  auto half_loaded = QwenVl::from_checkpoint(dir("half"));
  for (const auto& [name, t] : model_.named_weights()) *t = half.at(name).to(at::kFloat);
  EXPECT_TRUE(logits(*half_loaded).equal(logits(model_)));
}

/// Prefill logits of the image batch with a KV cache, then the logits of one decode step (the
/// CPU kernels' path: a few rows) after it.
std::pair<at::Tensor, at::Tensor> prefill_and_step(QwenVl& model, const Batch& batch, const VisionInputs& vision) {
  InferenceContext ctx(model.traits().kv_cache, batch.ids.size(0), batch.ids.size(1) + 1);
  RopePlan plan = model.plan_positions(batch.ids, batch.mask, vision);
  ForwardArgs args;
  args.input_ids = batch.ids;
  args.attention_mask = batch.mask;
  args.position_ids = plan.prompt_positions;
  args.vision = vision;
  args.context = &ctx;
  at::Tensor prefill = model.forward(args);
  ctx.commit(batch.ids, batch.mask);
  at::Tensor next = prefill.select(1, prefill.size(1) - 1).argmax(-1).unsqueeze(1);  // [B, 1]
  ForwardArgs step;
  step.input_ids = next;
  step.attention_mask = at::cat({batch.mask, at::ones_like(next)}, 1);
  const int64_t length = batch.ids.size(1);
  step.position_ids = extend_positions(plan, batch.pads, length + 1).narrow(-1, length, 1).contiguous();
  step.context = &ctx;
  step.window_start = length;
  return {prefill, model.forward(step)};
}

TEST_P(QwenFamilyCheckpointTest, SixteenBitWeightsStaySixteenBitAndComputeLikeFloat32OfTheSameValues) {
  std::map<std::string, at::Tensor> bf16;
  for (auto& [name, t] : model_.named_weights()) bf16.emplace(name, t->to(at::kBFloat16));
  write(dir("bf16"), config_.to_json(), bf16);
  auto kept = QwenVl::from_checkpoint(dir("bf16"), ParallelContext::single(), LoadOptions{at::kBFloat16});
  auto widened = QwenVl::from_checkpoint(dir("bf16"));  // the same values in float32
  EXPECT_EQ(kept->weights_dtype(), at::kBFloat16);
  EXPECT_EQ(widened->weights_dtype(), at::kFloat);
  int64_t sixteen_bit = 0;
  for (auto& [name, t] : kept->named_weights()) {
    const bool lm_matrix = t->dim() == 2 && name.rfind("visual.", 0) != 0;
    EXPECT_EQ(t->scalar_type(), lm_matrix ? at::kBFloat16 : at::kFloat) << name;
    sixteen_bit += lm_matrix ? 1 : 0;
  }
  // 7 linears a layer, the embedding and (untied) lm_head.
  EXPECT_EQ(sixteen_bit, 7 * config_.num_hidden_layers + (config_.tie_word_embeddings ? 1 : 2));

  const Batch batch = left_pad(batch_rows());
  auto [prefill_kept, step_kept] = prefill_and_step(*kept, batch, batch_vision());
  auto [prefill_wide, step_wide] = prefill_and_step(*widened, batch, batch_vision());
  // Same weight values, float32 compute: only the order of the sums differs.
  const double scale = prefill_wide.abs().max().item<double>();
  EXPECT_LT((prefill_kept - prefill_wide).abs().max().item<double>(), 1e-4 * scale);
  EXPECT_LT((step_kept - step_wide).abs().max().item<double>(), 1e-4 * scale);
  EXPECT_TRUE(step_kept.argmax(-1).equal(step_wide.argmax(-1)));

  // float16 by conversion of a loaded model: like float32 with the matrices rounded to float16.
  auto half = QwenVl::from_checkpoint(dir("bf16"));
  half->convert_weights(at::kHalf);
  for (auto& [name, t] : widened->named_weights())
    if (t->dim() == 2 && name.rfind("visual.", 0) != 0) *t = t->to(at::kHalf).to(at::kFloat);
  auto [prefill_half, step_half] = prefill_and_step(*half, batch, batch_vision());
  auto [prefill_rounded, step_rounded] = prefill_and_step(*widened, batch, batch_vision());
  EXPECT_LT((step_half - step_rounded).abs().max().item<double>(), 1e-4 * scale);

  // A 16-bit model saves its 16-bit matrices and reloads to the same logits.
  kept->save_checkpoint(dir("bf16_again"));
  EXPECT_EQ(read_all(dir("bf16_again")).at("model.layers.0.mlp.up_proj.weight").scalar_type(), at::kBFloat16);
  auto again = QwenVl::from_checkpoint(dir("bf16_again"), ParallelContext::single(), LoadOptions{at::kBFloat16});
  EXPECT_TRUE(prefill_and_step(*again, batch, batch_vision()).second.equal(step_kept));

  // Other dtypes are refused before anything is read or changed.
  EXPECT_THROW(QwenVl::from_checkpoint(dir("bf16"), ParallelContext::single(), LoadOptions{at::kDouble}), Error);
  EXPECT_THROW(kept->convert_weights(at::kDouble), Error);
  EXPECT_EQ(kept->weights_dtype(), at::kBFloat16);
  EXPECT_THROW(parse_weights_dtype("int8"), Error);
  EXPECT_EQ(parse_weights_dtype("bf16"), at::kBFloat16);
}

TEST_P(QwenFamilyCheckpointTest, MissingTensorsAreListedAndShapesNamed) {
  model_.save_checkpoint(dir("full"));
  auto tensors = read_all(dir("full"));
  const std::string family_tensor = config_.family == QwenFamily::kQwen3Vl
                                        ? "visual.deepstack_merger_list.1.norm.weight"
                                        : "visual.blocks.0.mlp.up_proj.weight";
  const std::string text_tensor = config_.family == QwenFamily::kQwen3Vl ? "model.layers.1.self_attn.k_norm.weight"
                                                                         : "model.layers.1.self_attn.k_proj.bias";
  ASSERT_EQ(tensors.erase(family_tensor), 1u);
  ASSERT_EQ(tensors.erase(text_tensor), 1u);
  write(dir("missing"), config_.to_json(), tensors);
  EXPECT_THAT([&] { load_model(dir("missing")); },
              ::testing::ThrowsMessage<Error>(AllOf(HasSubstr(family_tensor), HasSubstr(text_tensor))));

  auto wide = read_all(dir("full"));
  wide["visual.blocks.1.attn.proj.weight"] = at::zeros({32, 33});
  write(dir("wide"), config_.to_json(), wide);
  EXPECT_THAT([&] { load_model(dir("wide")); },
              ::testing::ThrowsMessage<Error>(
                  AllOf(HasSubstr("visual.blocks.1.attn.proj.weight"), HasSubstr("[32, 33]"), HasSubstr("[32, 32]"))));
}

INSTANTIATE_TEST_SUITE_P(Families, QwenFamilyTest,
                         ::testing::Values(VLMGEN_GOLDEN(golden_qwen2_5_vl, QwenFamily::kQwen2_5Vl),
                                           VLMGEN_GOLDEN(golden_qwen3_vl, QwenFamily::kQwen3Vl)),
                         [](const auto& info) { return std::string(info.param.name).substr(7); });
INSTANTIATE_TEST_SUITE_P(Families, QwenFamilyCheckpointTest,
                         ::testing::Values(VLMGEN_GOLDEN(golden_qwen2_5_vl, QwenFamily::kQwen2_5Vl),
                                           VLMGEN_GOLDEN(golden_qwen3_vl, QwenFamily::kQwen3Vl)),
                         [](const auto& info) { return std::string(info.param.name).substr(7); });

// ---------------------------------------------------------------------------------------------
// Configs

QwenVlConfig parse(const std::string& json) { return QwenVlConfig::from_json(json); }

TEST(QwenFamilyConfigTest, NestedAndFlatLayoutsAndBothRopeSpellingsReadTheSame) {
  const std::string vision = R"("vision_config": {"depth": 2, "hidden_size": 32, "out_hidden_size": 64,
      "intermediate_size": 48, "num_heads": 2, "patch_size": 4, "window_size": 16, "fullatt_block_indexes": [1],
      "in_chans": 3, "spatial_merge_size": 2, "temporal_patch_size": 2})";
  const std::string text = R"("hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 96, "rms_norm_eps": 1e-6,
      "rope_theta": 10000.0, "max_position_embeddings": 2048)";
  const std::string ids = R"("image_token_id": 90, "video_token_id": 91, "vision_start_token_id": 88,
      "vision_end_token_id": 89)";
  const QwenVlConfig flat =
      parse(R"({"model_type": "qwen2_5_vl", )" + text +
            R"(, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, )" + ids + ", " + vision + "}");
  const QwenVlConfig nested = parse(
      R"({"architectures": ["Qwen2_5_VLForConditionalGeneration"], "text_config": {)" + text +
      R"(, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}}, )" + ids + ", " + vision + "}");
  EXPECT_EQ(flat.family, QwenFamily::kQwen2_5Vl);
  EXPECT_EQ(flat, nested);
  QwenVlConfig tiny = QwenVlConfig::tiny(QwenFamily::kQwen2_5Vl);
  EXPECT_EQ(flat, tiny) << "the tiny config is exactly this config.json";
  EXPECT_EQ(flat.vision.embed_dim, 32) << "Qwen2.5-VL's vision hidden_size is the block width";
  EXPECT_EQ(flat.vision.hidden_size, 64) << "and out_hidden_size the merger's output";
}

TEST(QwenFamilyConfigTest, SizesThatDoNotFitAreRefusedWithTheNumbers) {
  auto refused = [](QwenVlConfig c, const std::vector<std::string>& parts) {
    try {
      c.validate();
      ADD_FAILURE() << "accepted; expected an error with " << parts[0];
    } catch (const Error& e) {
      for (const auto& p : parts) EXPECT_THAT(e.what(), HasSubstr(p));
    }
  };
  QwenVlConfig q25 = QwenVlConfig::tiny(QwenFamily::kQwen2_5Vl);
  QwenVlConfig c = q25;
  c.vision.window_size = 20;
  refused(c, {"window_size 20", "multiple of", "= 8"});
  c = q25;
  c.vision.fullatt_block_indexes = {2};
  refused(c, {"fullatt_block_indexes", "entry 2", "depth"});
  c = q25;
  c.mrope_section = {2, 3, 4};
  refused(c, {"mrope_section", "sums to 9", "head_dim / 2 = 8"});

  QwenVlConfig q3 = QwenVlConfig::tiny(QwenFamily::kQwen3Vl);
  c = q3;
  c.vision.deepstack_visual_indexes = {0, 3};
  refused(c, {"deepstack_visual_indexes", "entry 3", "depth"});
  c = q3;
  c.vision.deepstack_visual_indexes = {1, 0};
  refused(c, {"deepstack_visual_indexes", "strictly increasing"});
  c = q3;
  c.mrope_section = {2, 3, 3};
  refused(c, {"cannot be interleaved", "3, 3, 2"});
  c = q3;
  c.vision.num_position_embeddings = 15;
  refused(c, {"num_position_embeddings 15", "square"});
  c = q3;
  c.num_hidden_layers = 1;
  refused(c, {"2 entries", "1 layers"});
}

TEST(QwenFamilyConfigTest, AnUnknownModelTypeNamesTheSupportedOnes) {
  std::string pattern = ::testing::TempDir() + "vlmgen_unknown_XXXXXX";
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const std::string path = pattern + "/config.json";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  const std::string json = R"({"model_type": "idefics3", "architectures": ["Idefics3ForConditionalGeneration"]})";
  std::fwrite(json.data(), 1, json.size(), f);
  std::fclose(f);
  EXPECT_THAT([&] { load_model(pattern); },
              ::testing::ThrowsMessage<Error>(
                  AllOf(HasSubstr("'idefics3'"), HasSubstr("qwen2_vl, qwen2_5_vl, qwen3_vl, gemma3, llava_next"))));
  std::filesystem::remove_all(pattern);
}

}  // namespace
}  // namespace vlmgen
