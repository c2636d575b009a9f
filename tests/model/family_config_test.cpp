// The per-image families' config.json: the released files read, what vlmgen does not compute
// refused by name, and the parameter counts the models allocate.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "vlmgen/error.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/models/llava_next.h"

namespace vlmgen {
namespace {

using ::testing::HasSubstr;

template <typename Config>
void expect_refused(const std::string& json, const std::string& needle) {
  try {
    Config::from_json(json);
    ADD_FAILURE() << "accepted: " << json;
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(needle));
  }
}

TEST(Gemma3ConfigTest, ReadsTransformersConfigsAndRefusesWhatItDoesNotCompute) {
  // Gemma-3-4B's config.json fields (text_config with rope_scaling and sliding_window_pattern).
  const std::string released = R"({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144, "mm_tokens_per_image": 256,
    "text_config": {"head_dim": 256, "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
      "num_attention_heads": 8, "num_hidden_layers": 34, "num_key_value_heads": 4, "query_pre_attn_scalar": 256,
      "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14,
      "vision_use_head": false}})";
  const Gemma3Config c = Gemma3Config::from_json(released);
  EXPECT_EQ(c.vocab_size, 262208);
  EXPECT_EQ(c.num_hidden_layers, 34);
  EXPECT_EQ(c.rope_scaling_factor, 8.0);
  EXPECT_EQ(c.rope_theta, 1000000.0);
  EXPECT_EQ(c.rope_local_base_freq, 10000.0);
  EXPECT_EQ(c.pool_kernel(), 4);  // 64 patches per side pooled to 16
  for (int64_t i = 0; i < 34; ++i) EXPECT_EQ(c.layer_slides(i), (i + 1) % 6 != 0) << "layer " << i;
  // Round trip through to_json (layer_types written explicitly).
  const Gemma3Config back = Gemma3Config::from_json(c.to_json());
  EXPECT_EQ(back.sliding_layers, c.sliding_layers);
  EXPECT_EQ(back.parameter_count(), c.parameter_count());

  auto refused = [](const std::string& json, const std::string& needle) { expect_refused<Gemma3Config>(json, needle); };
  refused(R"({"model_type": "gemma3", "text_config": {"rope_scaling": {"rope_type": "yarn", "factor": 4}}})", "yarn");
  refused(R"({"model_type": "gemma3", "text_config": {"attn_logit_softcapping": 50.0}})", "attn_logit_softcapping");
  refused(R"({"model_type": "gemma3", "mm_tokens_per_image": 200})", "must be a square");
  refused(R"({"model_type": "gemma3", "text_config": {"num_attention_heads": 6}})", "multiple of num_key_value_heads");
}

TEST(Gemma3ParameterCount, IsWhatTheModelAllocates) {
  Gemma3 model(Gemma3Config::tiny(), 0);
  int64_t allocated = 0;
  for (const auto& [name, t] : model.named_weights()) allocated += t->numel();
  EXPECT_EQ(Gemma3Config::tiny().parameter_count(), allocated);
}

TEST(LlavaNextConfigTest, ReadsTheReleasedConfigAndRefusesWhatItDoesNotCompute) {
  // llava-v1.6-mistral-7b-hf's config.json fields.
  const std::string released = R"({"architectures": ["LlavaNextForConditionalGeneration"],
    "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    "image_token_index": 32000, "model_type": "llava_next", "projector_hidden_act": "gelu",
    "text_config": {"architectures": ["MistralForCausalLM"], "intermediate_size": 14336,
      "max_position_embeddings": 32768, "model_type": "mistral", "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
      "rope_theta": 1000000.0, "sliding_window": null, "vocab_size": 32064},
    "tie_word_embeddings": false, "use_image_newline_parameter": true, "vision_config": {"hidden_size": 1024,
      "image_size": 336, "intermediate_size": 4096, "model_type": "clip_vision_model", "num_attention_heads": 16,
      "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default"})";
  const LlavaNextConfig c = LlavaNextConfig::from_json(released);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.vision_layers_used(), 23);
  // A 640x480 picture (height x width 480, 640): 672x672 best (2x2 tiles of 24x24 patches); the
  // 48x48 grid keeps 36 of 48 rows: 576 + 36 * 49 = 2340 placeholders.
  EXPECT_EQ(llava_next_placeholder_count(c, 480, 640), 2340);
  EXPECT_EQ(LlavaNextConfig::from_json(c.to_json()).parameter_count(), c.parameter_count());

  auto refused = [](const std::string& json, const std::string& needle) {
    expect_refused<LlavaNextConfig>(json, needle);
  };
  refused(R"({"model_type": "llava_next", "vision_feature_select_strategy": "full"})", "not supported");
  refused(R"({"model_type": "llava_next", "text_config": {"model_type": "mistral"}})", "sliding window");
  refused(R"({"model_type": "llava_next", "text_config": {"rope_scaling": {"type": "linear", "factor": 2}}})",
          "rope_scaling");
  refused(R"({"model_type": "llava_next", "vision_feature_layer": [-2, -5]})", "one integer");
  // Was read as -2 (the default) through a wrap-around; and an eps that made NaN logits later.
  refused(R"({"model_type": "llava_next", "vision_feature_layer": 18446744073709551614})", "beyond the int64 range");
  refused(R"({"model_type": "llava_next", "vision_feature_layer": -9223372036854775807})", "outside the");
  refused(R"({"model_type": "llava_next", "vision_config": {"layer_norm_eps": -1}})",
          "layer_norm_eps must be a positive number");
  refused(R"({"model_type": "llava_next", "text_config": {"mlp_bias": true}})", "mlp_bias");
  refused(R"({"model_type": "llava_next", "text_config": {"hidden_act": "gelu"}})", "hidden_act");
  refused(R"({"model_type": "llava_next", "vision_config": {"model_type": "siglip_vision_model"}})",
          "siglip_vision_model");
  refused(R"({"model_type": "llava_next", "text_config": {"rope_parameters": {"rope_type": "yarn", "factor": 4}}})",
          "yarn");
  // transformers 5 keeps the RoPE base in rope_parameters.
  const LlavaNextConfig v5 = LlavaNextConfig::from_json(
      R"({"model_type": "llava_next", "text_config": {"vocab_size": 32064, "rope_parameters": {"rope_type": "default",
      "rope_theta": 1000000.0}}})");
  EXPECT_EQ(v5.rope_theta, 1000000.0);
  EXPECT_EQ(v5.image_size, 336);  // LLaVA-NeXT's CLIP ViT-L/14 at 336 when vision_config says nothing
  EXPECT_EQ(v5.patch_size, 14);
  refused(
      R"({"model_type": "llava_next", "text_config": {"vocab_size": 32064}, "vision_config": {"image_size": 336, "patch_size": 14},
    "image_grid_pinpoints": [[300, 672]]})",
      "multiples of image_size");
}

TEST(LlavaNextParameterCount, IsWhatTheModelAllocates) {
  LlavaNext model(LlavaNextConfig::tiny(), 0);
  int64_t allocated = 0;
  for (const auto& [name, t] : model.named_weights()) allocated += t->numel();
  EXPECT_EQ(LlavaNextConfig::tiny().parameter_count(), allocated);
}

}  // namespace
}  // namespace vlmgen
