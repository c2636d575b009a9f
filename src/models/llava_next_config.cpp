// LlavaNextConfig: config.json in and out, bounds, the anyres rule and the placeholder count.

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "config_reader.h"
#include "vlmgen/detail/checked_math.h"
#include "vlmgen/error.h"
#include "vlmgen/io/files.h"
#include "vlmgen/models/llava_next.h"

namespace vlmgen {
namespace {

using detail::FieldReader;
using detail::Json;
using Limits = QwenVlConfigLimits;

void check_size(const char* field, int64_t value, int64_t max) {
  VLMGEN_CHECK(value >= 1 && value <= max, "llava_next config: {} must be in [1, {}], got {}", field, max, value);
}

/// Python's round(x, 7) then int(): the processor's and the model's rounding of a scaled side.
int64_t round7(double x) { return static_cast<int64_t>(std::nearbyint(x * 1e7) / 1e7); }

/// text_config: a Llama or Mistral decoder (MistralConfig's or LlamaConfig's defaults); anything
/// vlmgen's Llama text model does not compute is refused by name. `t` is the raw section.
void read_text(const FieldReader& text, const Json& t, LlavaNextConfig& c) {
  c.text_model_type = text.string_or("model_type", "llama");
  VLMGEN_CHECK(c.text_model_type == "llama" || c.text_model_type == "mistral",
               "llava_next config: text_config.model_type \"{}\" is not supported (llama, mistral)", c.text_model_type);
  const bool mistral = c.text_model_type == "mistral";
  c.vocab_size = text.int_or("vocab_size", 32000);
  c.hidden_size = text.int_or("hidden_size", 4096);
  c.intermediate_size = text.int_or("intermediate_size", mistral ? 14336 : 11008);
  c.num_hidden_layers = text.int_or("num_hidden_layers", 32);
  c.num_attention_heads = text.int_or("num_attention_heads", 32);
  c.num_key_value_heads = text.int_or("num_key_value_heads", mistral ? 8 : c.num_attention_heads);
  check_size("text_config.num_attention_heads", c.num_attention_heads, Limits::kMaxHeads);
  c.head_dim = text.int_or("head_dim", c.hidden_size / c.num_attention_heads);
  c.rms_norm_eps = text.double_or("rms_norm_eps", 1e-6);
  c.rope_theta = text.double_or("rope_theta", 10000.0);
  std::string where;
  if (const Json* params = text.find("rope_parameters", &where)) {  // transformers >= 5
    VLMGEN_CHECK(params->is_object(), "config field '{}' must be an object, got {}", where,
                 detail::json_excerpt(*params));
    const std::string type =
        params->contains("rope_type") ? detail::as_string(params->at("rope_type"), where) : "default";
    VLMGEN_CHECK(type == "default",
                 "llava_next config: {} asks for RoPE scaling \"{}\"; vlmgen's Llama text model has "
                 "none",
                 where, type);
    if (params->contains("rope_theta"))
      c.rope_theta = detail::as_double(params->at("rope_theta"), where + ".rope_theta");
  }
  c.max_position_embeddings = text.int_or("max_position_embeddings", mistral ? 131072 : 2048);
  std::string field;
  const Json* scaling = text.find("rope_scaling", &field);
  VLMGEN_CHECK(scaling == nullptr, "llava_next config: {} is set ({}); vlmgen's Llama text model has no RoPE scaling",
               field, detail::json_excerpt(*scaling));
  VLMGEN_CHECK(!text.bool_or("attention_bias", false),
               "llava_next config: text_config.attention_bias is not supported");
  VLMGEN_CHECK(!text.bool_or("mlp_bias", false), "llava_next config: text_config.mlp_bias is not supported");
  const std::string act = text.string_or("hidden_act", "silu");
  VLMGEN_CHECK(act == "silu", "llava_next config: text_config.hidden_act \"{}\" is not supported (silu)", act);
  if (mistral) {  // MistralConfig's default window is 4096; an explicit null turns it off
    const bool windowed = !t.contains("sliding_window") || !t.at("sliding_window").is_null();
    VLMGEN_CHECK(!windowed,
                 "llava_next config: the Mistral text model has a sliding window ({}); vlmgen's Llama text "
                 "model attends over the whole context",
                 t.contains("sliding_window") ? detail::json_excerpt(t.at("sliding_window")) : "4096 by default");
  }
}

/// vision_config: a CLIP tower (LlavaNextConfig's default: CLIP ViT-L/14 at 336 pixels).
void read_vision(const FieldReader& vision, LlavaNextConfig& c) {
  const std::string type = vision.string_or("model_type", "clip_vision_model");
  VLMGEN_CHECK(type == "clip_vision_model",
               "llava_next config: vision_config.model_type \"{}\" is not supported "
               "(clip_vision_model)",
               type);
  c.vision_hidden_size = vision.int_or("hidden_size", 1024);
  c.vision_intermediate_size = vision.int_or("intermediate_size", 4096);
  c.vision_num_hidden_layers = vision.int_or("num_hidden_layers", 24);
  c.vision_num_attention_heads = vision.int_or("num_attention_heads", 16);
  c.num_channels = vision.int_or("num_channels", 3);
  c.image_size = vision.int_or("image_size", 336);
  c.patch_size = vision.int_or("patch_size", 14);
  c.vision_layer_norm_eps = vision.double_or("layer_norm_eps", 1e-5);
  const std::string act = vision.string_or("hidden_act", "quick_gelu");
  VLMGEN_CHECK(act == "quick_gelu" || act == "gelu",
               "llava_next config: vision_config.hidden_act \"{}\" is not supported (quick_gelu, gelu)", act);
  c.vision_quick_gelu = act == "quick_gelu";
}

}  // namespace

int64_t LlavaNextConfig::vision_layers_used() const {
  return vision_feature_layer >= 0 ? vision_feature_layer : vision_num_hidden_layers + 1 + vision_feature_layer;
}

void LlavaNextConfig::validate() const {
  check_size("hidden_size", hidden_size, Limits::kMaxHiddenSize);
  check_size("vocab_size", vocab_size, Limits::kMaxVocabSize);
  check_size("vision_config.hidden_size", vision_hidden_size, Limits::kMaxHiddenSize);
  check_size("vision_config.intermediate_size", vision_intermediate_size, Limits::kMaxIntermediateSize);
  check_size("vision_config.num_hidden_layers", vision_num_hidden_layers, Limits::kMaxLayers);
  check_size("vision_config.num_attention_heads", vision_num_attention_heads, Limits::kMaxHeads);
  check_size("vision_config.num_channels", num_channels, Limits::kMaxInChannels);
  check_size("vision_config.patch_size", patch_size, Limits::kMaxPatchSize);
  check_size("vision_config.image_size", image_size, Limits::kMaxPatchSize * Limits::kMaxPatchSize);
  VLMGEN_CHECK(image_size % patch_size == 0, "llava_next config: image_size {} is not a multiple of patch_size {}",
               image_size, patch_size);
  VLMGEN_CHECK(vision_hidden_size % vision_num_attention_heads == 0,
               "llava_next config: vision hidden_size {} is not a multiple of its num_attention_heads {}",
               vision_hidden_size, vision_num_attention_heads);
  VLMGEN_CHECK(std::isfinite(vision_layer_norm_eps) && vision_layer_norm_eps > 0,
               "llava_next config: vision_config.layer_norm_eps must be a positive number, got {}",
               vision_layer_norm_eps);
  VLMGEN_CHECK(
      vision_feature_layer >= -(vision_num_hidden_layers + 1) && vision_feature_layer <= vision_num_hidden_layers,
      "llava_next config: vision_feature_layer {} is outside the {} CLIP layers", vision_feature_layer,
      vision_num_hidden_layers);
  VLMGEN_CHECK(vision_layers_used() >= 0 && vision_layers_used() <= vision_num_hidden_layers,
               "llava_next config: vision_feature_layer {} is outside the {} CLIP layers", vision_feature_layer,
               vision_num_hidden_layers);
  VLMGEN_CHECK(image_token_id >= 0 && image_token_id < vocab_size,
               "llava_next config: image_token_index {} is outside the vocabulary [0, {})", image_token_id, vocab_size);
  VLMGEN_CHECK(!image_grid_pinpoints.empty() && image_grid_pinpoints.size() <= 1024,
               "llava_next config: image_grid_pinpoints must list 1 to 1024 resolutions, got {}",
               image_grid_pinpoints.size());
  for (const auto& [h, w] : image_grid_pinpoints) {
    VLMGEN_CHECK(h >= image_size && w >= image_size && h % image_size == 0 && w % image_size == 0 &&
                     h / image_size <= 64 && w / image_size <= 64,
                 "llava_next config: image_grid_pinpoints entry [{}, {}] must be multiples of image_size {} of at "
                 "most 64 tiles a side",
                 h, w, image_size);
  }
  language_model_config().validate();
}

int64_t LlavaNextConfig::parameter_count() const {
  using detail::checked_add;
  using detail::checked_mul;
  constexpr const char* kWhat = "llava_next config: the number of weights";
  auto mul = [&](int64_t a, int64_t b) { return checked_mul(a, b, kWhat); };
  auto add = [&](int64_t a, int64_t b) { return checked_add(a, b, kWhat); };
  const int64_t e = vision_hidden_size, p = patches_per_side() * patches_per_side();
  int64_t vision = add(e, mul(e, mul(num_channels, mul(patch_size, patch_size))));  // class, patch embedding
  vision = add(vision, add(mul(p + 1, e), mul(4, e)));                              // positions, pre/post norms
  int64_t layer = add(mul(4, e), mul(4, add(mul(e, e), e)));
  layer = add(layer, add(add(mul(vision_intermediate_size, e), vision_intermediate_size),
                         add(mul(e, vision_intermediate_size), e)));
  vision = add(vision, mul(layer, vision_num_hidden_layers));
  const int64_t h = hidden_size, bias = projector_bias ? 1 : 0;
  vision = add(vision, add(mul(h, e + bias), add(mul(h, h + bias), h)));  // projector, image_newline
  // The text model, without the idle tower QwenVl keeps beside it (language_model_config): a patch
  // embedding of 4; one block of width 4 (two LayerNorms of 8, qkv 12x4 + 12, proj, fc1 and fc2
  // 4x4 + 4 each); a merger of LayerNorm(4), 4x4 + 4 and hidden x 4 + hidden.
  const int64_t idle = 4 + (16 + 60 + 3 * 20) + (8 + 20) + 5 * hidden_size;
  return add(vision, language_model_config().parameter_count() - idle);
}

QwenVlConfig LlavaNextConfig::language_model_config() const {
  QwenVlConfig c;
  c.family = QwenFamily::kQwen2Vl;
  c.hidden_size = hidden_size;
  c.num_hidden_layers = num_hidden_layers;
  c.num_attention_heads = num_attention_heads;
  c.num_key_value_heads = num_key_value_heads;
  c.head_dim = head_dim;
  c.intermediate_size = intermediate_size;
  c.rms_norm_eps = rms_norm_eps;
  c.rope_theta = rope_theta;
  // 1-D positions reach the decoder on all three M-RoPE axes alike, so any split of the
  // frequencies over the axes is plain 1-D RoPE (the decoder wants each section >= 1).
  c.mrope_section = {head_dim / 2 - 2, 1, 1};
  c.attention_bias = false;
  c.vocab_size = vocab_size;
  c.max_position_embeddings = max_position_embeddings;
  c.tie_word_embeddings = tie_word_embeddings;
  c.image_token_id = image_token_id;
  c.video_token_id = image_token_id;
  c.vision_start_token_id = image_token_id;
  c.vision_end_token_id = image_token_id;
  QwenVisionConfig& v = c.vision;  // never runs: one block of width 4, the smallest merger
  v.depth = 1;
  v.embed_dim = 4;
  v.num_heads = 1;
  v.mlp_ratio = 1;
  v.patch_size = 1;
  v.temporal_patch_size = 1;
  v.spatial_merge_size = 1;
  v.in_channels = 1;
  v.hidden_size = hidden_size;
  return c;
}

std::array<int64_t, 2> select_best_resolution(int64_t height, int64_t width,
                                              const std::vector<std::array<int64_t, 2>>& pinpoints) {
  VLMGEN_CHECK(height >= 1 && width >= 1 && height <= (int64_t{1} << 24) && width <= (int64_t{1} << 24),
               "select_best_resolution: image size {}x{} (height x width) must be positive and at most 2^24", height,
               width);
  std::array<int64_t, 2> best = pinpoints.front();
  int64_t best_effective = 0, best_wasted = INT64_MAX;
  for (const auto& [h, w] : pinpoints) {
    const double scale = std::min(static_cast<double>(w) / static_cast<double>(width),
                                  static_cast<double>(h) / static_cast<double>(height));
    const auto down_w = static_cast<int64_t>(static_cast<double>(width) * scale);
    const auto down_h = static_cast<int64_t>(static_cast<double>(height) * scale);
    const int64_t effective = std::min(down_w * down_h, width * height);
    const int64_t wasted = w * h - effective;
    if (effective > best_effective || (effective == best_effective && wasted < best_wasted)) {
      best = {h, w};
      best_effective = effective;
      best_wasted = wasted;
    }
  }
  return best;
}

LlavaNextGrid llava_next_grid(const LlavaNextConfig& c, int64_t height, int64_t width) {
  const auto [best_h, best_w] = select_best_resolution(height, width, c.image_grid_pinpoints);
  LlavaNextGrid g;
  g.grid_h = best_h / c.image_size;
  g.grid_w = best_w / c.image_size;
  g.rows = c.patches_per_side() * g.grid_h;
  g.cols = c.patches_per_side() * g.grid_w;
  // The resize kept the aspect ratio and padded the rest (transformers' unpad_image and the
  // processor's count agree on this rule): the padding rows or columns are cut, evenly.
  if (static_cast<double>(width) / height > static_cast<double>(g.cols) / g.rows) {
    const int64_t kept = round7(static_cast<double>(height) * (static_cast<double>(g.cols) / width));
    g.row_offset = (g.rows - kept) / 2;
    g.rows -= 2 * g.row_offset;
  } else {
    const int64_t kept = round7(static_cast<double>(width) * (static_cast<double>(g.rows) / height));
    g.col_offset = (g.cols - kept) / 2;
    g.cols -= 2 * g.col_offset;
  }
  return g;
}

int64_t llava_next_placeholder_count(const LlavaNextConfig& c, int64_t height, int64_t width) {
  const LlavaNextGrid g = llava_next_grid(c, height, width);
  return c.tokens_per_tile() + g.rows * (g.cols + 1);  // the base tile, then each row and its newline
}

LlavaNextConfig LlavaNextConfig::from_json(const std::string& text_in) {
  const Json root = detail::parse_json(text_in, "config", JsonLimits().max_bytes(Limits::kMaxConfigBytes));
  VLMGEN_CHECK(root.is_object(), "config must be a JSON object, got {}", root.type_name());
  for (const char* section : {"text_config", "vision_config"}) {
    VLMGEN_CHECK(!root.contains(section) || root.at(section).is_null() || root.at(section).is_object(),
                 "llava_next config: {} must be an object, got JSON {} ({})", section, root.at(section).type_name(),
                 detail::json_excerpt(root.at(section)));
  }
  static const Json kEmpty = Json::object();
  auto object = [&](const char* key) -> const Json& {
    return root.contains(key) && root.at(key).is_object() ? root.at(key) : kEmpty;
  };
  const FieldReader text({{&object("text_config"), "text_config."}});
  const FieldReader vision({{&object("vision_config"), "vision_config."}});
  const FieldReader top({{&root, ""}});
  LlavaNextConfig c;
  read_text(text, object("text_config"), c);
  read_vision(vision, c);
  c.tie_word_embeddings = top.bool_or("tie_word_embeddings", text.bool_or("tie_word_embeddings", false));

  std::string field;
  c.image_token_id = top.int_or("image_token_index", top.int_or("image_token_id", 32000));
  if (const Json* layer = top.find("vision_feature_layer", &field)) {
    VLMGEN_CHECK(layer->is_number_integer(),
                 "llava_next config: vision_feature_layer must be one integer, got {} "
                 "(several layers concatenated are not supported)",
                 detail::json_excerpt(*layer));
    c.vision_feature_layer = detail::as_int(*layer, field);
  }
  const std::string strategy = top.string_or("vision_feature_select_strategy", "default");
  VLMGEN_CHECK(strategy == "default",
               "llava_next config: vision_feature_select_strategy \"{}\" is not supported (\"default\"; with \"full\" "
               "the class token would make each tile one row longer than its patch grid, which transformers' model "
               "cannot pack either)",
               strategy);
  const std::string projector_act = top.string_or("projector_hidden_act", "gelu");
  VLMGEN_CHECK(projector_act == "gelu", "llava_next config: projector_hidden_act \"{}\" is not supported (gelu)",
               projector_act);
  c.projector_bias = top.bool_or("multimodal_projector_bias", true);
  VLMGEN_CHECK(top.bool_or("use_image_newline_parameter", true),
               "llava_next config: use_image_newline_parameter false is not supported");
  if (const Json* pins = top.find("image_grid_pinpoints", &field)) {
    VLMGEN_CHECK(pins->is_array(), "config field '{}' must be a list of [height, width], got {}", field,
                 detail::json_excerpt(*pins));
    c.image_grid_pinpoints.clear();
    for (size_t i = 0; i < pins->size() && i <= 1024; ++i) {
      const Json& p = (*pins)[i];
      VLMGEN_CHECK(p.is_array() && p.size() == 2, "config field '{}[{}]' must be [height, width], got {}", field, i,
                   detail::json_excerpt(p));
      c.image_grid_pinpoints.push_back({detail::as_int(p[0], field), detail::as_int(p[1], field)});
    }
  }
  c.validate();
  return c;
}

LlavaNextConfig LlavaNextConfig::from_file(const std::string& path) {
  const std::string text = read_regular_file(path, "config file", Limits::kMaxConfigBytes);
  try {
    return from_json(text);
  } catch (const Error& e) {
    VLMGEN_FAIL("config file '{}': {}", path, e.what());
  }
}

std::string LlavaNextConfig::to_json() const {
  Json text = {{"model_type", text_model_type},
               {"vocab_size", vocab_size},
               {"hidden_size", hidden_size},
               {"intermediate_size", intermediate_size},
               {"num_hidden_layers", num_hidden_layers},
               {"num_attention_heads", num_attention_heads},
               {"num_key_value_heads", num_key_value_heads},
               {"head_dim", head_dim},
               {"rms_norm_eps", rms_norm_eps},
               {"rope_theta", rope_theta},
               {"max_position_embeddings", max_position_embeddings},
               {"tie_word_embeddings", tie_word_embeddings}};
  if (text_model_type == "mistral") text["sliding_window"] = nullptr;
  const Json vision = {{"model_type", "clip_vision_model"},
                       {"hidden_size", vision_hidden_size},
                       {"intermediate_size", vision_intermediate_size},
                       {"num_hidden_layers", vision_num_hidden_layers},
                       {"num_attention_heads", vision_num_attention_heads},
                       {"num_channels", num_channels},
                       {"image_size", image_size},
                       {"patch_size", patch_size},
                       {"layer_norm_eps", vision_layer_norm_eps},
                       {"hidden_act", vision_quick_gelu ? "quick_gelu" : "gelu"}};
  Json pins = Json::array();
  for (const auto& [h, w] : image_grid_pinpoints) pins.push_back(Json::array({h, w}));
  const Json root = {{"architectures", Json::array({"LlavaNextForConditionalGeneration"})},
                     {"model_type", "llava_next"},
                     {"text_config", text},
                     {"vision_config", vision},
                     {"image_token_index", image_token_id},
                     {"vision_feature_layer", vision_feature_layer},
                     {"vision_feature_select_strategy", "default"},
                     {"image_grid_pinpoints", pins},
                     {"projector_hidden_act", "gelu"},
                     {"multimodal_projector_bias", projector_bias},
                     {"use_image_newline_parameter", true},
                     {"tie_word_embeddings", tie_word_embeddings}};
  return root.dump(2);
}

LlavaNextConfig LlavaNextConfig::tiny() {
  LlavaNextConfig c;
  c.vocab_size = 96;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 4096;
  c.vision_hidden_size = 32;
  c.vision_intermediate_size = 48;
  c.vision_num_hidden_layers = 3;
  c.vision_num_attention_heads = 2;
  c.image_size = 8;
  c.patch_size = 4;
  c.image_token_id = 90;
  c.image_grid_pinpoints = {{8, 16}, {16, 8}, {16, 16}, {8, 24}, {24, 8}};
  return c;
}

}  // namespace vlmgen
