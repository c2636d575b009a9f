// Qwen2.5-VL and Qwen3-VL checkpoints and configs: save and load in both HF spellings, tied and
// untied, 16-bit weights kept or widened, missing and misshapen tensors named, config.json layouts
// and sizes that do not fit refused with the numbers. The checkpoint tests run for both families
// (TEST_P on a fixture derived from QwenFamilyTest, qwen_families_test_util.h).

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qwen_families_golden.h"
#include "qwen_families_test_util.h"
#include "qwen_test_util.h"
#include "vlmgen/error.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/models/load_options.h"
#include "vlmgen/models/qwen_vl.h"
#include "vlmgen/parallel.h"
#include "vlmgen/positions.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)
using qwen_families_test::Golden;
using qwen_families_test::QwenFamilyTest;
using ::testing::AllOf;
using ::testing::HasSubstr;

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
