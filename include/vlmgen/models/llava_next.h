#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vlmgen/model.h"
#include "vlmgen/models/load_options.h"
#include "vlmgen/models/qwen_vl.h"
#include "vlmgen/models/vit_layer.h"
#include "vlmgen/parallel.h"

namespace vlmgen {

/// LLaVA-NeXT's config.json (`LlavaNextForConditionalGeneration`, model_type `llava_next`): a
/// Llama or Mistral text model (`text_config`), a CLIP vision tower (`vision_config`), and the
/// anyres settings. Fields a file leaves out take transformers' defaults (LlamaConfig or
/// MistralConfig by text_config.model_type, CLIPVisionConfig, LlavaNextConfig).
struct LlavaNextConfig {
  // Text model (Llama/Mistral).
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  int64_t head_dim = 128;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  int64_t max_position_embeddings = 4096;
  bool tie_word_embeddings = false;
  std::string text_model_type = "llama";

  // CLIP vision tower.
  int64_t vision_hidden_size = 1024;
  int64_t vision_intermediate_size = 4096;
  int64_t vision_num_hidden_layers = 24;
  int64_t vision_num_attention_heads = 16;
  int64_t num_channels = 3;
  int64_t image_size = 336;
  int64_t patch_size = 14;
  double vision_layer_norm_eps = 1e-5;
  bool vision_quick_gelu = true;  ///< hidden_act quick_gelu, else gelu

  int64_t image_token_id = 32000;
  /// Which CLIP hidden state feeds the projector: 0 is the embeddings after pre_layrnorm, k the
  /// output of layer k; negative counts from the end (-1 the last layer, -2 the one before).
  int64_t vision_feature_layer = -2;
  // vision_feature_select_strategy is "default" (the class token dropped): transformers' model
  // cannot pack "full" features with image_newline, so from_json refuses it.
  /// (height, width) in pixels of each tiling the anyres rule may pick.
  std::vector<std::array<int64_t, 2>> image_grid_pinpoints = {
      {336, 672}, {672, 336}, {672, 672}, {1008, 336}, {336, 1008}};
  bool projector_bias = true;

  int64_t patches_per_side() const { return image_size / patch_size; }
  /// CLIP layers run to reach vision_feature_layer.
  int64_t vision_layers_used() const;
  /// Feature rows per tile: its patches.
  int64_t tokens_per_tile() const { return patches_per_side() * patches_per_side(); }

  void validate() const;
  int64_t parameter_count() const;
  static LlavaNextConfig from_json(const std::string& text);
  static LlavaNextConfig from_file(const std::string& path);
  std::string to_json() const;
  /// For tests: Llama of hidden 64 (2 layers, vocab 96, image token 90), CLIP of width 32 (3
  /// layers) over 8x8 tiles of 4x4 patches, pinpoints 8x16, 16x8, 16x16, 8x24, 24x8.
  static LlavaNextConfig tiny();

  /// The text model as the Qwen2 decoder it equals: no q/k/v bias, 1-D RoPE (every M-RoPE axis
  /// on one section), and a one-block vision tower of width 4 that never runs.
  QwenVlConfig language_model_config() const;
};

/// The anyres rule: the pinpoint (height, width) that keeps most of an image of `height` x
/// `width` pixels when scaled to fit, ties to the least padding (transformers'
/// select_best_resolution).
std::array<int64_t, 2> select_best_resolution(int64_t height, int64_t width,
                                              const std::vector<std::array<int64_t, 2>>& pinpoints);

/// An image's tile grid: `grid_h` x `grid_w` tiles of its anyres resolution, their patches on one
/// grid of `side * grid_h` x `side * grid_w`, of which rows [row_offset, row_offset + rows) and
/// columns [col_offset, col_offset + cols) are the picture (the rest is the resize's padding).
struct LlavaNextGrid {
  int64_t grid_h = 0, grid_w = 0;
  int64_t row_offset = 0, rows = 0, col_offset = 0, cols = 0;
  int64_t tiles() const { return 1 + grid_h * grid_w; }  ///< with the base image
};
LlavaNextGrid llava_next_grid(const LlavaNextConfig& config, int64_t height, int64_t width);

/// Placeholder tokens of an image of `height` x `width` pixels under `config`, as
/// LlavaNextProcessor counts them: the base tile's features, plus the tiles' features with the
/// padding rows or columns of the resize removed, plus one image_newline per remaining row.
int64_t llava_next_placeholder_count(const LlavaNextConfig& config, int64_t height, int64_t width);

namespace llava_next {

/// A CLIP encoder layer.
using ClipLayer = vit::EncoderLayer;

struct VisionTower {
  at::Tensor class_embedding;     // [vision_hidden]
  at::Tensor patch_embedding;     // [vision_hidden, channels, patch, patch], no bias
  at::Tensor position_embedding;  // [patches + 1, vision_hidden]
  qwen_vl::LayerNorm pre_layrnorm;
  std::vector<ClipLayer> layers;
  qwen_vl::LayerNorm post_layernorm;  // stored in checkpoints; not used by the features
  qwen_vl::Linear linear_1;           // [hidden, vision_hidden]
  qwen_vl::Linear linear_2;           // [hidden, hidden]
  at::Tensor image_newline;           // [hidden]
};

}  // namespace llava_next

/// LLaVA-NeXT (`LlavaNextForConditionalGeneration`): a CLIP tower run on each image's tiles (the
/// whole image resized, then the tiles of its anyres resolution), a two-layer projector, the
/// tiles' features laid back on their grid with the resize padding cut off (image_sizes) and an
/// image_newline after each row, and a Llama/Mistral text model (QwenVl's decoder: the same
/// arithmetic, no new copy).
///
/// Images are per-image bundles: pixel_values [N, tiles, channels, image_size, image_size] (tile 0
/// the base image; extra tiles past an image's own count are padding, as transformers batches them)
/// and image_sizes [N, 2] (each image's original height and width), which decide the tile grid
/// and the placeholder count (placeholder_counts). A bundle whose sizes disagree with the prompt's
/// placeholders is a vlmgen::Error naming both counts.
///
/// Tensor parallelism splits the text model as QwenVl does, and the CLIP encoder layers
/// Megatron-style (q/k/v and fc1 by rows, out_proj and fc2 by columns, all-reduced) when the
/// tower's heads and MLP width divide by tp; otherwise the tower is replicated
/// (vision_tower_sharded()). Embeddings, norms, the projector and image_newline are replicated, so
/// every rank packs the same image rows.
class LlavaNext : public CausalVlm {
 public:
  explicit LlavaNext(const LlavaNextConfig& config, uint64_t seed = 0, double init_std = 0.02,
                     ParallelContext parallel = ParallelContext::single());
  /// Reads `dir`/config.json and its safetensors files, in either transformers spelling
  /// (`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`, `image_newline`, or
  /// the >= 4.52 `model.language_model.*`, `model.vision_tower.*`, ...). The text model's matrices
  /// in options.weights_dtype; FP8 is refused for this family.
  static std::unique_ptr<LlavaNext> from_checkpoint(const std::string& dir,
                                                    const ParallelContext& parallel = ParallelContext::single(),
                                                    const LoadOptions& options = {});
  /// Writes config.json and model.safetensors (newer spelling). Under TP every rank calls it:
  /// the shards are gathered, rank 0 writes, and all return once the files are written.
  void save_checkpoint(const std::string& dir) const;

  const ModelTraits& traits() const override { return traits_; }
  /// float32 (default), bfloat16 or FP8 (at::kByte; check_kv_cache_dtype); LoadOptions::kv_cache_dtype
  /// sets it.
  void set_kv_cache_dtype(at::ScalarType dtype) override;
  at::Tensor forward(const ForwardArgs& args) override;
  std::vector<at::Tensor> forward_batch(const std::vector<const ForwardArgs*>& calls) override;
  at::Device device() const override { return lm_->device(); }
  /// From image_sizes (required): llava_next_placeholder_count of each image.
  std::vector<int64_t> placeholder_counts(const VisionInputs& vision) const override;
  bool can_encode_images() const override { return true; }
  /// [sum of placeholder counts, hidden]: each image's packed features, in order.
  at::Tensor encode_images(const VisionInputs& vision) override;

  const LlavaNextConfig& config() const { return config_; }
  /// Every weight under its transformers (>= 4.52) name, each once; this rank's slices under TP.
  std::vector<std::pair<std::string, at::Tensor*>> named_weights();
  /// How the weight named `name` (as in named_weights) is split across tensor-parallel ranks.
  /// vlmgen::Error for an unknown name.
  qwen_vl::ShardLayout shard_layout(const std::string& name) const;
  /// True when the CLIP encoder layers are split across the tensor-parallel ranks; false when
  /// every rank holds them whole (tp_size 1, or heads or MLP width not divisible by it).
  bool vision_tower_sharded() const { return vision_sharded_; }
  QwenVl& language_model() { return *lm_; }
  llava_next::VisionTower& vision_tower() { return vision_; }
  int64_t vision_tower_calls() const { return vision_tower_calls_; }
  void to(at::Device device);

 private:
  LlavaNext(const LlavaNextConfig& config, std::unique_ptr<QwenVl> lm);
  void allocate_vision();
  /// The tower's, projector's and image_newline's weights with their layouts.
  std::vector<QwenVl::WeightSlot> vision_weights();
  /// named_weights with each weight's layout, in the same order.
  std::vector<QwenVl::WeightSlot> weight_slots();
  /// Features [tiles, rows, hidden] of one image's tiles after the projector.
  at::Tensor tile_features(const at::Tensor& tiles) const;
  /// The rows placed at an image's placeholders, from its tiles' features.
  at::Tensor pack(const at::Tensor& features, const LlavaNextGrid& grid) const;
  /// The call with its images replaced by their embeddings (the language model never sees pixels).
  ForwardArgs embedded(const ForwardArgs& args);

  LlavaNextConfig config_;
  std::unique_ptr<QwenVl> lm_;
  ModelTraits traits_;
  llava_next::VisionTower vision_;
  bool vision_sharded_ = false;
  int64_t vision_tower_calls_ = 0;
};

}  // namespace vlmgen
