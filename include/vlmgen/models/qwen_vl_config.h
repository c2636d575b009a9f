#pragma once

#include <cstdint>
#include <optional>
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
  static constexpr int64_t kMaxPositionTable = 1 << 20;  // Qwen3-VL num_position_embeddings
  /// All weights together (parameter_count()): 2^40, about 15 times Qwen2-VL-72B.
  static constexpr int64_t kMaxParameters = int64_t{1} << 40;
  /// Largest config.json text (real ones are a few KB).
  static constexpr int64_t kMaxConfigBytes = int64_t{4} << 20;
};

/// The Qwen-VL generations this library implements. What differs between them:
///
/// | | Qwen2-VL | Qwen2.5-VL | Qwen3-VL (dense) |
/// | --- | --- | --- | --- |
/// | vision norms | LayerNorm | RMSNorm | LayerNorm |
/// | vision MLP | fc1, act, fc2 | SwiGLU (gate/up/down, biases) | fc1, tanh-GELU, fc2 |
/// | vision attention | per frame | windows, full at fullatt_block_indexes | per frame |
/// | vision positions | 2-D rotary | 2-D rotary | 2-D rotary + learned table, bilinear |
/// | DeepStack | - | - | mergers at deepstack_visual_indexes, added after LM layers 0.. |
/// | LM | Qwen2 (qkv bias) | Qwen2 (qkv bias) | Qwen3 (q/k RMSNorm per head, no bias) |
/// | M-RoPE | chunked sections | chunked sections | interleaved sections |
enum class QwenFamily { kQwen2Vl, kQwen2_5Vl, kQwen3Vl };

/// HF model_type of a family: "qwen2_vl", "qwen2_5_vl", "qwen3_vl".
const char* family_model_type(QwenFamily family);
/// The family of an HF model_type ("qwen2_vl", ...) or architecture
/// ("Qwen2VLForConditionalGeneration", ...); std::nullopt when it is none of them.
std::optional<QwenFamily> family_from_name(const std::string& model_type_or_architecture);
/// "qwen2_vl, qwen2_5_vl, qwen3_vl": for messages.
std::string supported_family_names();

/// The vision tower part of a Qwen-VL config (HF `vision_config`). Field names follow Qwen2-VL's
/// config; Qwen2.5-VL and Qwen3-VL call embed_dim `hidden_size` and hidden_size
/// `out_hidden_size` in config.json, which from_json maps.
struct QwenVisionConfig {
  int64_t depth = 32;        // vision blocks
  int64_t embed_dim = 1280;  // hidden size of the vision blocks
  int64_t num_heads = 16;
  int64_t mlp_ratio = 4;  // Qwen2-VL: MLP hidden = embed_dim * mlp_ratio
  int64_t in_channels = 3;
  int64_t patch_size = 14;
  int64_t temporal_patch_size = 2;
  int64_t spatial_merge_size = 2;
  int64_t hidden_size = 3584;  // output width of the merger (= the LM's hidden size)
  std::string hidden_act = "quick_gelu";
  /// Qwen2.5-VL and Qwen3-VL: the MLP hidden width (Qwen2-VL derives it from mlp_ratio).
  int64_t intermediate_size = 0;
  /// Qwen2.5-VL: side of an attention window in pixels (a multiple of patch_size *
  /// spatial_merge_size), and the blocks that attend over the whole frame instead.
  int64_t window_size = 0;
  std::vector<int64_t> fullatt_block_indexes;
  /// Qwen3-VL: entries of the learned position table (a square: side^2), interpolated
  /// bilinearly to each image's grid.
  int64_t num_position_embeddings = 0;
  /// Qwen3-VL: the vision blocks whose outputs go through a DeepStack merger; feature k is
  /// added to the LM's hidden states after decoder layer k at the image positions.
  std::vector<int64_t> deepstack_visual_indexes;

  /// The MLP hidden width for `family`.
  int64_t mlp_width(QwenFamily family) const {
    return family == QwenFamily::kQwen2Vl ? embed_dim * mlp_ratio : intermediate_size;
  }
};

/// A Qwen-VL model config (Qwen2-VL, Qwen2.5-VL or Qwen3-VL), read from an HF config.json in the
/// flat layout (text fields at the top level) or the nested one (`text_config`).
struct QwenVlConfig {
  QwenFamily family = QwenFamily::kQwen2Vl;
  int64_t hidden_size = 3584;
  int64_t num_hidden_layers = 28;
  int64_t num_attention_heads = 28;
  int64_t num_key_value_heads = 4;
  int64_t head_dim = 128;  // from the config when present, else hidden / heads
  int64_t intermediate_size = 18944;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1000000.0;
  std::vector<int64_t> mrope_section = {16, 24, 24};  // sums to head_dim / 2
  /// Qwen3-VL: frequencies cycle t, h, w (h at 1, 4, ... below 3 * section[1], w at 2, 5, ...
  /// below 3 * section[2], t elsewhere) instead of one chunk per axis.
  bool mrope_interleaved = false;
  /// q/k/v projections carry a bias (Qwen2: yes; Qwen3: attention_bias, false by default).
  bool attention_bias = true;
  /// Qwen3: RMSNorm over head_dim on each query and key head before the rotary.
  bool qk_norm = false;
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

  /// A tiny config for tests: 2 LM layers, hidden 64, 4 heads (2 KV heads), vision depth 2, in
  /// the given family (Qwen2.5-VL: window 16 px = 2x2 merged tokens, block 1 full; Qwen3-VL:
  /// 3 vision blocks, a 4x4 position table, DeepStack after vision blocks 1 and 2, interleaved M-RoPE).
  static QwenVlConfig tiny(QwenFamily family = QwenFamily::kQwen2Vl);

  /// Number of DeepStack features per image token (0 unless Qwen3-VL).
  int64_t deepstack_count() const { return static_cast<int64_t>(vision.deepstack_visual_indexes.size()); }
  /// Width of one image-embedding row as encode_images returns it: the merged embedding followed
  /// by its DeepStack features, hidden_size * (1 + deepstack_count()).
  int64_t image_embedding_width() const { return hidden_size * (1 + deepstack_count()); }

  bool operator==(const QwenVlConfig& other) const;
};

}  // namespace vlmgen
