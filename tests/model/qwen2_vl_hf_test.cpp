// Qwen2-VL against HF transformers: logits, embeddings and positions against a PyTorch
// transcription of its modeling code, and checkpoints in its layout (save, load, spellings, ties).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "qwen2_vl_test_util.h"
#include "qwen_test_util.h"
#include "vlmgen/error.h"
#include "vlmgen/models/qwen2_vl.h"
#include "vlmgen/positions.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)
using qwen2_vl_test::kParityTolerance;

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

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

}  // namespace
}  // namespace vlmgen
