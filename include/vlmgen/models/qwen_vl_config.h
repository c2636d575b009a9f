#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vlmgen {

/// The vision tower part of a Qwen2-VL config (HF `vision_config`).
struct QwenVisionConfig {
  int64_t depth = 32;                // vision blocks
  int64_t embed_dim = 1280;          // hidden size of the vision blocks
  int64_t num_heads = 16;
  int64_t mlp_ratio = 4;             // MLP hidden = embed_dim * mlp_ratio
  int64_t in_channels = 3;
  int64_t patch_size = 14;
  int64_t temporal_patch_size = 2;
  int64_t spatial_merge_size = 2;
  int64_t hidden_size = 3584;        // output width of the merger (= the LM's hidden size)
  std::string hidden_act = "quick_gelu";
};

/// A Qwen2-VL model config, read from an HF config.json in the flat layout (text fields at the
/// top level) or the nested one (`text_config`).
struct QwenVlConfig {
  int64_t hidden_size = 3584;
  int64_t num_hidden_layers = 28;
  int64_t num_attention_heads = 28;
  int64_t num_key_value_heads = 4;
  int64_t head_dim = 128;            // from the config when present, else hidden / heads
  int64_t intermediate_size = 18944;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1000000.0;
  std::vector<int64_t> mrope_section = {16, 24, 24};  // sums to head_dim / 2
  int64_t vocab_size = 152064;
  int64_t max_position_embeddings = 32768;
  bool tie_word_embeddings = false;
  int64_t image_token_id = 151655;
  int64_t video_token_id = 151656;
  int64_t vision_start_token_id = 151652;
  int64_t vision_end_token_id = 151653;
  QwenVisionConfig vision;

  /// Parses config.json text; throws vlmgen::Error naming the missing or malformed field.
  static QwenVlConfig from_json(const std::string& json_text);
  /// Reads `path` (a config.json file) and parses it.
  static QwenVlConfig from_file(const std::string& path);
  /// config.json text (flat layout) that from_json reads back to an equal config.
  std::string to_json() const;
  /// Throws vlmgen::Error when fields disagree (heads not dividing, mrope_section not summing
  /// to head_dim / 2, ...).
  void validate() const;

  /// Bytes of K and V per token per sequence across all layers at `bytes_per_element`,
  /// from head_dim as configured (never hidden / heads).
  int64_t kv_cache_bytes_per_token(int64_t bytes_per_element) const {
    return 2 * num_hidden_layers * num_key_value_heads * head_dim * bytes_per_element;
  }

  /// A tiny config for tests: 2 LM layers, hidden 64, 4 heads (2 KV heads), vision depth 2.
  static QwenVlConfig tiny();

  bool operator==(const QwenVlConfig& other) const;
};

}  // namespace vlmgen
