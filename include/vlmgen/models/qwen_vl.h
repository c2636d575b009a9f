#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vlmgen/kernels/cpu.h"
#include "vlmgen/model.h"
#include "vlmgen/models/load_options.h"
#include "vlmgen/models/qwen_vl_config.h"
#include "vlmgen/parallel.h"

namespace vlmgen {

/// Weight groups of the Qwen-VL models. Each linear keeps its weight and bias apart so tensor
/// parallelism can shard q/k/v/gate/up by rows and o/down by columns without unfusing.
namespace qwen_vl {

/// How tensor parallelism splits a weight across the ranks of the group (Megatron's layouts).
enum class ShardLayout {
  kReplicated,   ///< every rank holds all of it (norms, biases added after a reduction, ...)
  kRows,         ///< dim 0 in tp equal blocks: column-parallel weights and biases, vocab tables
  kColumns,      ///< dim 1 in tp equal blocks: row-parallel weights
  kStackedRows,  ///< [3 * n, ...], q, k and v stacked: each third in tp blocks (the vision qkv)
};

struct Linear {
  at::Tensor weight;       // [out, in]: float32 (LM matrices: weights_dtype), or uint8 FP8 bytes with fp8
  at::Tensor bias;         // [out], float32; undefined for a linear without bias
  kernels::Fp8Scales fp8;  // defined when weight holds FP8 bytes (LoadOptions::keep_fp8)
};

/// A LayerNorm (weight and bias), or an RMSNorm (bias undefined).
struct LayerNorm {
  at::Tensor weight;  // [dim], float32 (every norm stays float32 whatever the weights dtype)
  at::Tensor bias;    // [dim], float32; undefined for an RMSNorm
};

struct VisionBlock {
  LayerNorm norm1;  // over embed_dim (RMSNorm in Qwen2.5-VL)
  Linear qkv;       // weight [3 * embed_dim, embed_dim], bias [3 * embed_dim]; rows q, k, v
  Linear proj;      // weight [embed_dim, embed_dim], bias [embed_dim]
  LayerNorm norm2;  // over embed_dim
  Linear fc1;       // [mlp, embed_dim] + bias: fc1, or the gate of Qwen2.5-VL's SwiGLU
  Linear up;        // [mlp, embed_dim] + bias: the SwiGLU up projection (Qwen2.5-VL only)
  Linear fc2;       // [embed_dim, mlp] + bias: fc2 / down
};

/// merge x merge patches -> one LM token: norm, fc1, GELU, fc2. The main merger normalizes each
/// patch (over embed_dim) before the shuffle; Qwen3-VL's DeepStack mergers after it (over
/// embed_dim * merge^2).
struct PatchMerger {
  LayerNorm norm;
  Linear fc1;  // weight [embed_dim * merge^2, embed_dim * merge^2], bias
  Linear fc2;  // weight [hidden, embed_dim * merge^2], bias [hidden]
};

struct VisionTower {
  at::Tensor patch_embed;           // [embed_dim, in_channels, temporal_patch, patch, patch], float32 (Conv3d)
  at::Tensor patch_embed_bias;      // [embed_dim] (Qwen3-VL); undefined otherwise
  at::Tensor position_table;        // [num_position_embeddings, embed_dim] (Qwen3-VL); undefined otherwise
  std::vector<VisionBlock> blocks;  // depth
  PatchMerger merger;
  std::vector<PatchMerger> deepstack;  // one per deepstack_visual_indexes entry (Qwen3-VL)
};

struct DecoderLayer {
  at::Tensor input_layernorm;           // [hidden], float32 (RMSNorm)
  Linear q_proj;                        // weight [heads * head_dim, hidden], bias [heads * head_dim] (attention_bias)
  Linear k_proj;                        // weight [kv_heads * head_dim, hidden], bias (attention_bias)
  Linear v_proj;                        // weight [kv_heads * head_dim, hidden], bias (attention_bias)
  at::Tensor q_norm;                    // [head_dim] (qk_norm, Qwen3); undefined otherwise
  at::Tensor k_norm;                    // [head_dim] (qk_norm, Qwen3); undefined otherwise
  Linear o_proj;                        // weight [hidden, heads * head_dim], no bias
  at::Tensor post_attention_layernorm;  // [hidden], float32 (RMSNorm)
  Linear gate_proj;                     // weight [intermediate, hidden], no bias
  Linear up_proj;                       // weight [intermediate, hidden], no bias
  Linear down_proj;                     // weight [hidden, intermediate], no bias
};

struct LanguageModel {
  at::Tensor embed_tokens;           // [vocab, hidden], float32 or the weights dtype (LoadOptions)
  std::vector<DecoderLayer> layers;  // num_hidden_layers
  at::Tensor norm;                   // [hidden], float32 (final RMSNorm)
  at::Tensor lm_head;                // [vocab, hidden], like embed_tokens; the same tensor as embed_tokens when tied
  kernels::Fp8Scales lm_head_fp8;    // defined when lm_head holds FP8 bytes (keep_fp8, a quantized head)
};

}  // namespace qwen_vl

/// The Qwen-VL vision-language models in fp32 ATen, loadable from HF safetensors: Qwen2-VL
/// (vision tower with 2-D rotary attention and a patch merger, Qwen2 decoder with M-RoPE),
/// Qwen2.5-VL (window attention, RMSNorm and SwiGLU in the tower) and Qwen3-VL (learned
/// interpolated positions, DeepStack, Qwen3 decoder with q/k norms and interleaved M-RoPE).
/// config().family says which; the table in qwen_vl_config.h lists what differs. All three use
/// Qwen2-VL's M-RoPE index rule for images, except that Qwen2.5-VL puts all frames at time 0.
///
///   auto model = vlmgen::QwenVl::from_checkpoint("/models/Qwen2-VL-2B-Instruct");
///   vlmgen::InferenceContext ctx(model->traits().kv_cache, /*batch=*/1, /*capacity=*/1024);
///   at::Tensor logits = model->forward(args);   // [B, S, vocab]
///
/// Tensor parallelism (Megatron-style, over the ParallelContext's tp_group): each rank holds
/// q/k/v and gate/up split by output rows (column-parallel), o and down split by input columns
/// (row-parallel, all-reduced), and the embedding and lm_head split by vocabulary rows (a tied
/// lm_head is the same shard). Attention and KV heads divide evenly over the ranks, so each
/// rank's KV cache holds num_key_value_heads / tp heads (traits().kv_cache). forward returns
/// this rank's block of the vocabulary, [B, S, vocab / tp] (traits().vocab_parallel_logits).
/// The vision tower is sharded the same way (qkv by heads, proj and fc2 row-parallel, fc1
/// column-parallel, the merger's two linears column- then row-parallel) when its heads, MLP
/// width and merger width divide by tp, and replicated on every rank otherwise
/// (vision_tower_sharded()).
///
/// Sequence parallelism (parallel.sequence_parallel()): a window of more than one token (the
/// prefill) is split along the sequence between blocks: padded at the end to a multiple of tp,
/// all-gathered before each column-parallel projection, reduce-scattered after each
/// row-parallel one, and gathered (padding dropped) before lm_head. A one-token decode step
/// skips the split. Attention always sees the whole window, so the KV cache holds every column
/// and decoding with a cache under SP is exact (traits().kv_cache_under_sequence_parallel).
///
///   vlmgen::ParallelContext par = vlmgen::init_parallel_from_env(2);   // torchrun-style ranks
///   auto model = vlmgen::QwenVl::from_checkpoint(dir, par);           // this rank's slices only
///   vlmgen::Generator generator(*model, par);                          // same tokens on every rank
class QwenVl : public CausalVlm {
 public:
  /// Random weights (normal with std `init_std`, RMS/LayerNorm weights around 1), drawn on the
  /// CPU from one generator seeded with `seed`: same config and seed, same weights. Throws vlmgen::Error for a config
  /// the architecture cannot run (heads not dividing, mrope_section not summing to head_dim / 2, ...).
  /// Under tensor parallelism every rank draws every full tensor and keeps its slice, so the
  /// ranks together hold exactly the single-process model of the same seed; heads, KV heads,
  /// intermediate_size and vocab_size must divide by tp_size (vlmgen::Error naming the numbers,
  /// raised before anything is allocated).
  explicit QwenVl(const QwenVlConfig& config, uint64_t seed = 0, double init_std = 0.02,
                  ParallelContext parallel = ParallelContext::single());

  /// Reads `dir`/config.json and the safetensors weights in `dir`. Accepts both HF spellings
  /// (`visual.*` + `model.*` and the newer `model.visual.*` + `model.language_model.*`), stores
  /// F16/BF16/FP8 weights as `options` says (float32 by default; LoadOptions), and ties lm_head to the embedding when
  /// the config says so or the checkpoint has no `lm_head.weight`. Missing tensors are listed by name in a
  /// vlmgen::Error. Under tensor parallelism each rank reads only its own slices from the memory-mapped files; the
  /// divisibility of heads and vocabulary by tp_size is checked right after config.json, before any weight is read.
  static std::unique_ptr<QwenVl> from_checkpoint(const std::string& dir,
                                                 const ParallelContext& parallel = ParallelContext::single(),
                                                 const LoadOptions& options = {});

  /// The dtype of the language model's matrices (embedding, attention and MLP weights, lm_head):
  /// float32 unless loaded or converted otherwise.
  at::ScalarType weights_dtype() const;
  /// Stores the language model's matrices as `dtype` (float32, bfloat16 or float16); norms,
  /// biases and the vision tower stay float32. Compute stays float32: the CPU kernels widen
  /// 16-bit weights as they read them, so a decode step reads half the bytes.
  void convert_weights(at::ScalarType dtype);
  /// True when some linears compute from FP8 bytes (loaded with LoadOptions::keep_fp8): such a
  /// model runs on the CPU only, and save_checkpoint writes those weights dequantized.
  bool keeps_fp8() const;

  /// Writes `dir`/config.json and `dir`/model.safetensors (HF `visual.*`/`model.*` names; no
  /// `lm_head.weight` when tied). Creates `dir` when needed. Under tensor parallelism every rank
  /// of the group must call it: the shards are all-gathered, rank 0 writes the full checkpoint,
  /// and all return once it is written.
  void save_checkpoint(const std::string& dir) const;

  const ModelTraits& traits() const override { return traits_; }
  /// float32 (default), bfloat16 or FP8 (at::kByte; check_kv_cache_dtype); LoadOptions::kv_cache_dtype
  /// sets it.
  void set_kv_cache_dtype(at::ScalarType dtype) override;
  /// Logits [B, S, vocab], float32 ([B, S, vocab / tp], this rank's block, under tensor
  /// parallelism). Image placeholders in the window take, in order, the rows
  /// of args.image_embeddings when defined, else the vision tower's output for args.vision; the
  /// counts must match exactly (vlmgen::Error with both numbers). With neither, placeholders
  /// embed as ordinary tokens. With a context, appends each layer's K/V without committing.
  /// Under tensor parallelism every rank of the group must make the same calls.
  at::Tensor forward(const ForwardArgs& args) override;
  /// Decode calls of several requests (each with a KV cache, no images; under sequence
  /// parallelism one-token windows only) in one decoder pass: the linear layers run once over
  /// all their tokens, attention per call over its own cache. On the CPU kernels a pass takes at
  /// most kernels::max_fast_rows tokens (a larger batch is cut into several passes), so each
  /// call's logits are those of its own forward. Anything else runs call by call.
  std::vector<at::Tensor> forward_batch(const std::vector<const ForwardArgs*>& calls) override;
  at::Device device() const override { return lm_.embed_tokens.device(); }

  bool can_encode_images() const override { return true; }
  /// Runs the vision tower: [sum of placeholder counts, config().image_embedding_width()],
  /// float32, in image order. Each row is the merged embedding (hidden_size columns) followed,
  /// for Qwen3-VL, by that token's DeepStack features (hidden_size columns each), so a cache of
  /// these rows replays everything the LM needs of an image.
  at::Tensor encode_images(const VisionInputs& vision) override;

  /// Qwen-VL's M-RoPE index rule for images (HF get_rope_index; Qwen2.5-VL puts every frame of an
  /// image at time 0, the others count frames): text advances t/h/w
  /// together; an image of merged grid (t, h, w) takes (t_i, h_i, w_i) offset by the text before it, and text after it
  /// resumes at the largest position so far + 1. Returns [3, B, L] and delta[b] = (largest position of row b + 1) -
  /// (real tokens of row b). With an empty bundle placeholder tokens count as text.
  RopePlan plan_positions(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                          const VisionInputs& vision) const override;
  /// The same rule over spans already found (padded columns, as the generator's RequestLayout
  /// holds them): each span must cover its image's placeholder count of image tokens.
  RopePlan plan_positions_with_spans(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                     const VisionInputs& vision, const std::vector<ImageSpan>& spans) const override;

  const QwenVlConfig& config() const { return config_; }
  /// True when lm_head is the embedding matrix (one tensor, stored once).
  bool tied_embeddings() const { return config_.tie_word_embeddings; }

  /// Every weight under its HF name (`visual.*`, `model.*`, `lm_head.weight`), each tensor once:
  /// a tied lm_head is not listed. Pointers stay valid for the model's lifetime. Under tensor
  /// parallelism these are this rank's slices (see shard_layout).
  std::vector<std::pair<std::string, at::Tensor*>> named_weights();
  std::vector<std::pair<std::string, const at::Tensor*>> named_weights() const;

  /// How the weight named `name` (as in named_weights) is split across tensor-parallel ranks
  /// (kReplicated for all of them when tp_size is 1). vlmgen::Error for an unknown name.
  qwen_vl::ShardLayout shard_layout(const std::string& name) const;

  const ParallelContext& parallel() const { return parallel_; }
  /// True when the vision tower is split across tensor-parallel ranks, false when every rank
  /// holds all of it (tp_size 1, or its heads, MLP width or merger width do not divide by tp).
  bool vision_tower_sharded() const { return vision_sharded_; }

  qwen_vl::VisionTower& vision_tower() { return vision_; }
  const qwen_vl::VisionTower& vision_tower() const { return vision_; }
  qwen_vl::LanguageModel& language_model() { return lm_; }
  const qwen_vl::LanguageModel& language_model() const { return lm_; }

  /// Moves every weight to `device` (keeps a tied lm_head tied).
  void to(at::Device device);

  /// How many times the vision tower ran (forward with pixels, or encode_images); for tests of
  /// encoder caching.
  int64_t vision_tower_calls() const { return vision_tower_calls_; }

 private:
  friend class LlavaNext;  // its text model is this decoder, loaded under LLaVA-NeXT's names
  struct Uninitialized {};
  QwenVl(const QwenVlConfig& config, Uninitialized, ParallelContext parallel);
  /// Throws unless heads, KV heads, intermediate_size and vocab_size divide by tp_size.
  static void check_parallel_config(const QwenVlConfig& config, const ParallelContext& parallel);
  void write_checkpoint(const std::string& dir, const std::map<std::string, at::Tensor>& tensors) const;

  struct WeightSlot {
    std::string name;
    at::Tensor* tensor;
    qwen_vl::ShardLayout layout;
  };
  /// named_weights with each weight's layout, in the same order.
  std::vector<WeightSlot> weight_slots();
  /// The unsharded shape of a weight whose local slice is `local` (tp_size times longer along
  /// the split dimension).
  std::vector<int64_t> full_shape(const at::Tensor& local, qwen_vl::ShardLayout layout) const;

  void allocate_weights();
  /// Weights that weights_dtype applies to: 2-D tensors of the language model (named_weights names).
  static bool is_lm_matrix(const std::string& name, const at::Tensor& tensor);
  /// The decoder linear whose weight is named `name` (`model.layers.N.self_attn.q_proj.weight`,
  /// ...), or nullptr.
  qwen_vl::Linear* decoder_linear(const std::string& name);
  static void check_weights_dtype(at::ScalarType dtype);
  void init_random(uint64_t seed, double init_std);
  void tie_lm_head();

  /// Vision tower over a validated bundle: [sum_i t_i*h_i*w_i / merge^2, image_embedding_width].
  at::Tensor run_vision_tower(const VisionInputs& vision);
  /// One forward call's rows in a decoder pass: `rows` x `cols` tokens of the hidden stream,
  /// attending over its own KV cache (or none) with its mask [rows, window_start + cols].
  struct LmSegment {
    int64_t rows = 0;
    int64_t cols = 0;
    int64_t window_start = 0;
    InferenceContext* context = nullptr;
    at::Tensor attention_mask;  // int64, on the model's device
    bool last_column_only = false;
  };
  /// A forward call's inputs, checked and on the model's device: ids [B, S], positions
  /// [3, B, S], mask [B, window_start + S].
  struct CheckedWindow {
    at::Tensor ids;
    at::Tensor positions;
    LmSegment segment;
  };
  CheckedWindow check_window(const ForwardArgs& args) const;
  /// Token embeddings [.., hidden] float32 of ids [..] (vocab-parallel under TP).
  at::Tensor embed(const at::Tensor& ids) const;
  /// Decoder over embeddings [B, S, hidden] of one segment ([1, T, hidden] of several, their
  /// rows one after another, with positions [3, 1, T]): logits [rows, cols, vocab] per
  /// segment ([rows, 1, vocab] for the last column only).
  /// `deepstack` [P, deepstack_count, hidden] is added after layers 0.. at the flat [B * S]
  /// positions `deepstack_rows` (both undefined: none).
  std::vector<at::Tensor> run_language_model(at::Tensor hidden, const at::Tensor& position_ids,
                                             const std::vector<LmSegment>& segments, const at::Tensor& deepstack = {},
                                             const at::Tensor& deepstack_rows = {}) const;

  /// M-RoPE positions with images at `spans`, in real-token indices of each row (`padded`
  /// false) or in padded columns (`padded` true).
  RopePlan place_images(const at::Tensor& input_ids, const at::Tensor& attention_mask, const VisionInputs& vision,
                        const std::vector<ImageSpan>& spans, bool padded) const;

  QwenVlConfig config_;
  ParallelContext parallel_;
  Communicator* tp_comm_ = nullptr;  // parallel_.tp_group(), null when tp_size is 1
  bool vision_sharded_ = false;
  ModelTraits traits_;
  qwen_vl::VisionTower vision_;
  qwen_vl::LanguageModel lm_;
  int64_t vision_tower_calls_ = 0;
};

}  // namespace vlmgen
