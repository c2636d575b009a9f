#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "vlmgen/image_spans.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/positions.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen {

/// What the generator needs to know about a model.
struct ModelTraits {
  /// Number of real token ids; logits may carry more columns (padded vocab), which are ignored.
  int64_t vocab_size = 0;
  /// The placeholder token of an image; unset for a text-only model.
  std::optional<int64_t> image_token_id;
  /// Tokens that must enclose every image's placeholder run (Qwen-VL: <|vision_start|> and
  /// <|vision_end|>); when both are set, the generator refuses placeholders outside them.
  std::optional<int64_t> vision_start_token_id;
  std::optional<int64_t> vision_end_token_id;
  /// The placeholder token of a video frame group; videos are not sent by this version.
  std::optional<int64_t> video_token_id;
  /// Patches merged per side into one LM token (Qwen-VL: 2); 1 for none.
  int64_t spatial_merge_size = 1;
  VisionLayout vision_layout = VisionLayout::kPatchFlattened;
  /// kPerImage: placeholder tokens per image when the count is fixed (0: the model overrides
  /// placeholder_counts).
  int64_t tokens_per_image = 0;
  /// Longest sequence the model takes (0 = no limit).
  int64_t max_sequence_length = 0;
  /// The model reads and writes an InferenceContext when one is given.
  bool supports_kv_cache = true;
  /// The model can decode with a KV cache under sequence parallelism. When false, a KV-cache
  /// request under SP falls back to full-prefix recompute (with vision replayed every step).
  bool kv_cache_under_sequence_parallel = false;
  /// The model can take part of an image's placeholder span in one call (the generator then
  /// lets a window cut a span).
  bool accepts_partial_image_span = false;
  /// forward returns this tensor-parallel rank's block of the vocabulary only (Megatron's
  /// vocab-parallel output layer): logits [B, S, W] hold ids [tp_rank * W, (tp_rank + 1) * W),
  /// with W * tp_size >= vocab_size. The Generator then chooses tokens through the
  /// ParallelContext's tp_group (local argmax + all-gathered (value, id) pairs for greedy, the
  /// last position gathered for sampling and logprobs), so pass it the model's ParallelContext.
  bool vocab_parallel_logits = false;
  /// Shape of the KV cache the generator allocates for this model.
  KvCacheSpec kv_cache;
};

class InferenceContext;

/// One forward call: the token window [window_start, window_start + S) of every row.
struct ForwardArgs {
  /// [B, S], int64: the window's token ids. The generator and the engine pass them on the CPU
  /// (the other tensors on the model's device): a model checks ids there without waiting for
  /// its device, and copies the window over itself (a Python model gets them on its device).
  at::Tensor input_ids;
  /// [B, S] or [3, B, S] (M-RoPE), int64: the window's position ids.
  at::Tensor position_ids;
  /// [B, window_start + S], int64: 1 for real tokens, 0 for left padding, over every column up
  /// to the window's end (cached columns included). Causality comes from column indices.
  at::Tensor attention_mask;
  /// The KV cache holding columns [0, window_start), or null for a full-prefix recompute
  /// (then window_start is 0).
  InferenceContext* context = nullptr;
  /// The images whose placeholders are in the window (empty when none is sent).
  VisionInputs vision;
  /// Their indices in the request's bundle, ascending.
  std::vector<int64_t> images;
  /// [placeholders of `images`, hidden]: their embeddings, precomputed by encode_images and
  /// kept by the generator for the whole request (its encoder cache). When defined, the model
  /// uses these rows instead of running its vision tower on `vision`.
  at::Tensor image_embeddings;
  int64_t window_start = 0;
  /// The caller reads only the window's last column: the model may return logits [B, 1, V]
  /// and skip the output layer for the other columns.
  bool last_column_logits = false;
  /// 0 for the prefill (every chunk of it), k for the call that yields the k+1-th token.
  int64_t step = 0;
};

/// The model seam. Implement it for your model; wrap it in testing::ForwardSpy to see the calls.
class CausalVlm {
 public:
  virtual ~CausalVlm() = default;

  virtual const ModelTraits& traits() const = 0;

  /// What the KV caches generators and engines allocate for this model store
  /// (traits().kv_cache.dtype): float32, or bfloat16 or FP8 (at::kByte, fp8_kv_rows.h) where the
  /// model's forward reads such a cache (the shipped models do, on the CPU). A dtype it cannot use
  /// is a vlmgen::Error.
  virtual void set_kv_cache_dtype(at::ScalarType dtype) {
    VLMGEN_CHECK(dtype == at::kFloat, "this model keeps a float32 KV cache, not {}", c10::toString(dtype));
  }

  /// Logits [B, S, V] (V >= traits().vocab_size), floating point, for the window in `args`
  /// ([B, S, W], this rank's block of the vocabulary, when traits().vocab_parallel_logits).
  /// With a context the model appends the window's K/V to it (InferenceContext::append_kv)
  /// but does not commit: the generator does.
  virtual at::Tensor forward(const ForwardArgs& args) = 0;

  /// Several independent forward calls at once: different requests, each with its own window,
  /// KV cache, mask and positions (the engine's decode step). Returns each call's logits as
  /// forward would. A model may fuse them into one pass that reads its weights once for all;
  /// the default runs them one after another. Either way no context is committed, and when one
  /// call fails the whole batch throws.
  virtual std::vector<at::Tensor> forward_batch(const std::vector<const ForwardArgs*>& calls) {
    std::vector<at::Tensor> logits;
    logits.reserve(calls.size());
    for (const ForwardArgs* call : calls) logits.push_back(forward(*call));
    return logits;
  }

  /// Device the model's inputs should be on.
  virtual at::Device device() const { return at::kCPU; }

  /// Placeholder tokens each image of `vision` occupies. Default: from the grid and the merge
  /// size (patch-flattened) or traits().tokens_per_image (per-image).
  virtual std::vector<int64_t> placeholder_counts(const VisionInputs& vision) const {
    return vision.placeholder_counts(traits().spatial_merge_size, traits().tokens_per_image);
  }

  /// True when encode_images is implemented: the generator then runs the vision tower once
  /// per image per request and replays the embeddings instead of the pixels.
  virtual bool can_encode_images() const { return false; }

  /// Embeddings [sum of placeholder counts, hidden] of every image of `vision`, in image order.
  virtual at::Tensor encode_images(const VisionInputs& vision) {
    (void)vision;
    VLMGEN_FAIL("this model does not implement encode_images (can_encode_images() is false)");
  }

  /// Position ids of a left-padded prompt ([B, L] ids and mask, CPU) with its images. Default:
  /// 1-D positions. M-RoPE models return [3, B, L] positions and per-row deltas.
  virtual RopePlan plan_positions(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                  const VisionInputs& vision) const {
    (void)input_ids;
    (void)vision;
    return plan_1d_positions(attention_mask);
  }

  /// plan_positions for a prompt whose image spans the caller has already found
  /// (find_image_spans over the unpadded rows; columns in the padded [B, L] layout, as
  /// RequestLayout::spans holds them). The generator and the engine call this one, so image
  /// placement has one owner; a model that places images by span overrides it. Default: ignores
  /// the spans and calls plan_positions.
  virtual RopePlan plan_positions_with_spans(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                             const VisionInputs& vision, const std::vector<ImageSpan>& spans) const {
    (void)spans;
    return plan_positions(input_ids, attention_mask, vision);
  }
};

}  // namespace vlmgen
