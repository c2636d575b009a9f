#pragma once

// The checks one request passes before the first forward call, so that bad input never leaves
// half-done state behind, and the digest the tensor-parallel ranks compare.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "vlmgen/content_hash.h"
#include "vlmgen/error.h"
#include "vlmgen/image_spans.h"
#include "vlmgen/model.h"
#include "vlmgen/request.h"

namespace vlmgen::detail {

/// Everything one generate call checks before the first forward call, so that bad input
/// never leaves half-done state behind.
inline void validate_request(const GenerateRequest& request, const GenerationConfig& config,
                             const ModelTraits& traits) {
  VLMGEN_CHECK(traits.vocab_size > 0, "the model reports vocab_size {}; expected > 0", traits.vocab_size);
  VLMGEN_CHECK(!request.prompts.empty(), "the batch is empty: expected at least one prompt");
  VLMGEN_CHECK(config.max_new_tokens() >= 0, "max_new_tokens must be >= 0, got {}", config.max_new_tokens());
  VLMGEN_CHECK(config.prefill_chunk_size() >= 0, "prefill_chunk_size must be >= 0 (0 = whole prompt), got {}",
               config.prefill_chunk_size());
  config.sampling().validate(static_cast<int64_t>(request.prompts.size()));
  VLMGEN_CHECK(config.top_logprobs() >= 0 && config.top_logprobs() <= traits.vocab_size,
               "top_logprobs must be in [0, {}] (the vocabulary), got {}", traits.vocab_size, config.top_logprobs());
  auto check_id = [&](int64_t id, const char* what) {
    VLMGEN_CHECK(id >= 0 && id < traits.vocab_size, "{} {} is outside the vocabulary [0, {})", what, id,
                 traits.vocab_size);
  };
  check_id(config.pad_token_id(), "pad_token_id");
  VLMGEN_CHECK(config.pad_token_id() != traits.image_token_id.value_or(-1) &&
                   config.pad_token_id() != traits.video_token_id.value_or(-1),
               "pad_token_id {} is the model's image/video placeholder token; padding must be a plain token",
               config.pad_token_id());
  for (int64_t id : config.end_token_ids()) check_id(id, "end token id");
  for (int64_t id : config.stop_token_ids()) check_id(id, "stop token id");
  const int64_t max_columns = traits.max_sequence_length > 0
                                  ? std::min(traits.max_sequence_length, GenerationConfig::kMaxSequenceColumns)
                                  : GenerationConfig::kMaxSequenceColumns;
  for (size_t r = 0; r < request.prompts.size(); ++r) {
    const auto& p = request.prompts[r];
    VLMGEN_CHECK(!p.empty(), "prompt {} is empty: expected at least one token", r);
    // Each bounded here; their sum against the model's length below (lay_out_request), and
    // against kMaxSequenceColumns here, as the buffers are sized for it.
    VLMGEN_CHECK(static_cast<int64_t>(p.size()) <= max_columns && config.max_new_tokens() <= max_columns &&
                     static_cast<int64_t>(p.size()) + config.max_new_tokens() <= GenerationConfig::kMaxSequenceColumns,
                 "prompt {} of {} tokens + max_new_tokens {} exceeds the limit of {} columns per row (the model's "
                 "max_sequence_length {}, or GenerationConfig::kMaxSequenceColumns {} when it sets none)",
                 r, p.size(), config.max_new_tokens(), max_columns, traits.max_sequence_length,
                 GenerationConfig::kMaxSequenceColumns);
    for (size_t i = 0; i < p.size(); ++i) {
      VLMGEN_CHECK(p[i] >= 0 && p[i] < traits.vocab_size, "prompt {} token {} is {}, outside the vocabulary [0, {})", r,
                   i, p[i], traits.vocab_size);
      VLMGEN_CHECK(!traits.video_token_id || p[i] != *traits.video_token_id,
                   "prompt {} holds a video placeholder (token {} at {}); videos are not supported yet", r, p[i], i);
    }
  }
  if (!request.vision.empty()) {
    VLMGEN_CHECK(traits.image_token_id.has_value(),
                 "the request has vision tensors ({} images) but the model declares no image token id",
                 request.vision.num_images());
    VLMGEN_CHECK(request.vision.layout == traits.vision_layout,
                 "the vision bundle uses the {} layout but the model expects {}",
                 request.vision.layout == VisionLayout::kPatchFlattened ? "patch-flattened" : "per-image",
                 traits.vision_layout == VisionLayout::kPatchFlattened ? "patch-flattened" : "per-image");
    request.vision.validate(traits.spatial_merge_size);
    if (config.check_pixel_values()) request.vision.check_finite();
  }
}

/// Checks that every placeholder span sits between the model's vision start and end tokens
/// (Qwen-VL: <|vision_start|> <|image_pad|>... <|vision_end|>), when the model declares them:
/// placeholders outside that frame were not made by the model's own chat format.
inline void check_span_frames(const std::vector<std::vector<int64_t>>& prompts, const std::vector<ImageSpan>& spans,
                              const std::vector<int64_t>& pads, const ModelTraits& traits) {
  if (!traits.vision_start_token_id || !traits.vision_end_token_id) return;
  for (const ImageSpan& s : spans) {
    const auto& row = prompts[static_cast<size_t>(s.row)];
    const int64_t begin = s.begin - pads[s.row], end = s.end - pads[s.row];
    const bool framed = begin >= 1 && row[begin - 1] == *traits.vision_start_token_id &&
                        end < static_cast<int64_t>(row.size()) && row[end] == *traits.vision_end_token_id;
    VLMGEN_CHECK(framed,
                 "prompt {}: image {}'s placeholders at [{}, {}) must be enclosed by the vision start token {} and "
                 "the vision end token {}, got {} before and {} after",
                 s.row, s.image, begin, end, *traits.vision_start_token_id, *traits.vision_end_token_id,
                 begin >= 1 ? fmt::to_string(row[begin - 1]) : std::string("nothing"),
                 end < static_cast<int64_t>(row.size()) ? fmt::to_string(row[end]) : std::string("nothing"));
  }
}

/// Digest of everything that decides a call's collectives and tokens, for the tensor-parallel
/// agreement check: prompts, images (bytes, shape, dtype) and every option.
inline ContentHash request_digest(const GenerateRequest& request, const GenerationConfig& c) {
  Sha256 sha;
  sha.update_int(static_cast<int64_t>(request.prompts.size()));
  for (const auto& p : request.prompts) {
    sha.update_int(static_cast<int64_t>(p.size()));
    sha.update(p.data(), p.size() * sizeof(int64_t));
  }
  sha.update_int(static_cast<int64_t>(request.vision.layout));
  hash_tensor(sha, request.vision.pixel_values);
  hash_tensor(sha, request.vision.image_grid_thw);
  hash_tensor(sha, request.vision.image_sizes);
  sha.update_int(request.context != nullptr ? request.context->length() : -1);
  auto ids = [&](const std::vector<int64_t>& v) {
    sha.update_int(static_cast<int64_t>(v.size()));
    sha.update(v.data(), v.size() * sizeof(int64_t));
  };
  ids(c.end_token_ids());
  ids(c.stop_token_ids());
  for (int64_t v :
       {c.max_new_tokens(), c.pad_token_id(), c.top_k(), c.prefill_chunk_size(), static_cast<int64_t>(c.replay_mode()),
        int64_t{c.enable_kv_cache()}, int64_t{c.return_logprobs()}, int64_t{c.encoder_cache()},
        int64_t{c.allow_placeholder_tokens()}, int64_t{c.full_logits()}, int64_t{c.check_pixel_values()},
        static_cast<int64_t>(c.seed()), int64_t{c.prompt_logprobs()}, c.top_logprobs(), int64_t{c.return_logits()}}) {
    sha.update_int(v);
  }
  for (double v : {c.temperature(), c.top_p()}) sha.update(&v, sizeof v);
  sha.update_int(static_cast<int64_t>(c.row_seeds().size()));
  for (uint64_t v : c.row_seeds()) sha.update_int(static_cast<int64_t>(v));
  return sha.finish();
}

}  // namespace vlmgen::detail

namespace vlmgen::detail {

/// Where a validated request's tokens and images sit once its rows are left-padded to one
/// length.
struct RequestLayout {
  int64_t batch = 0;
  int64_t prompt_len = 0;        ///< columns of the left-padded prompts
  int64_t max_new = 0;           ///< GenerationConfig::max_new_tokens
  int64_t total = 0;             ///< prompt_len + max_new
  int64_t fed_columns = 0;       ///< columns a KV cache must hold (the last token is never fed)
  std::vector<int64_t> pads;     ///< [batch], left padding of each row
  std::vector<int64_t> counts;   ///< [num_images], placeholder rows of each image
  std::vector<ImageSpan> spans;  ///< every image's placeholder run, in padded columns
};

/// Replay mode 'always' sends every image to every call, which a decode step over a KV cache
/// (no placeholders in its window) cannot take: refused before any forward call.
inline void check_replay_with_cache(bool use_kv_cache, ReplayMode mode, const RequestLayout& layout) {
  VLMGEN_CHECK(!(use_kv_cache && mode == ReplayMode::kAlways && !layout.spans.empty()),
               "replay mode 'always' sends every image to every call, which a KV-cache decode step (no placeholders "
               "in its window) cannot take; use kSpanAware, or enable_kv_cache(false)");
}

/// Lays out a request that passed validate_request: pads, the image spans (placeholder counts
/// checked against the bundle, spans framed by the vision tokens), and the column budget
/// against the model's maximum sequence length.
inline RequestLayout lay_out_request(const GenerateRequest& request, const GenerationConfig& config, CausalVlm& model) {
  const ModelTraits& traits = model.traits();
  RequestLayout l;
  l.batch = static_cast<int64_t>(request.prompts.size());
  for (const auto& p : request.prompts) l.prompt_len = std::max<int64_t>(l.prompt_len, static_cast<int64_t>(p.size()));
  for (const auto& p : request.prompts) l.pads.push_back(l.prompt_len - static_cast<int64_t>(p.size()));
  const VisionInputs& vision = request.vision;
  if (traits.image_token_id) {
    if (!vision.empty()) {
      l.counts = model.placeholder_counts(vision);
      VLMGEN_CHECK(static_cast<int64_t>(l.counts.size()) == vision.num_images(),
                   "the model's placeholder_counts gave {} counts for {} images", l.counts.size(), vision.num_images());
    }
    l.spans = find_image_spans(request.prompts, *traits.image_token_id, l.counts, l.pads);
    check_span_frames(request.prompts, l.spans, l.pads, traits);
  }
  l.max_new = config.max_new_tokens();
  l.total = l.prompt_len + l.max_new;
  VLMGEN_CHECK(traits.max_sequence_length <= 0 || l.total <= traits.max_sequence_length,
               "prompt of {} columns + max_new_tokens {} = {} exceeds the model's maximum sequence length {}",
               l.prompt_len, l.max_new, l.total, traits.max_sequence_length);
  l.fed_columns = l.prompt_len + std::max<int64_t>(l.max_new - 1, 0);
  return l;
}

}  // namespace vlmgen::detail
