#include "vlmgen/models/qwen_vl_config.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <tuple>
#include <utility>

#include "../io/json_parse.h"
#include "config_reader.h"
#include "qwen_family.h"
#include "vlmgen/error.h"
#include "vlmgen/io/files.h"

// Which fields are required and which fall back to a default when config.json lacks them:
//
// Required: every field that fixes a weight shape -- hidden_size, num_hidden_layers,
// num_attention_heads, num_key_value_heads, intermediate_size, vocab_size,
// rope_scaling.mrope_section, vision_config and its depth, embed_dim, num_heads, hidden_size.
// HF's Qwen2VLConfig has defaults for most of these, but they describe the 72B model; a config
// that lacks one is broken, and filling in 72B numbers would only fail later, at weight loading,
// with a less helpful message.
//
// Defaulted, with the values of HF's Qwen2VLConfig / Qwen2VLVisionConfig:
//   rms_norm_eps 1e-5, rope_theta 1e6, max_position_embeddings 32768, tie_word_embeddings false,
//   image_token_id 151655, video_token_id 151656, vision_start_token_id 151652,
//   vision_end_token_id 151653; vision mlp_ratio 4, in_channels 3, patch_size 14,
//   temporal_patch_size 2, spatial_merge_size 2, hidden_act "quick_gelu".
// head_dim: "head_dim" when present (and not null), else hidden_size / num_attention_heads.
//
// The family comes from model_type, else architectures[0], else Qwen2-VL. Each family file
// (families/*.cpp) reads its own vision fields and defaults: Qwen2.5-VL and Qwen3-VL require
// vision hidden_size (the block width), out_hidden_size and intermediate_size; Qwen2.5-VL
// defaults window_size 112 and fullatt_block_indexes [7, 15, 23, 31]; Qwen3-VL defaults
// num_position_embeddings 2304, deepstack_visual_indexes [8, 16, 24], rope_theta 5e6,
// attention_bias false and interleaved M-RoPE.
//
// A JSON null counts as absent, as HF writes None that way.

namespace vlmgen {

const char* family_model_type(QwenFamily family) { return detail::family_spec(family).model_type; }

std::optional<QwenFamily> family_from_name(const std::string& name) {
  for (QwenFamily f : {QwenFamily::kQwen2Vl, QwenFamily::kQwen2_5Vl, QwenFamily::kQwen3Vl}) {
    const detail::QwenFamilySpec& spec = detail::family_spec(f);
    if (name == spec.model_type || name == spec.architecture) return f;
  }
  return std::nullopt;
}

std::string supported_family_names() { return "qwen2_vl, qwen2_5_vl, qwen3_vl"; }

namespace {

using Json = nlohmann::json;
using detail::as_int;
using detail::as_string;
using detail::FieldReader;
using detail::Scope;

QwenVisionConfig parse_vision(const Json& root, const detail::QwenFamilySpec& spec) {
  auto it = root.find("vision_config");
  VLMGEN_CHECK(it != root.end() && !it->is_null(), "config is missing required field '{}'", "vision_config");
  VLMGEN_CHECK(it->is_object(), "config field 'vision_config' must be an object, got JSON {}", it->type_name());
  const FieldReader r({{&*it, "vision_config."}});
  const QwenVisionConfig defaults;
  QwenVisionConfig v;
  v.depth = r.required_int("depth");
  v.num_heads = r.required_int("num_heads");
  v.in_channels = r.aliased_int_or("in_chans", "in_channels", defaults.in_channels);
  v.temporal_patch_size = r.int_or("temporal_patch_size", defaults.temporal_patch_size);
  v.spatial_merge_size = r.int_or("spatial_merge_size", defaults.spatial_merge_size);
  spec.read_vision(r, v);  // the fields whose names or meaning differ by family
  return v;
}

/// The family a config.json describes: model_type first, then architectures[0]; a config with
/// neither is read as Qwen2-VL (the only family older vlmgen checkpoints were written for).
QwenFamily detect_family(const Json& root) {
  auto model_type = root.find("model_type");
  if (model_type != root.end() && !model_type->is_null()) {
    const std::string name = as_string(*model_type, "model_type");
    std::optional<QwenFamily> family = family_from_name(name);
    VLMGEN_CHECK(family.has_value(), "config model_type '{}' is not a Qwen-VL family this config reads ({})", name,
                 supported_family_names());
    return *family;
  }
  auto architectures = root.find("architectures");
  if (architectures != root.end() && architectures->is_array() && !architectures->empty()) {
    const std::string name = as_string((*architectures)[0], "architectures[0]");
    std::optional<QwenFamily> family = family_from_name(name);
    VLMGEN_CHECK(family.has_value(), "config architectures[0] '{}' is not a Qwen-VL family this config reads ({})",
                 name, supported_family_names());
    return *family;
  }
  return QwenFamily::kQwen2Vl;
}

struct RopeFields {
  std::vector<int64_t> mrope_section;
  std::optional<double> theta;
};

RopeFields parse_rope(const FieldReader& text) {
  // transformers >= 5 calls it rope_parameters; older versions rope_scaling.
  std::string rope_field;
  const Json* rope = text.find("rope_scaling", &rope_field);
  if (rope == nullptr) rope = text.find("rope_parameters", &rope_field);
  VLMGEN_CHECK(rope != nullptr, "config is missing required field 'rope_scaling' (with mrope_section)");
  VLMGEN_CHECK(rope->is_object(), "config field '{}' must be an object, got JSON {}", rope_field, rope->type_name());
  for (const char* type_key : {"type", "rope_type"}) {
    auto t = rope->find(type_key);
    if (t == rope->end() || t->is_null()) continue;
    const std::string field = rope_field + "." + type_key;
    const std::string type = as_string(*t, field);
    // Newer transformers rewrite "mrope" to "default" and keep mrope_section beside it.
    VLMGEN_CHECK(type == "mrope" || type == "default",
                 "config field '{}' is '{}'; only 'mrope' (or 'default' with mrope_section) is "
                 "supported",
                 field, type);
  }
  const std::string field = rope_field + ".mrope_section";
  auto section = rope->find("mrope_section");
  VLMGEN_CHECK(section != rope->end() && !section->is_null(), "config is missing required field '{}'", field);
  VLMGEN_CHECK(section->is_array(), "config field '{}' must be an array, got JSON {}", field, section->type_name());
  RopeFields out;
  for (size_t i = 0; i < section->size(); ++i) {
    out.mrope_section.push_back(as_int((*section)[i], fmt::format("{}[{}]", field, i)));
  }
  auto theta = rope->find("rope_theta");
  if (theta != rope->end() && !theta->is_null()) out.theta = detail::as_double(*theta, rope_field + ".rope_theta");
  return out;
}

}  // namespace

QwenVlConfig QwenVlConfig::from_json(const std::string& json_text) {
  const Json root =
      detail::parse_json(json_text, "config", JsonLimits().max_bytes(QwenVlConfigLimits::kMaxConfigBytes));
  VLMGEN_CHECK(root.is_object(), "config must be a JSON object, got {}", root.type_name());

  // Text fields: text_config first (newer transformers), then the top level (flat layout).
  // Token ids: the other way round, as the nested layout keeps them at the top level.
  std::vector<Scope> text_scopes;
  std::vector<Scope> token_scopes = {{&root, ""}};
  auto text_config = root.find("text_config");
  if (text_config != root.end() && !text_config->is_null()) {
    VLMGEN_CHECK(text_config->is_object(), "config field 'text_config' must be an object, got {}",
                 text_config->type_name());
    text_scopes.push_back({&*text_config, "text_config."});
    token_scopes.push_back({&*text_config, "text_config."});
  }
  text_scopes.push_back({&root, ""});
  const FieldReader text(text_scopes);
  const FieldReader tokens(token_scopes);

  QwenVlConfig c;
  c.family = detect_family(root);
  const detail::QwenFamilySpec& spec = detail::family_spec(c.family);
  c.hidden_size = text.required_int("hidden_size");
  c.num_hidden_layers = text.required_int("num_hidden_layers");
  c.num_attention_heads = text.required_int("num_attention_heads");
  c.num_key_value_heads = text.required_int("num_key_value_heads");
  c.intermediate_size = text.required_int("intermediate_size");
  c.vocab_size = text.required_int("vocab_size");
  std::string head_dim_field;
  if (const Json* head_dim = text.find("head_dim", &head_dim_field)) {
    c.head_dim = as_int(*head_dim, head_dim_field);
  } else {
    VLMGEN_CHECK(c.num_attention_heads > 0 && c.hidden_size % c.num_attention_heads == 0,
                 "config has no head_dim and hidden_size {} is not divisible by "
                 "num_attention_heads {}",
                 c.hidden_size, c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.rms_norm_eps = text.double_or("rms_norm_eps", spec.default_rms_norm_eps);
  c.rope_theta = text.double_or("rope_theta", spec.default_rope_theta);
  c.max_position_embeddings = text.int_or("max_position_embeddings", spec.default_max_position_embeddings);
  c.tie_word_embeddings = text.bool_or("tie_word_embeddings", false);
  RopeFields rope = parse_rope(text);
  c.mrope_section = rope.mrope_section;
  if (rope.theta) c.rope_theta = *rope.theta;  // transformers >= 5 keeps it in rope_parameters
  // As HF does: Qwen3-VL always interleaves M-RoPE and reads attention_bias; Qwen2-VL and
  // Qwen2.5-VL always use chunked sections and q/k/v biases, whatever the file says.
  c.mrope_interleaved = spec.qwen3_text;
  c.attention_bias = spec.qwen3_text ? text.bool_or("attention_bias", false) : true;
  c.qk_norm = spec.qwen3_text;

  c.image_token_id = tokens.int_or("image_token_id", 151655);
  c.video_token_id = tokens.int_or("video_token_id", 151656);
  c.vision_start_token_id = tokens.int_or("vision_start_token_id", 151652);
  c.vision_end_token_id = tokens.int_or("vision_end_token_id", 151653);

  c.vision = parse_vision(root, spec);
  return c;
}

QwenVlConfig QwenVlConfig::from_file(const std::string& path) {
  const std::string text = read_regular_file(path, "config file", QwenVlConfigLimits::kMaxConfigBytes);
  try {
    return from_json(text);
  } catch (const Error& e) {
    VLMGEN_FAIL("config file '{}': {}", path, e.what());
  }
}

std::string QwenVlConfig::to_json() const {
  const detail::QwenFamilySpec& spec = detail::family_spec(family);
  Json vision_json = spec.write_vision(vision);
  vision_json["depth"] = vision.depth;
  vision_json["num_heads"] = vision.num_heads;
  vision_json["temporal_patch_size"] = vision.temporal_patch_size;
  vision_json["spatial_merge_size"] = vision.spatial_merge_size;
  Json rope = Json::object();
  rope[spec.qwen3_text ? "rope_type" : "type"] = spec.qwen3_text ? "default" : "mrope";
  rope["mrope_section"] = mrope_section;
  if (mrope_interleaved || spec.qwen3_text) rope["mrope_interleaved"] = mrope_interleaved;

  Json text = Json::object();
  text["hidden_size"] = hidden_size;
  text["num_hidden_layers"] = num_hidden_layers;
  text["num_attention_heads"] = num_attention_heads;
  text["num_key_value_heads"] = num_key_value_heads;
  text["head_dim"] = head_dim;
  text["intermediate_size"] = intermediate_size;
  text["rms_norm_eps"] = rms_norm_eps;
  text["rope_theta"] = rope_theta;
  text["rope_scaling"] = std::move(rope);
  text["vocab_size"] = vocab_size;
  text["max_position_embeddings"] = max_position_embeddings;
  if (spec.qwen3_text || !attention_bias) text["attention_bias"] = attention_bias;

  Json root = Json::object();
  root["architectures"] = Json::array({spec.architecture});
  root["model_type"] = spec.model_type;
  if (spec.nested_text_config) {
    text["model_type"] = std::string(spec.model_type) + "_text";
    text["tie_word_embeddings"] = tie_word_embeddings;  // HF reads it here too
    root["text_config"] = std::move(text);
  } else {
    root.update(text);
  }
  root["tie_word_embeddings"] = tie_word_embeddings;
  root["image_token_id"] = image_token_id;
  root["video_token_id"] = video_token_id;
  root["vision_start_token_id"] = vision_start_token_id;
  root["vision_end_token_id"] = vision_end_token_id;
  root["vision_config"] = std::move(vision_json);
  return root.dump(2);
}

QwenVlConfig QwenVlConfig::tiny(QwenFamily family) {
  QwenVlConfig c;
  c.family = family;
  const detail::QwenFamilySpec& spec = detail::family_spec(family);
  c.mrope_interleaved = spec.qwen3_text;
  c.attention_bias = !spec.qwen3_text;
  c.qk_norm = spec.qwen3_text;
  c.hidden_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.intermediate_size = 128;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  c.mrope_section = {2, 3, 3};
  c.vocab_size = 96;
  c.max_position_embeddings = 2048;
  c.tie_word_embeddings = false;
  c.image_token_id = 90;
  c.video_token_id = 91;
  c.vision_start_token_id = 88;
  c.vision_end_token_id = 89;
  c.vision.depth = 2;
  c.vision.embed_dim = 32;
  c.vision.num_heads = 2;
  c.vision.in_channels = 3;
  c.vision.patch_size = 4;
  c.vision.temporal_patch_size = 2;
  c.vision.spatial_merge_size = 2;
  c.vision.hidden_size = 64;
  spec.tiny_vision(c.vision);
  if (c.mrope_interleaved) c.mrope_section = {3, 3, 2};  // t at 0, 3, 6; h at 1, 4, 7; w at 2, 5
  return c;
}

bool QwenVlConfig::operator==(const QwenVlConfig& other) const {
  const auto vision_tuple = [](const QwenVisionConfig& v) {
    return std::tie(v.depth, v.embed_dim, v.num_heads, v.mlp_ratio, v.in_channels, v.patch_size, v.temporal_patch_size,
                    v.spatial_merge_size, v.hidden_size, v.hidden_act, v.intermediate_size, v.window_size,
                    v.fullatt_block_indexes, v.num_position_embeddings, v.deepstack_visual_indexes);
  };
  const auto tuple = [](const QwenVlConfig& c) {
    return std::tie(c.family, c.mrope_interleaved, c.attention_bias, c.qk_norm, c.hidden_size, c.num_hidden_layers,
                    c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps,
                    c.rope_theta, c.mrope_section, c.vocab_size, c.max_position_embeddings, c.tie_word_embeddings,
                    c.image_token_id, c.video_token_id, c.vision_start_token_id, c.vision_end_token_id);
  };
  return tuple(*this) == tuple(other) && vision_tuple(vision) == vision_tuple(other.vision);
}

}  // namespace vlmgen
