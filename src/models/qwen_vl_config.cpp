#include "vlmgen/models/qwen_vl_config.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <tuple>
#include <utility>

#include "../io/json_parse.h"
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
// A JSON null counts as absent, as HF writes None that way.

namespace vlmgen {
namespace {

using Json = nlohmann::json;

// One object to look fields up in, and how to name it in messages ("text_config.").
struct Scope {
  const Json* object;
  std::string prefix;
};

const Json* find_in(const Scope& scope, const char* key) {
  auto it = scope.object->find(key);
  if (it == scope.object->end() || it->is_null()) return nullptr;
  return &*it;
}

// First scope holding `key`; `where` receives the field's full name for messages.
const Json* find_first(const std::vector<Scope>& scopes, const char* key, std::string* where) {
  for (const auto& scope : scopes) {
    if (const Json* v = find_in(scope, key)) {
      *where = scope.prefix + key;
      return v;
    }
  }
  return nullptr;
}

std::string scope_list(const std::vector<Scope>& scopes) {
  std::string out;
  for (const auto& scope : scopes) {
    if (!out.empty()) out += " or ";
    out += scope.prefix.empty() ? std::string("the top level") : scope.prefix.substr(0, scope.prefix.size() - 1);
  }
  return out;
}

int64_t as_int(const Json& v, const std::string& field, bool allow_integral_float = false) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    VLMGEN_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                 "config field '{}' is {}, beyond the int64 range", field, u);
    return static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (allow_integral_float && v.is_number_float()) {
    const double d = v.get<double>();
    VLMGEN_CHECK(std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e18,
                 "config field '{}' must be a whole number, got {}", field, d);
    return static_cast<int64_t>(d);
  }
  VLMGEN_FAIL("config field '{}' must be an integer, got JSON {} ({})", field, v.type_name(), detail::json_excerpt(v));
}

double as_double(const Json& v, const std::string& field) {
  VLMGEN_CHECK(v.is_number(), "config field '{}' must be a number, got JSON {} ({})", field, v.type_name(),
               detail::json_excerpt(v));
  return v.get<double>();
}

bool as_bool(const Json& v, const std::string& field) {
  VLMGEN_CHECK(v.is_boolean(), "config field '{}' must be a boolean, got JSON {} ({})", field, v.type_name(),
               detail::json_excerpt(v));
  return v.get<bool>();
}

std::string as_string(const Json& v, const std::string& field) {
  VLMGEN_CHECK(v.is_string(), "config field '{}' must be a string, got JSON {} ({})", field, v.type_name(),
               detail::json_excerpt(v));
  return v.get<std::string>();
}

// Typed look-ups over an ordered list of scopes; messages name the field where it was found.
class FieldReader {
 public:
  explicit FieldReader(std::vector<Scope> scopes) : scopes_(std::move(scopes)) {}

  /// The first scope's value for `key` (nullptr when absent); `field` gets its full name.
  const Json* find(const char* key, std::string* field) const { return find_first(scopes_, key, field); }

  int64_t required_int(const char* key) const {
    std::string field;
    const Json* v = find(key, &field);
    VLMGEN_CHECK(v != nullptr, "config is missing required field '{}' (looked in {})", key, scope_list(scopes_));
    return as_int(*v, field);
  }
  int64_t int_or(const char* key, int64_t fallback, bool allow_integral_float = false) const {
    std::string field;
    const Json* v = find(key, &field);
    return v ? as_int(*v, field, allow_integral_float) : fallback;
  }
  double double_or(const char* key, double fallback) const {
    std::string field;
    const Json* v = find(key, &field);
    return v ? as_double(*v, field) : fallback;
  }
  bool bool_or(const char* key, bool fallback) const {
    std::string field;
    const Json* v = find(key, &field);
    return v ? as_bool(*v, field) : fallback;
  }
  std::string string_or(const char* key, const std::string& fallback) const {
    std::string field;
    const Json* v = find(key, &field);
    return v ? as_string(*v, field) : fallback;
  }
  /// The same quantity under two spellings (in_chans / in_channels); they must agree if both set.
  int64_t aliased_int_or(const char* key, const char* alias, int64_t fallback) const {
    std::string key_field;
    std::string alias_field;
    const Json* a = find(key, &key_field);
    const Json* b = find(alias, &alias_field);
    if (a && b) {
      const int64_t va = as_int(*a, key_field);
      const int64_t vb = as_int(*b, alias_field);
      VLMGEN_CHECK(va == vb, "config fields '{}' ({}) and '{}' ({}) disagree", key_field, va, alias_field, vb);
      return va;
    }
    if (a) return as_int(*a, key_field);
    if (b) return as_int(*b, alias_field);
    return fallback;
  }

 private:
  std::vector<Scope> scopes_;
};

QwenVisionConfig parse_vision(const Json& root) {
  auto it = root.find("vision_config");
  VLMGEN_CHECK(it != root.end() && !it->is_null(), "config is missing required field '{}'", "vision_config");
  VLMGEN_CHECK(it->is_object(), "config field 'vision_config' must be an object, got JSON {}", it->type_name());
  const FieldReader r({{&*it, "vision_config."}});
  const QwenVisionConfig defaults;
  QwenVisionConfig v;
  v.depth = r.required_int("depth");
  v.embed_dim = r.required_int("embed_dim");
  v.num_heads = r.required_int("num_heads");
  v.hidden_size = r.required_int("hidden_size");
  v.mlp_ratio = r.int_or("mlp_ratio", defaults.mlp_ratio, /*allow_integral_float=*/true);
  v.in_channels = r.aliased_int_or("in_chans", "in_channels", defaults.in_channels);
  v.patch_size = r.aliased_int_or("patch_size", "spatial_patch_size", defaults.patch_size);
  v.temporal_patch_size = r.int_or("temporal_patch_size", defaults.temporal_patch_size);
  v.spatial_merge_size = r.int_or("spatial_merge_size", defaults.spatial_merge_size);
  v.hidden_act = r.string_or("hidden_act", defaults.hidden_act);
  return v;
}

std::vector<int64_t> parse_mrope_section(const FieldReader& text) {
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
  std::vector<int64_t> out;
  for (size_t i = 0; i < section->size(); ++i) {
    out.push_back(as_int((*section)[i], fmt::format("{}[{}]", field, i)));
  }
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
  c.rms_norm_eps = text.double_or("rms_norm_eps", 1e-5);
  c.rope_theta = text.double_or("rope_theta", 1000000.0);
  c.max_position_embeddings = text.int_or("max_position_embeddings", 32768);
  c.tie_word_embeddings = text.bool_or("tie_word_embeddings", false);
  c.mrope_section = parse_mrope_section(text);

  c.image_token_id = tokens.int_or("image_token_id", 151655);
  c.video_token_id = tokens.int_or("video_token_id", 151656);
  c.vision_start_token_id = tokens.int_or("vision_start_token_id", 151652);
  c.vision_end_token_id = tokens.int_or("vision_end_token_id", 151653);

  c.vision = parse_vision(root);
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
  Json vision_json = {
      {"depth", vision.depth},
      {"embed_dim", vision.embed_dim},
      {"num_heads", vision.num_heads},
      {"mlp_ratio", vision.mlp_ratio},
      {"in_chans", vision.in_channels},  // HF's spelling in Qwen2-VL checkpoints
      {"patch_size", vision.patch_size},
      {"temporal_patch_size", vision.temporal_patch_size},
      {"spatial_merge_size", vision.spatial_merge_size},
      {"hidden_size", vision.hidden_size},
      {"hidden_act", vision.hidden_act},
  };
  Json rope = Json::object();
  rope["type"] = "mrope";
  rope["mrope_section"] = mrope_section;

  Json root = Json::object();
  root["architectures"] = Json::array({"Qwen2VLForConditionalGeneration"});
  root["model_type"] = "qwen2_vl";
  root["hidden_size"] = hidden_size;
  root["num_hidden_layers"] = num_hidden_layers;
  root["num_attention_heads"] = num_attention_heads;
  root["num_key_value_heads"] = num_key_value_heads;
  root["head_dim"] = head_dim;
  root["intermediate_size"] = intermediate_size;
  root["rms_norm_eps"] = rms_norm_eps;
  root["rope_theta"] = rope_theta;
  root["rope_scaling"] = std::move(rope);
  root["vocab_size"] = vocab_size;
  root["max_position_embeddings"] = max_position_embeddings;
  root["tie_word_embeddings"] = tie_word_embeddings;
  root["image_token_id"] = image_token_id;
  root["video_token_id"] = video_token_id;
  root["vision_start_token_id"] = vision_start_token_id;
  root["vision_end_token_id"] = vision_end_token_id;
  root["vision_config"] = std::move(vision_json);
  return root.dump(2);
}

QwenVlConfig QwenVlConfig::tiny() {
  QwenVlConfig c;
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
  c.vision.mlp_ratio = 2;
  c.vision.in_channels = 3;
  c.vision.patch_size = 4;
  c.vision.temporal_patch_size = 2;
  c.vision.spatial_merge_size = 2;
  c.vision.hidden_size = 64;
  c.vision.hidden_act = "quick_gelu";
  return c;
}

bool QwenVlConfig::operator==(const QwenVlConfig& other) const {
  const auto vision_tuple = [](const QwenVisionConfig& v) {
    return std::tie(v.depth, v.embed_dim, v.num_heads, v.mlp_ratio, v.in_channels, v.patch_size, v.temporal_patch_size,
                    v.spatial_merge_size, v.hidden_size, v.hidden_act);
  };
  const auto tuple = [](const QwenVlConfig& c) {
    return std::tie(c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                    c.intermediate_size, c.rms_norm_eps, c.rope_theta, c.mrope_section, c.vocab_size,
                    c.max_position_embeddings, c.tie_word_embeddings, c.image_token_id, c.video_token_id,
                    c.vision_start_token_id, c.vision_end_token_id);
  };
  return tuple(*this) == tuple(other) && vision_tuple(vision) == vision_tuple(other.vision);
}

}  // namespace vlmgen
