#include "vlmgen/models/qwen_vl_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include "vlmgen/error.h"

namespace vlmgen {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// The shape of Qwen/Qwen2-VL-2B-Instruct's config.json (flat layout, transformers 4.41).
constexpr const char* kQwen2Vl2BFlat = R"({
  "architectures": [
    "Qwen2VLForConditionalGeneration"
  ],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "vision_start_token_id": 151652,
  "vision_end_token_id": 151653,
  "vision_token_id": 151654,
  "image_token_id": 151655,
  "video_token_id": 151656,
  "hidden_act": "silu",
  "hidden_size": 1536,
  "initializer_range": 0.02,
  "intermediate_size": 8960,
  "max_position_embeddings": 32768,
  "max_window_layers": 28,
  "model_type": "qwen2_vl",
  "num_attention_heads": 12,
  "num_hidden_layers": 28,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 32768,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.41.2",
  "use_cache": true,
  "use_sliding_window": false,
  "vision_config": {
    "depth": 32,
    "embed_dim": 1280,
    "mlp_ratio": 4,
    "num_heads": 16,
    "in_chans": 3,
    "hidden_size": 1536,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "spatial_patch_size": 14,
    "temporal_patch_size": 2
  },
  "rope_scaling": {
    "type": "mrope",
    "mrope_section": [
      16,
      24,
      24
    ]
  },
  "vocab_size": 151936
})";

// The same model as newer transformers save it: text fields under text_config, rope type
// rewritten to "default", token ids at the top level, vision channel count spelled in_channels.
constexpr const char* kQwen2Vl2BNested = R"({
  "architectures": ["Qwen2VLForConditionalGeneration"],
  "model_type": "qwen2_vl",
  "image_token_id": 151655,
  "video_token_id": 151656,
  "vision_start_token_id": 151652,
  "vision_end_token_id": 151653,
  "text_config": {
    "model_type": "qwen2_vl_text",
    "hidden_act": "silu",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "max_position_embeddings": 32768,
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "rope_theta": 1000000.0,
    "tie_word_embeddings": true,
    "vocab_size": 151936,
    "head_dim": null
  },
  "tie_word_embeddings": true,
  "vision_config": {
    "depth": 32,
    "embed_dim": 1280,
    "hidden_act": "quick_gelu",
    "hidden_size": 1536,
    "in_channels": 3,
    "mlp_ratio": 4,
    "num_heads": 16,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2
  }
})";

// A config with only the required fields; everything else takes HF's defaults.
constexpr const char* kMinimal = R"({
  "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "intermediate_size": 128, "vocab_size": 100,
  "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
  "vision_config": {"depth": 1, "embed_dim": 32, "num_heads": 2, "hidden_size": 64}
})";

std::string without(std::string text, const std::string& piece) {
  const size_t pos = text.find(piece);
  EXPECT_NE(pos, std::string::npos) << piece;
  if (pos != std::string::npos) text.erase(pos, piece.size());
  return text;
}

std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const size_t pos = text.find(from);
  EXPECT_NE(pos, std::string::npos) << from;
  if (pos != std::string::npos) text.replace(pos, from.size(), to);
  return text;
}

std::string error_of(const std::string& text) {
  try {
    QwenVlConfig::from_json(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

TEST(QwenVlConfigTest, ParsesQwen2Vl2BFlatConfig) {
  const QwenVlConfig c = QwenVlConfig::from_json(kQwen2Vl2BFlat);
  EXPECT_EQ(c.hidden_size, 1536);
  EXPECT_EQ(c.num_hidden_layers, 28);
  EXPECT_EQ(c.num_attention_heads, 12);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.intermediate_size, 8960);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.mrope_section, (std::vector<int64_t>{16, 24, 24}));
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.image_token_id, 151655);
  EXPECT_EQ(c.video_token_id, 151656);
  EXPECT_EQ(c.vision_start_token_id, 151652);
  EXPECT_EQ(c.vision_end_token_id, 151653);
  EXPECT_EQ(c.vision.depth, 32);
  EXPECT_EQ(c.vision.embed_dim, 1280);
  EXPECT_EQ(c.vision.num_heads, 16);
  EXPECT_EQ(c.vision.mlp_ratio, 4);
  EXPECT_EQ(c.vision.in_channels, 3);
  EXPECT_EQ(c.vision.patch_size, 14);
  EXPECT_EQ(c.vision.temporal_patch_size, 2);
  EXPECT_EQ(c.vision.spatial_merge_size, 2);
  EXPECT_EQ(c.vision.hidden_size, 1536);
  EXPECT_EQ(c.vision.hidden_act, "quick_gelu");
  EXPECT_NO_THROW(c.validate());
  // bf16 K and V: 2 * 28 layers * 2 heads * 128 * 2 bytes.
  EXPECT_EQ(c.kv_cache_bytes_per_token(2), 2 * 28 * 2 * 128 * 2);
}

TEST(QwenVlConfigTest, NestedLayoutGivesTheSameConfig) {
  EXPECT_EQ(QwenVlConfig::from_json(kQwen2Vl2BNested), QwenVlConfig::from_json(kQwen2Vl2BFlat));
}

TEST(QwenVlConfigTest, NestedTextConfigWinsOverTopLevel) {
  // transformers keeps stale copies of some text fields at the top level; text_config is the truth.
  const std::string text = replaced(kQwen2Vl2BNested, R"("tie_word_embeddings": true,
  "vision_config")",
                                    R"("tie_word_embeddings": false, "hidden_size": 999,
  "vision_config")");
  const QwenVlConfig c = QwenVlConfig::from_json(text);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.hidden_size, 1536);
}

TEST(QwenVlConfigTest, ExplicitHeadDimSizesTheKvCache) {
  // Mistral-Small-24B's text geometry: head_dim 128 although 5120 / 32 = 160.
  const std::string text = R"({
    "text_config": {"hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 32768,
                    "vocab_size": 131072,
                    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
    "vision_config": {"depth": 2, "embed_dim": 1024, "num_heads": 16, "hidden_size": 5120},
    "image_token_id": 10, "video_token_id": 11, "vision_start_token_id": 12,
    "vision_end_token_id": 13
  })";
  const QwenVlConfig c = QwenVlConfig::from_json(text);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.kv_cache_bytes_per_token(2), 2 * 40 * 8 * 128 * 2);
  EXPECT_NE(c.kv_cache_bytes_per_token(2), 2 * 40 * 8 * (5120 / 32) * 2);
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(QwenVlConfig::from_json(c.to_json()), c);
}

TEST(QwenVlConfigTest, MissingRequiredFieldsAreNamed) {
  const std::string flat = kQwen2Vl2BFlat;
  struct Case {
    std::string from, to, name;
  };
  const Case cases[] = {
      {"  \"hidden_size\": 1536,\n", "", "'hidden_size'"},
      {"\"num_hidden_layers\": 28,", "", "'num_hidden_layers'"},
      {"\"num_attention_heads\": 12,", "", "'num_attention_heads'"},
      {"\"num_key_value_heads\": 2,", "", "'num_key_value_heads'"},
      {"\"intermediate_size\": 8960,", "", "'intermediate_size'"},
      {",\n  \"vocab_size\": 151936", "", "'vocab_size'"},
      {"\"depth\": 32,", "", "'depth'"},
      {"\"embed_dim\": 1280,", "", "'embed_dim'"},
      {"\"num_heads\": 16,", "", "'num_heads'"},
      {"\"hidden_size\": 1536,\n    \"patch_size\"", "\"patch_size\"", "'hidden_size'"},
      {"\"type\": \"mrope\",\n    \"mrope_section\": [\n      16,\n      24,\n      24\n    ]", "\"type\": \"mrope\"",
       "mrope_section"},
  };
  for (const auto& c : cases) {
    EXPECT_THAT(error_of(replaced(flat, c.from, c.to)), AllOf(HasSubstr("missing"), HasSubstr(c.name))) << c.from;
  }
  EXPECT_THAT(error_of(without(flat, "\"num_key_value_heads\": 2,")), HasSubstr("the top level"));
  const size_t vision_begin = flat.find("  \"vision_config\"");
  const size_t vision_end = flat.find("  \"rope_scaling\"");
  std::string no_vision = flat;
  no_vision.erase(vision_begin, vision_end - vision_begin);
  EXPECT_THAT(error_of(no_vision), AllOf(HasSubstr("missing"), HasSubstr("vision_config")));
  EXPECT_THAT(error_of(without(flat,
                               "  \"rope_scaling\": {\n    \"type\": \"mrope\",\n    "
                               "\"mrope_section\": [\n      16,\n      24,\n      24\n    ]\n  },\n")),
              HasSubstr("rope_scaling"));
}

TEST(QwenVlConfigTest, WrongTypesNameFieldAndType) {
  const std::string flat = kQwen2Vl2BFlat;
  EXPECT_THAT(error_of(replaced(flat, "\"num_hidden_layers\": 28", "\"num_hidden_layers\": \"28\"")),
              AllOf(HasSubstr("num_hidden_layers"), HasSubstr("string")));
  EXPECT_THAT(error_of(replaced(flat, "\"intermediate_size\": 8960", "\"intermediate_size\": 8960.5")),
              AllOf(HasSubstr("intermediate_size"), HasSubstr("integer")));
  EXPECT_THAT(error_of(replaced(flat, "\"tie_word_embeddings\": true", "\"tie_word_embeddings\": 1")),
              AllOf(HasSubstr("tie_word_embeddings"), HasSubstr("boolean")));
  EXPECT_THAT(error_of(replaced(flat, "\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": \"1e-6\"")),
              AllOf(HasSubstr("rms_norm_eps"), HasSubstr("string")));
  EXPECT_THAT(error_of(replaced(flat, "\"depth\": 32", "\"depth\": [32]")),
              AllOf(HasSubstr("vision_config.depth"), HasSubstr("array")));
  EXPECT_THAT(error_of(replaced(flat, "      24\n    ]", "      \"24\"\n    ]")),
              AllOf(HasSubstr("mrope_section[2]"), HasSubstr("string")));
  EXPECT_THAT(error_of(replaced(flat, "\"type\": \"mrope\"", "\"type\": \"yarn\"")), HasSubstr("'yarn'"));
  EXPECT_THAT(error_of("[1, 2]"), HasSubstr("object"));
  EXPECT_THAT(error_of("{\"hidden_size\": "), HasSubstr("not valid JSON"));
  EXPECT_THAT(error_of(replaced(flat, "\"in_chans\": 3", "\"in_chans\": 3, \"in_channels\": 4")),
              AllOf(HasSubstr("in_chans"), HasSubstr("in_channels"), HasSubstr("disagree")));
  // A whole-number float mlp_ratio is how some configs spell 4.
  EXPECT_EQ(QwenVlConfig::from_json(replaced(flat, "\"mlp_ratio\": 4", "\"mlp_ratio\": 4.0")).vision.mlp_ratio, 4);
}

TEST(QwenVlConfigTest, DefaultsFollowHfConfigClasses) {
  const QwenVlConfig c = QwenVlConfig::from_json(kMinimal);
  EXPECT_EQ(c.head_dim, 16);  // 64 / 4
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.image_token_id, 151655);
  EXPECT_EQ(c.video_token_id, 151656);
  EXPECT_EQ(c.vision_start_token_id, 151652);
  EXPECT_EQ(c.vision_end_token_id, 151653);
  EXPECT_EQ(c.vision.mlp_ratio, 4);
  EXPECT_EQ(c.vision.in_channels, 3);
  EXPECT_EQ(c.vision.patch_size, 14);
  EXPECT_EQ(c.vision.temporal_patch_size, 2);
  EXPECT_EQ(c.vision.spatial_merge_size, 2);
  EXPECT_EQ(c.vision.hidden_act, "quick_gelu");
  // Without head_dim, hidden must divide evenly.
  EXPECT_THAT(error_of(replaced(kMinimal, "\"num_attention_heads\": 4", "\"num_attention_heads\": 5")),
              AllOf(HasSubstr("64"), HasSubstr("5")));
}

TEST(QwenVlConfigTest, ToJsonRoundTrips) {
  for (const QwenVlConfig& c : {QwenVlConfig::tiny(), QwenVlConfig::from_json(kQwen2Vl2BFlat), QwenVlConfig{}}) {
    const QwenVlConfig back = QwenVlConfig::from_json(c.to_json());
    EXPECT_EQ(back, c) << c.to_json();
  }
  QwenVlConfig odd = QwenVlConfig::tiny();
  odd.rms_norm_eps = 1.0 / 3.0;  // needs all 17 digits to come back exactly
  odd.vision.hidden_act = "gelu";
  EXPECT_EQ(QwenVlConfig::from_json(odd.to_json()), odd);
}

TEST(QwenVlConfigTest, EqualityComparesEveryField) {
  const QwenVlConfig base = QwenVlConfig::tiny();
  EXPECT_EQ(base, QwenVlConfig::tiny());
  QwenVlConfig c = base;
  c.vision.spatial_merge_size = 4;
  EXPECT_FALSE(c == base);
  c = base;
  c.mrope_section = {2, 2, 4};
  EXPECT_FALSE(c == base);
  c = base;
  c.vision_end_token_id = 1;
  EXPECT_FALSE(c == base);
  c = base;
  c.vision.hidden_act = "gelu";
  EXPECT_FALSE(c == base);
}

TEST(QwenVlConfigTest, TinyMatchesItsDocumentedShape) {
  const QwenVlConfig c = QwenVlConfig::tiny();
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.hidden_size, 64);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.intermediate_size, 128);
  EXPECT_EQ(c.mrope_section, (std::vector<int64_t>{2, 3, 3}));
  EXPECT_EQ(c.vocab_size, 96);
  EXPECT_EQ(c.image_token_id, 90);
  EXPECT_EQ(c.video_token_id, 91);
  EXPECT_EQ(c.vision_start_token_id, 88);
  EXPECT_EQ(c.vision_end_token_id, 89);
  EXPECT_EQ(c.vision.depth, 2);
  EXPECT_EQ(c.vision.embed_dim, 32);
  EXPECT_EQ(c.vision.num_heads, 2);
  EXPECT_EQ(c.vision.mlp_ratio, 2);
  EXPECT_EQ(c.vision.in_channels, 3);
  EXPECT_EQ(c.vision.patch_size, 4);
  EXPECT_EQ(c.vision.temporal_patch_size, 2);
  EXPECT_EQ(c.vision.spatial_merge_size, 2);
  EXPECT_EQ(c.vision.hidden_size, 64);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.max_position_embeddings, 2048);
}

TEST(QwenVlConfigTest, ValidateNamesTheNumbers) {
  auto validate_error = [](const QwenVlConfig& c) -> std::string {
    try {
      c.validate();
    } catch (const Error& e) {
      return e.what();
    }
    return "<no error>";
  };
  QwenVlConfig c = QwenVlConfig::tiny();
  c.num_key_value_heads = 3;
  EXPECT_THAT(validate_error(c), AllOf(HasSubstr("4"), HasSubstr("3")));
  c = QwenVlConfig::tiny();
  c.mrope_section = {2, 3, 4};
  EXPECT_THAT(validate_error(c), AllOf(HasSubstr("sums to 9"), HasSubstr("8")));
  c = QwenVlConfig::tiny();
  c.vision.embed_dim = 33;
  EXPECT_THAT(validate_error(c), AllOf(HasSubstr("33"), HasSubstr("2")));
  c = QwenVlConfig::tiny();
  c.vision.hidden_size = 48;
  EXPECT_THAT(validate_error(c), AllOf(HasSubstr("48"), HasSubstr("64")));
  c = QwenVlConfig::tiny();
  c.intermediate_size = 0;
  EXPECT_THAT(validate_error(c), AllOf(HasSubstr("intermediate_size"), HasSubstr("0")));
  c = QwenVlConfig::tiny();
  c.image_token_id = 96;
  EXPECT_THAT(validate_error(c), AllOf(HasSubstr("image_token_id 96"), HasSubstr("96")));
  c = QwenVlConfig::tiny();
  c.num_key_value_heads = 0;  // must not divide by zero
  EXPECT_THAT(validate_error(c), HasSubstr("num_key_value_heads"));
}

TEST(QwenVlConfigTest, FromFileReadsAndNamesThePath) {
  std::string pattern = ::testing::TempDir() + "vlmgen_config_XXXXXX";
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const std::string path = pattern + "/config.json";
  {
    std::ofstream out(path);
    out << kQwen2Vl2BFlat;
  }
  EXPECT_EQ(QwenVlConfig::from_file(path), QwenVlConfig::from_json(kQwen2Vl2BFlat));
  {
    std::ofstream out(path);
    out << "{}";
  }
  EXPECT_THAT([&] { QwenVlConfig::from_file(path); },
              ThrowsMessage<Error>(AllOf(HasSubstr(path), HasSubstr("hidden_size"))));
  ::unlink(path.c_str());
  EXPECT_THAT([&] { QwenVlConfig::from_file(path); }, ThrowsMessage<Error>(HasSubstr(path)));
  ::rmdir(pattern.c_str());
}

}  // namespace
}  // namespace vlmgen
