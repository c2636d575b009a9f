// Gemma3Config: config.json in and out, bounds, and the parameter count. A config.json is
// untrusted input: every size is bounded (QwenVlConfigLimits) before any arithmetic on it.

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "config_reader.h"
#include "vlmgen/detail/checked_math.h"
#include "vlmgen/error.h"
#include "vlmgen/io/files.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/models/qwen_vl_config.h"

namespace vlmgen {
namespace {

using detail::FieldReader;
using detail::Json;
using detail::Scope;
using Limits = QwenVlConfigLimits;

void check_size(const char* field, int64_t value, int64_t max) {
  VLMGEN_CHECK(value >= 1 && value <= max, "gemma3 config: {} must be in [1, {}], got {}", field, max, value);
}

void check_positive(const char* field, double value) {
  VLMGEN_CHECK(std::isfinite(value) && value > 0, "gemma3 config: {} must be a positive number, got {}", field, value);
}

/// Sliding (true) or full (false) per layer, from layer_types or sliding_window_pattern.
std::vector<bool> read_layer_types(const FieldReader& text, int64_t layers) {
  std::string field;
  std::vector<bool> out;
  if (const Json* types = text.find("layer_types", &field)) {
    VLMGEN_CHECK(types->is_array() && static_cast<int64_t>(types->size()) == layers,
                 "config field '{}' must list one type per layer ({}), got {}", field, layers,
                 detail::json_excerpt(*types));
    for (size_t i = 0; i < types->size(); ++i) {
      const std::string t = detail::as_string((*types)[i], fmt::format("{}[{}]", field, i));
      VLMGEN_CHECK(t == "sliding_attention" || t == "full_attention",
                   "config field '{}[{}]' is \"{}\"; expected \"sliding_attention\" or \"full_attention\"", field, i,
                   t);
      out.push_back(t == "sliding_attention");
    }
    return out;
  }
  const int64_t pattern = text.int_or("sliding_window_pattern", 6);
  check_size("sliding_window_pattern", pattern, Limits::kMaxLayers);
  for (int64_t i = 0; i < layers; ++i) out.push_back((i + 1) % pattern != 0);
  return out;
}

/// rope_theta, its linear scaling and the local base, from transformers 4's rope_theta /
/// rope_scaling / rope_local_base_freq or transformers 5's rope_parameters per layer type.
void read_rope(const FieldReader& text, Gemma3Config& c) {
  std::string field;
  auto read_scaling = [&](const Json& rope, const std::string& where, double* factor) {
    VLMGEN_CHECK(rope.is_object(), "config field '{}' must be an object, got {}", where, detail::json_excerpt(rope));
    std::string type = "default";
    for (const char* key : {"rope_type", "type"}) {
      if (rope.contains(key)) type = detail::as_string(rope.at(key), where + "." + key);
    }
    VLMGEN_CHECK(type == "default" || type == "linear",
                 "config field '{}' asks for RoPE scaling \"{}\"; vlmgen implements Gemma-3's \"linear\" (and none)",
                 where, type);
    VLMGEN_CHECK(type != "linear" || rope.contains("factor"),
                 "config field '{}' asks for linear RoPE scaling but has no 'factor'", where);
    *factor = type == "linear" ? detail::as_double(rope.at("factor"), where + ".factor") : 1.0;
  };
  if (const Json* params = text.find("rope_parameters", &field);
      params != nullptr && params->contains("full_attention")) {
    const Json& full = params->at("full_attention");
    const Json& local = params->contains("sliding_attention") ? params->at("sliding_attention") : full;
    read_scaling(full, field + ".full_attention", &c.rope_scaling_factor);
    double local_factor = 1.0;
    read_scaling(local, field + ".sliding_attention", &local_factor);
    VLMGEN_CHECK(local_factor == 1.0,
                 "config field '{}.sliding_attention' scales RoPE by {}; Gemma-3's local layers "
                 "are not scaled",
                 field, local_factor);
    c.rope_theta = full.contains("rope_theta") ? detail::as_double(full.at("rope_theta"), field + ".full_attention")
                                               : c.rope_theta;
    c.rope_local_base_freq = local.contains("rope_theta")
                                 ? detail::as_double(local.at("rope_theta"), field + ".sliding_attention")
                                 : c.rope_local_base_freq;
    return;
  }
  c.rope_theta = text.double_or("rope_theta", c.rope_theta);
  c.rope_local_base_freq = text.double_or("rope_local_base_freq", c.rope_local_base_freq);
  if (const Json* scaling = text.find("rope_scaling", &field)) read_scaling(*scaling, field, &c.rope_scaling_factor);
}

}  // namespace

int64_t Gemma3Config::tokens_per_side() const {
  return static_cast<int64_t>(std::llround(std::sqrt(static_cast<double>(mm_tokens_per_image))));
}

void Gemma3Config::validate() const {
  check_size("hidden_size", hidden_size, Limits::kMaxHiddenSize);
  check_size("intermediate_size", intermediate_size, Limits::kMaxIntermediateSize);
  check_size("num_hidden_layers", num_hidden_layers, Limits::kMaxLayers);
  check_size("num_attention_heads", num_attention_heads, Limits::kMaxHeads);
  check_size("num_key_value_heads", num_key_value_heads, Limits::kMaxHeads);
  check_size("head_dim", head_dim, Limits::kMaxHeadDim);
  check_size("vocab_size", vocab_size, Limits::kMaxVocabSize);
  check_size("max_position_embeddings", max_position_embeddings, Limits::kMaxPositionEmbeddings);
  check_size("sliding_window", sliding_window, Limits::kMaxPositionEmbeddings);
  check_size("vision_config.hidden_size", vision_hidden_size, Limits::kMaxHiddenSize);
  check_size("vision_config.intermediate_size", vision_intermediate_size, Limits::kMaxIntermediateSize);
  check_size("vision_config.num_hidden_layers", vision_num_hidden_layers, Limits::kMaxLayers);
  check_size("vision_config.num_attention_heads", vision_num_attention_heads, Limits::kMaxHeads);
  check_size("vision_config.num_channels", num_channels, Limits::kMaxInChannels);
  check_size("vision_config.patch_size", patch_size, Limits::kMaxPatchSize);
  check_size("vision_config.image_size", image_size, Limits::kMaxPatchSize * Limits::kMaxPatchSize);
  check_size("mm_tokens_per_image", mm_tokens_per_image, Limits::kMaxPositionEmbeddings);
  check_positive("rms_norm_eps", rms_norm_eps);
  check_positive("vision_config.layer_norm_eps", vision_layer_norm_eps);
  check_positive("rope_theta", rope_theta);
  check_positive("rope_local_base_freq", rope_local_base_freq);
  check_positive("rope_scaling.factor", rope_scaling_factor);
  check_positive("query_pre_attn_scalar", query_pre_attn_scalar);
  VLMGEN_CHECK(final_logit_softcapping >= 0 && std::isfinite(final_logit_softcapping),
               "gemma3 config: final_logit_softcapping must be >= 0 (0 for none), got {}", final_logit_softcapping);
  VLMGEN_CHECK(num_attention_heads % num_key_value_heads == 0,
               "gemma3 config: num_attention_heads {} must be a multiple of num_key_value_heads {}",
               num_attention_heads, num_key_value_heads);
  VLMGEN_CHECK(head_dim % 2 == 0, "gemma3 config: head_dim must be even for RoPE, got {}", head_dim);
  VLMGEN_CHECK(vision_hidden_size % vision_num_attention_heads == 0,
               "gemma3 config: vision_config.hidden_size {} must be a multiple of its num_attention_heads {}",
               vision_hidden_size, vision_num_attention_heads);
  VLMGEN_CHECK(image_size % patch_size == 0,
               "gemma3 config: vision_config.image_size {} is not a multiple of patch_size {}", image_size, patch_size);
  const int64_t side = tokens_per_side();
  VLMGEN_CHECK(side * side == mm_tokens_per_image && patches_per_side() % side == 0,
               "gemma3 config: mm_tokens_per_image {} must be a square whose side divides the {} patches per image "
               "side (image_size {} / patch_size {})",
               mm_tokens_per_image, patches_per_side(), image_size, patch_size);
  VLMGEN_CHECK(static_cast<int64_t>(sliding_layers.size()) == num_hidden_layers,
               "gemma3 config: {} layer types for {} layers", sliding_layers.size(), num_hidden_layers);
  for (const auto& [name, id] : {std::pair<const char*, int64_t>{"image_token_index", image_token_id},
                                 {"boi_token_index", boi_token_id},
                                 {"eoi_token_index", eoi_token_id}}) {
    VLMGEN_CHECK(id >= 0 && id < vocab_size, "gemma3 config: {} {} is outside the vocabulary [0, {})", name, id,
                 vocab_size);
  }
  const int64_t params = parameter_count();
  VLMGEN_CHECK(params <= Limits::kMaxParameters, "gemma3 config describes {} weights, more than the limit {}", params,
               Limits::kMaxParameters);
}

int64_t Gemma3Config::parameter_count() const {
  using detail::checked_add;
  using detail::checked_mul;
  constexpr const char* kWhat = "gemma3 config: the number of weights";
  auto mul = [&](int64_t a, int64_t b) { return checked_mul(a, b, kWhat); };
  auto add = [&](int64_t a, int64_t b) { return checked_add(a, b, kWhat); };
  const int64_t h = hidden_size, q = mul(num_attention_heads, head_dim), kv = mul(num_key_value_heads, head_dim);
  int64_t layer = add(mul(4, h), mul(2, head_dim));                // four norms, q/k norms
  layer = add(layer, add(mul(2, mul(q, h)), mul(2, mul(kv, h))));  // q, o, k, v
  layer = add(layer, mul(3, mul(intermediate_size, h)));           // gate, up, down
  int64_t total = add(mul(layer, num_hidden_layers), add(mul(vocab_size, h), h));
  if (!tie_word_embeddings) total = add(total, mul(vocab_size, h));
  const int64_t e = vision_hidden_size, patches = mul(patches_per_side(), patches_per_side());
  int64_t vision = add(mul(e, mul(num_channels, mul(patch_size, patch_size))), e);
  vision = add(vision, mul(patches, e));
  int64_t vlayer = add(mul(4, e), mul(4, add(mul(e, e), e)));
  vlayer = add(vlayer, add(add(mul(vision_intermediate_size, e), vision_intermediate_size),
                           add(mul(e, vision_intermediate_size), e)));
  vision = add(vision, mul(vlayer, vision_num_hidden_layers));
  vision = add(vision, add(mul(2, e), add(e, mul(e, h))));  // post_layernorm, soft-emb norm, projection
  return add(total, vision);
}

Gemma3Config Gemma3Config::from_json(const std::string& text_in) {
  const Json root = detail::parse_json(text_in, "config", JsonLimits().max_bytes(Limits::kMaxConfigBytes));
  VLMGEN_CHECK(root.is_object(), "config must be a JSON object, got {}", root.type_name());
  for (const char* section : {"text_config", "vision_config"}) {
    VLMGEN_CHECK(!root.contains(section) || root.at(section).is_null() || root.at(section).is_object(),
                 "gemma3 config: {} must be an object, got JSON {} ({})", section, root.at(section).type_name(),
                 detail::json_excerpt(root.at(section)));
  }
  std::vector<Scope> text_scopes;
  if (root.contains("text_config") && root.at("text_config").is_object())
    text_scopes.push_back({&root.at("text_config"), "text_config."});
  text_scopes.push_back({&root, ""});
  const FieldReader text(text_scopes);
  const FieldReader top({{&root, ""}});
  Gemma3Config c;
  c.vocab_size = text.int_or("vocab_size", c.vocab_size);
  c.hidden_size = text.int_or("hidden_size", c.hidden_size);
  c.intermediate_size = text.int_or("intermediate_size", c.intermediate_size);
  c.num_hidden_layers = text.int_or("num_hidden_layers", c.num_hidden_layers);
  c.num_attention_heads = text.int_or("num_attention_heads", c.num_attention_heads);
  c.num_key_value_heads = text.int_or("num_key_value_heads", c.num_key_value_heads);
  c.head_dim = text.int_or("head_dim", c.head_dim);
  c.rms_norm_eps = text.double_or("rms_norm_eps", c.rms_norm_eps);
  c.query_pre_attn_scalar = text.double_or("query_pre_attn_scalar", c.query_pre_attn_scalar);
  c.sliding_window = text.int_or("sliding_window", c.sliding_window);
  c.max_position_embeddings = text.int_or("max_position_embeddings", c.max_position_embeddings);
  c.final_logit_softcapping = text.double_or("final_logit_softcapping", 0.0);
  c.tie_word_embeddings = top.bool_or("tie_word_embeddings", text.bool_or("tie_word_embeddings", true));
  check_size("num_hidden_layers", c.num_hidden_layers, Limits::kMaxLayers);
  c.sliding_layers = read_layer_types(text, c.num_hidden_layers);
  read_rope(text, c);
  const std::string act = text.string_or("hidden_activation", text.string_or("hidden_act", "gelu_pytorch_tanh"));
  VLMGEN_CHECK(act == "gelu_pytorch_tanh",
               "gemma3 config: hidden_activation \"{}\" is not supported (gelu_pytorch_tanh)", act);
  std::string field;
  const Json* attn_cap = text.find("attn_logit_softcapping", &field);
  VLMGEN_CHECK(attn_cap == nullptr, "gemma3 config: {} is set ({}); vlmgen does not soft-cap attention scores", field,
               detail::json_excerpt(*attn_cap));

  static const Json kEmpty = Json::object();
  const Json& vision_json =
      root.contains("vision_config") && root.at("vision_config").is_object() ? root.at("vision_config") : kEmpty;
  const FieldReader vision({{&vision_json, "vision_config."}});
  c.vision_hidden_size = vision.int_or("hidden_size", 768);
  c.vision_intermediate_size = vision.int_or("intermediate_size", 3072);
  c.vision_num_hidden_layers = vision.int_or("num_hidden_layers", 12);
  c.vision_num_attention_heads = vision.int_or("num_attention_heads", 12);
  c.num_channels = vision.int_or("num_channels", 3);
  c.image_size = vision.int_or("image_size", 224);
  c.patch_size = vision.int_or("patch_size", 16);
  c.vision_layer_norm_eps = vision.double_or("layer_norm_eps", 1e-6);
  const std::string vision_act = vision.string_or("hidden_act", "gelu_pytorch_tanh");
  VLMGEN_CHECK(vision_act == "gelu_pytorch_tanh",
               "gemma3 config: vision_config.hidden_act \"{}\" is not supported (gelu_pytorch_tanh)", vision_act);
  VLMGEN_CHECK(!vision.bool_or("vision_use_head", false),
               "gemma3 config: vision_config.vision_use_head is true; Gemma-3 uses the tower without its pooling head");

  c.image_token_id = top.int_or("image_token_index", top.int_or("image_token_id", c.image_token_id));
  c.boi_token_id = top.int_or("boi_token_index", c.boi_token_id);
  c.eoi_token_id = top.int_or("eoi_token_index", c.eoi_token_id);
  c.mm_tokens_per_image = top.int_or("mm_tokens_per_image", c.mm_tokens_per_image);
  c.validate();
  return c;
}

Gemma3Config Gemma3Config::from_file(const std::string& path) {
  const std::string text = read_regular_file(path, "config file", Limits::kMaxConfigBytes);
  try {
    return from_json(text);
  } catch (const Error& e) {
    VLMGEN_FAIL("config file '{}': {}", path, e.what());
  }
}

std::string Gemma3Config::to_json() const {
  Json text = {{"model_type", "gemma3_text"},
               {"vocab_size", vocab_size},
               {"hidden_size", hidden_size},
               {"intermediate_size", intermediate_size},
               {"num_hidden_layers", num_hidden_layers},
               {"num_attention_heads", num_attention_heads},
               {"num_key_value_heads", num_key_value_heads},
               {"head_dim", head_dim},
               {"rms_norm_eps", rms_norm_eps},
               {"rope_theta", rope_theta},
               {"rope_local_base_freq", rope_local_base_freq},
               {"query_pre_attn_scalar", query_pre_attn_scalar},
               {"sliding_window", sliding_window},
               {"max_position_embeddings", max_position_embeddings},
               {"hidden_activation", "gelu_pytorch_tanh"},
               {"attn_logit_softcapping", nullptr},
               {"tie_word_embeddings", tie_word_embeddings}};
  text["final_logit_softcapping"] = final_logit_softcapping > 0 ? Json(final_logit_softcapping) : Json(nullptr);
  text["rope_scaling"] =
      rope_scaling_factor != 1.0 ? Json{{"rope_type", "linear"}, {"factor", rope_scaling_factor}} : Json(nullptr);
  Json types = Json::array();
  for (bool slides : sliding_layers) types.push_back(slides ? "sliding_attention" : "full_attention");
  text["layer_types"] = std::move(types);
  const Json vision = {{"model_type", "siglip_vision_model"},
                       {"hidden_size", vision_hidden_size},
                       {"intermediate_size", vision_intermediate_size},
                       {"num_hidden_layers", vision_num_hidden_layers},
                       {"num_attention_heads", vision_num_attention_heads},
                       {"num_channels", num_channels},
                       {"image_size", image_size},
                       {"patch_size", patch_size},
                       {"layer_norm_eps", vision_layer_norm_eps},
                       {"hidden_act", "gelu_pytorch_tanh"},
                       {"vision_use_head", false}};
  const Json root = {{"architectures", Json::array({"Gemma3ForConditionalGeneration"})},
                     {"model_type", "gemma3"},
                     {"text_config", text},
                     {"vision_config", vision},
                     {"image_token_index", image_token_id},
                     {"boi_token_index", boi_token_id},
                     {"eoi_token_index", eoi_token_id},
                     {"mm_tokens_per_image", mm_tokens_per_image},
                     {"tie_word_embeddings", tie_word_embeddings}};
  return root.dump(2);
}

Gemma3Config Gemma3Config::tiny() {
  Gemma3Config c;
  c.vocab_size = 96;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.rope_theta = 1000000.0;
  c.rope_scaling_factor = 8.0;
  c.rope_local_base_freq = 10000.0;
  c.query_pre_attn_scalar = 24;
  c.sliding_window = 5;
  c.sliding_layers = {true, false, true, false};
  c.max_position_embeddings = 4096;
  c.vision_hidden_size = 32;
  c.vision_intermediate_size = 48;
  c.vision_num_hidden_layers = 2;
  c.vision_num_attention_heads = 2;
  c.image_size = 16;
  c.patch_size = 4;
  c.image_token_id = 90;
  c.boi_token_id = 88;
  c.eoi_token_id = 89;
  c.mm_tokens_per_image = 4;
  return c;
}

}  // namespace vlmgen
