#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vlmgen {

/// The largest sizes QwenVlConfig::validate accepts, and the largest config.json it reads. Each is
/// far above every released Qwen-VL (Qwen2-VL-72B: hidden 8192, 80 layers, 64 heads, head_dim
/// 128, intermediate 29568, vocabulary 152064; vision: 32 blocks of 1280, patch 14, merge 2) and
/// low enough that no size derived from them overflows int64. A config beyond them is a typo or a
/// hostile file; it is refused, naming the field, the value and the bound, before anything is
/// allocated.
struct QwenVlConfigLimits {
  static constexpr int64_t kMaxHiddenSize = 65536;  // hidden_size, vision embed_dim and hidden_size
  static constexpr int64_t kMaxLayers = 1024;       // num_hidden_layers, vision depth
  static constexpr int64_t kMaxHeads = 1024;        // attention, KV and vision heads
  static constexpr int64_t kMaxHeadDim = 4096;
  static constexpr int64_t kMaxIntermediateSize = 1 << 20;
  static constexpr int64_t kMaxVocabSize = 1 << 24;
  static constexpr int64_t kMaxPositionEmbeddings = 1 << 24;
  static constexpr int64_t kMaxMlpRatio = 64;
  static constexpr int64_t kMaxInChannels = 16;
  static constexpr int64_t kMaxPatchSize = 1024;  // vision patch_size
  static constexpr int64_t kMaxTemporalPatchSize = 64;
  static constexpr int64_t kMaxSpatialMergeSize = 64;
  /// All weights together (parameter_count()): 2^40, about 15 times Qwen2-VL-72B.
  static constexpr int64_t kMaxParameters = int64_t{1} << 40;
  /// Largest config.json text (real ones are a few KB).
  static constexpr int64_t kMaxConfigBytes = int64_t{4} << 20;
};

/// The vision tower part of a Qwen2-VL config (HF `vision_config`).
struct QwenVisionConfig {
  int64_t depth = 32;        // vision blocks
  int64_t embed_dim = 1280;  // hidden size of the vision blocks
  int64_t num_heads = 16;
  int64_t mlp_ratio = 4;  // MLP hidden = embed_dim * mlp_ratio
  int64_t in_channels = 3;
  int64_t patch_size = 14;
  int64_t temporal_patch_size = 2;
  int64_t spatial_merge_size = 2;
  int64_t hidden_size = 3584;  // output width of the merger (= the LM's hidden size)
  std::string hidden_act = "quick_gelu";
};

/// A Qwen2-VL model config, read from an HF config.json in the flat layout (text fields at the
/// top level) or the nested one (`text_config`).
struct QwenVlConfig {
  int64_t hidden_size = 3584;
  int64_t num_hidden_layers = 28;
  int64_t num_attention_heads = 28;
  int64_t num_key_value_heads = 4;
  int64_t head_dim = 128;  // from the config when present, else hidden / heads
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

  /// Parses config.json text; throws vlmgen::Error naming the missing or malformed field, or the
  /// limit when the text is above QwenVlConfigLimits::kMaxConfigBytes or nests deeper than
  /// kMaxJsonDepth. Does not validate().
  static QwenVlConfig from_json(const std::string& json_text);
  /// Reads `path` (a config.json file) and parses it. A path that is not a regular file (a FIFO,
  /// a directory, a device) is refused without blocking.
  static QwenVlConfig from_file(const std::string& path);
  /// config.json text (flat layout) that from_json reads back to an equal config.
  std::string to_json() const;
  /// Throws vlmgen::Error when a size is outside [1, its QwenVlConfigLimits bound], when the
  /// weights would exceed kMaxParameters, or when fields disagree (heads not dividing,
  /// mrope_section not summing to head_dim / 2, ...). Every check is overflow-safe.
  void validate() const;

  /// Number of weights of the Qwen2-VL model this config describes (the LM head counted once
  /// when tied), computed with overflow-checked arithmetic. Throws like validate().
  ///   QwenVlConfig::tiny().parameter_count()  // what Qwen2Vl(tiny(), seed) allocates
  int64_t parameter_count() const;

  /// Bytes of K and V per token per sequence across all layers at `bytes_per_element`,
  /// from head_dim as configured (never hidden / heads). Meaningful after validate().
  int64_t kv_cache_bytes_per_token(int64_t bytes_per_element) const {
    return 2 * num_hidden_layers * num_key_value_heads * head_dim * bytes_per_element;
  }

  /// A tiny config for tests: 2 LM layers, hidden 64, 4 heads (2 KV heads), vision depth 2.
  static QwenVlConfig tiny();

  bool operator==(const QwenVlConfig& other) const;
};

}  // namespace vlmgen
