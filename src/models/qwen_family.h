#pragma once

// The family layer of the Qwen-VL models: what Qwen2-VL, Qwen2.5-VL and Qwen3-VL do differently,
// stated once per family (families/*.cpp) and read by the shared model code (qwen_vl*.cpp).
// Private to src/models.

#include <nlohmann/json.hpp>

#include "config_reader.h"
#include "vlmgen/models/qwen_vl_config.h"

namespace vlmgen::detail {

struct QwenFamilySpec {
  QwenFamily family;
  const char* model_type;    // HF config.json model_type
  const char* architecture;  // HF architectures[0]
  const char* display_name;  // for messages

  // Vision tower.
  bool vision_rms_norm;         // norm1/norm2/merger norm are RMSNorm (weight only), else LayerNorm
  bool vision_gated_mlp;        // SwiGLU MLP (gate, up, down), else fc1 -> act -> fc2
  bool patch_embed_bias;        // the patch embedding (Conv3d) has a bias
  bool learned_position_table;  // learned positions, interpolated bilinearly to each grid
  bool window_attention;        // window attention except at fullatt_block_indexes
  bool deepstack;               // DeepStack mergers at deepstack_visual_indexes
  // Tensor names under visual.blocks.N (MLP) and visual. (merger), without .weight/.bias.
  const char* mlp_in;   // fc1, or the gate of a gated MLP
  const char* mlp_up;   // the up projection of a gated MLP; nullptr otherwise
  const char* mlp_out;  // fc2 / down
  const char* merger_norm;
  const char* merger_fc1;
  const char* merger_fc2;

  // config.json's names of the vision block width (QwenVisionConfig::embed_dim) and the
  // merger's output (QwenVisionConfig::hidden_size), for messages.
  const char* vision_width_field;
  const char* vision_out_field;

  // Language model.
  bool image_frames_share_time;  // M-RoPE: every frame of an image at time 0 (Qwen2.5-VL's get_rope_index)
  bool qwen3_text;  // Qwen3 LM: q/k RMSNorm per head, attention_bias read (default false), M-RoPE interleaved
  double default_rope_theta;
  double default_rms_norm_eps;
  int64_t default_max_position_embeddings;

  // config.json.
  void (*read_vision)(const FieldReader& vision, QwenVisionConfig& out);
  nlohmann::json (*write_vision)(const QwenVisionConfig& vision);
  bool nested_text_config;  // to_json writes text fields under text_config (as HF does for this family)
  void (*tiny_vision)(QwenVisionConfig& out);
};

const QwenFamilySpec& qwen2_vl_family();
const QwenFamilySpec& qwen2_5_vl_family();
const QwenFamilySpec& qwen3_vl_family();

inline const QwenFamilySpec& family_spec(QwenFamily family) {
  switch (family) {
    case QwenFamily::kQwen2Vl: return qwen2_vl_family();
    case QwenFamily::kQwen2_5Vl: return qwen2_5_vl_family();
    case QwenFamily::kQwen3Vl: return qwen3_vl_family();
  }
  return qwen2_vl_family();
}

}  // namespace vlmgen::detail
