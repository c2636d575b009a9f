#pragma once

#include <ATen/ATen.h>

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

/// Gemma-3's config.json (`Gemma3ForConditionalGeneration`, model_type `gemma3`): the text model
/// (`text_config`), the SigLIP vision tower (`vision_config`) and the image tokens. Defaults are
/// transformers' (Gemma3TextConfig, SiglipVisionConfig, Gemma3Config) for fields a file leaves
/// out.
struct Gemma3Config {
  // Text model.
  int64_t vocab_size = 262208;
  int64_t hidden_size = 2304;
  int64_t intermediate_size = 9216;
  int64_t num_hidden_layers = 26;
  int64_t num_attention_heads = 8;
  int64_t num_key_value_heads = 4;
  int64_t head_dim = 256;
  double rms_norm_eps = 1e-6;
  /// RoPE base of the global (full-attention) layers, and its linear scaling factor
  /// (rope_scaling {"rope_type": "linear", "factor": f}; 1 for none).
  double rope_theta = 1000000.0;
  double rope_scaling_factor = 1.0;
  /// RoPE base of the sliding-window layers (never scaled).
  double rope_local_base_freq = 10000.0;
  /// Attention scores are scaled by query_pre_attn_scalar^-0.5 (not head_dim^-0.5).
  double query_pre_attn_scalar = 256;
  /// A sliding layer's query at column q sees keys k with q - k < sliding_window.
  int64_t sliding_window = 4096;
  /// Per layer: true for sliding-window attention, false for full (global) attention. From
  /// `layer_types`, else from `sliding_window_pattern` (layer i slides unless (i + 1) % pattern == 0).
  std::vector<bool> sliding_layers;
  int64_t max_position_embeddings = 131072;
  /// tanh soft-capping of the output logits (cap * tanh(logits / cap)); 0 for none.
  double final_logit_softcapping = 0;
  bool tie_word_embeddings = true;

  // SigLIP vision tower.
  int64_t vision_hidden_size = 1152;
  int64_t vision_intermediate_size = 4304;
  int64_t vision_num_hidden_layers = 27;
  int64_t vision_num_attention_heads = 16;
  int64_t num_channels = 3;
  int64_t image_size = 896;
  int64_t patch_size = 14;
  double vision_layer_norm_eps = 1e-6;

  // Images in the prompt: <start_of_image>, mm_tokens_per_image x the image token, <end_of_image>.
  int64_t image_token_id = 262144;
  int64_t boi_token_id = 255999;
  int64_t eoi_token_id = 256000;
  int64_t mm_tokens_per_image = 256;

  /// Patches per side of an image (image_size / patch_size) and the average pool's side that
  /// leaves sqrt(mm_tokens_per_image) tokens per side.
  int64_t patches_per_side() const { return image_size / patch_size; }
  int64_t tokens_per_side() const;
  int64_t pool_kernel() const { return patches_per_side() / tokens_per_side(); }
  bool layer_slides(int64_t layer) const { return sliding_layers[static_cast<size_t>(layer)]; }

  /// Throws vlmgen::Error naming the field for sizes that do not fit the architecture or exceed
  /// QwenVlConfigLimits (the same bounds as the Qwen-VL models).
  void validate() const;
  /// Weights the model allocates (the tied lm_head counted once).
  int64_t parameter_count() const;

  /// Parses config.json text as transformers writes it (nested text_config and vision_config;
  /// flat text fields at the top level are read too). Refuses what vlmgen does not compute:
  /// another hidden_activation than gelu_pytorch_tanh, rope_scaling other than linear, attention
  /// logit soft-capping, a vision tower with a pooling head.
  static Gemma3Config from_json(const std::string& text);
  static Gemma3Config from_file(const std::string& path);
  /// config.json as transformers writes it for this model.
  std::string to_json() const;

  /// A few-kilobyte model for tests: 4 layers (sliding, full, sliding, full), window 5, hidden
  /// 64, vocabulary 96 (image 90, <start_of_image> 88, <end_of_image> 89, 4 tokens per image),
  /// a 2-layer SigLIP of width 32 over 16x16 images in 4x4 patches.
  static Gemma3Config tiny();
};

namespace gemma3 {

/// A SigLIP encoder layer.
using VisionLayer = vit::EncoderLayer;

/// SigLIP and the multimodal projector.
struct VisionTower {
  at::Tensor patch_embedding;       // [vision_hidden, channels, patch, patch] (Conv2d)
  at::Tensor patch_embedding_bias;  // [vision_hidden]
  at::Tensor position_embedding;    // [patches, vision_hidden]
  std::vector<VisionLayer> layers;
  qwen_vl::LayerNorm post_layernorm;
  at::Tensor mm_soft_emb_norm;     // [vision_hidden], Gemma RMSNorm (scale 1 + w)
  at::Tensor mm_input_projection;  // [vision_hidden, hidden] (multiplied from the right)
};

/// A decoder layer. Every norm is Gemma's RMSNorm: x / rms(x) * (1 + w).
struct DecoderLayer {
  at::Tensor input_layernorm, post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm;
  qwen_vl::Linear q_proj, k_proj, v_proj, o_proj;  // no biases
  at::Tensor q_norm, k_norm;                       // [head_dim]
  qwen_vl::Linear gate_proj, up_proj, down_proj;
};

struct LanguageModel {
  at::Tensor embed_tokens;  // [vocab, hidden]; rows scaled by sqrt(hidden) when read
  std::vector<DecoderLayer> layers;
  at::Tensor norm;
  at::Tensor lm_head;  // the same tensor as embed_tokens when tied
};

}  // namespace gemma3

/// Gemma-3 (`Gemma3ForConditionalGeneration`) in fp32 ATen: the SigLIP vision tower, the
/// projector (average pool to mm_tokens_per_image, RMSNorm, projection), and the Gemma-3 text
/// model (embeddings scaled by sqrt(hidden), (1 + w) RMSNorms before and after attention and MLP,
/// q/k norms per head, GeGLU with tanh-GELU, interleaved sliding-window and global layers with
/// their own RoPE bases).
///
/// Attention is causal except among the placeholder tokens of one image, which see each other
/// both ways: so a window may never end inside an image (forward refuses it; the generator
/// never cuts an image's span since traits().accepts_partial_image_span is false, and moves
/// chunk edges and prefix-cache hits to the image's first placeholder). Images are per-image
/// bundles (VisionInputs::per_image) of pixel_values [N, channels, image_size, image_size],
/// normalized as Gemma-3's image processor does.
///
/// Tensor parallelism splits the text model like QwenVl's (q/k/v and gate/up by rows, o and down
/// by columns, the vocabulary by rows). The SigLIP encoder layers split the same way (q/k/v and
/// fc1 by rows, out_proj and fc2 by columns, all-reduced) when the tower's heads and MLP width
/// divide by tp, and are replicated otherwise (vision_tower_sharded()); the embeddings, norms and
/// projector are replicated. Every rank computes the same image features.
/// Sequence parallelism is not implemented: under it the generator decodes without a KV cache
/// (traits().kv_cache_under_sequence_parallel is false) and every rank computes the whole window.
class Gemma3 : public CausalVlm {
 public:
  /// Random weights (normal, `init_std`; RMSNorm offsets near 0, LayerNorm weights near 1), drawn
  /// on the CPU from one generator seeded with `seed`; under TP every rank keeps its slice of the
  /// single-process model.
  explicit Gemma3(const Gemma3Config& config, uint64_t seed = 0, double init_std = 0.02,
                  ParallelContext parallel = ParallelContext::single());

  /// Reads `dir`/config.json and its safetensors files, in either transformers spelling
  /// (`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`, or the >= 4.52
  /// `model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`). The text
  /// model's matrices are stored in options.weights_dtype (float32 or 16-bit); FP8 checkpoints
  /// are refused (not implemented for this family). Missing tensors are listed in a vlmgen::Error.
  static std::unique_ptr<Gemma3> from_checkpoint(const std::string& dir,
                                                 const ParallelContext& parallel = ParallelContext::single(),
                                                 const LoadOptions& options = {});
  /// Writes config.json and model.safetensors (newer spelling; no lm_head when tied). Under TP
  /// every rank calls it: rank 0 writes, and all return once the files are written.
  void save_checkpoint(const std::string& dir) const;

  const ModelTraits& traits() const override { return traits_; }
  /// float32 (default), bfloat16 or FP8 (at::kByte; check_kv_cache_dtype); LoadOptions::kv_cache_dtype
  /// sets it.
  void set_kv_cache_dtype(at::ScalarType dtype) override;
  /// Logits [B, S, vocab] (this rank's vocabulary block under TP), float32. Placeholders in the
  /// window take args.image_embeddings' rows, else the vision tower's for args.vision; the counts
  /// must match (vlmgen::Error with both). Without either, placeholders embed as tokens.
  at::Tensor forward(const ForwardArgs& args) override;
  at::Device device() const override { return lm_.embed_tokens.device(); }
  bool can_encode_images() const override { return true; }
  /// [N * mm_tokens_per_image, hidden]: the projector's output of every image, in order.
  at::Tensor encode_images(const VisionInputs& vision) override;

  const Gemma3Config& config() const { return config_; }
  const ParallelContext& parallel() const { return parallel_; }
  at::ScalarType weights_dtype() const { return lm_.embed_tokens.scalar_type(); }
  /// Stores the text model's matrices as `dtype` (float32, bfloat16, float16); compute stays f32.
  void convert_weights(at::ScalarType dtype);
  /// Moves every weight to `device`.
  void to(at::Device device);

  /// Every weight under its HF name (newer spelling), each once (a tied lm_head is not listed);
  /// this rank's slices under TP.
  std::vector<std::pair<std::string, at::Tensor*>> named_weights();
  qwen_vl::ShardLayout shard_layout(const std::string& name) const;

  gemma3::VisionTower& vision_tower() { return vision_; }
  gemma3::LanguageModel& language_model() { return lm_; }
  int64_t vision_tower_calls() const { return vision_tower_calls_; }
  /// True when the SigLIP encoder layers are split across the tensor-parallel ranks; false when
  /// every rank holds them whole (tp_size 1, or heads or MLP width not divisible by it).
  bool vision_tower_sharded() const { return vision_sharded_; }

 private:
  struct Uninitialized {};
  Gemma3(const Gemma3Config& config, Uninitialized, ParallelContext parallel);
  struct WeightSlot {
    std::string name;
    at::Tensor* tensor;
    qwen_vl::ShardLayout layout;
  };
  std::vector<WeightSlot> weight_slots();
  std::vector<int64_t> full_shape(const at::Tensor& local, qwen_vl::ShardLayout layout) const;
  void allocate_weights();
  void tie_lm_head();

  /// The window's inputs, checked: ids [B, S] and positions [B, S] on the device, the mask
  /// [B, window_start + S], and the image each key column belongs to ([B, window_start + S],
  /// -1 for text; undefined when the window holds no placeholder).
  struct Window {
    at::Tensor ids, positions, mask, image_groups;
    int64_t start = 0;
    InferenceContext* context = nullptr;
    bool last_column_only = false;
  };
  Window check_window(const ForwardArgs& args) const;
  at::Tensor run_vision_tower(const VisionInputs& vision);
  at::Tensor run_language_model(at::Tensor hidden, const Window& window) const;

  Gemma3Config config_;
  ParallelContext parallel_;
  Communicator* tp_comm_ = nullptr;
  bool vision_sharded_ = false;
  ModelTraits traits_;
  gemma3::VisionTower vision_;
  gemma3::LanguageModel lm_;
  int64_t vision_tower_calls_ = 0;
};

}  // namespace vlmgen
