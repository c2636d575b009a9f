#pragma once

// A caller's InferenceContext given to a request: it must fit the model and the request, and
// whatever it already holds must be the request's own beginning — the same tokens with the same
// left padding, and the same pictures behind the same placeholders.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vlmgen/content_hash.h"
#include "vlmgen/error.h"
#include "vlmgen/image_spans.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/model.h"

namespace vlmgen::detail {

/// Throws vlmgen::Error unless `context` can hold `batch` rows of `fed_columns` columns of the
/// model described by `traits` on `device`.
inline void check_context_fits(const InferenceContext& context, int64_t batch, int64_t fed_columns, int64_t prompt_len,
                               int64_t max_new, const ModelTraits& traits, at::Device device) {
  VLMGEN_CHECK(context.batch_size() == batch, "the context holds {} rows but the request has {}", context.batch_size(),
               batch);
  VLMGEN_CHECK(context.capacity() >= fed_columns,
               "prompt of {} columns + max_new_tokens {} needs {} KV cache columns but the context has capacity {}",
               prompt_len, max_new, fed_columns, context.capacity());
  const KvCacheSpec& have = context.spec();
  const KvCacheSpec& want = traits.kv_cache;
  VLMGEN_CHECK(
      have.num_layers == want.num_layers && have.num_kv_heads == want.num_kv_heads && have.head_dim == want.head_dim,
      "the context was made for layers={} kv_heads={} head_dim={} but the model has {} / {} / {}", have.num_layers,
      have.num_kv_heads, have.head_dim, want.num_layers, want.num_kv_heads, want.head_dim);
  VLMGEN_CHECK(have.dtype == want.dtype && context.device() == device,
               "the context stores {} on {} but the model needs {} on {}", c10::toString(have.dtype),
               context.device().str(), c10::toString(want.dtype), device.str());
}

/// Throws vlmgen::Error unless the context's committed columns equal the first columns of the
/// request (`tokens`, `mask`: [batch, >= prompt_len], left-padded) and hold the request's
/// images (`fingerprints`, per image of the request) wherever the request has them.
inline void check_continuation(const InferenceContext& context, const at::Tensor& tokens, const at::Tensor& mask,
                               int64_t prompt_len, const std::vector<ImageSpan>& spans,
                               const std::vector<ContentHash>& fingerprints) {
  const int64_t cached = context.length();
  if (cached == 0) return;
  VLMGEN_CHECK(cached < prompt_len,
               "the context already holds {} columns; the prompt ({} columns, left-padded) must extend it by at "
               "least one token",
               cached, prompt_len);
  at::Tensor differs =
      (context.tokens() != tokens.narrow(1, 0, cached)) | (context.attention_mask() != mask.narrow(1, 0, cached));
  if (differs.any().item<bool>()) {
    at::Tensor where = differs.nonzero()[0];
    const int64_t r = where[0].item<int64_t>(), c = where[1].item<int64_t>();
    VLMGEN_FAIL(
        "the context's cached columns differ from the prompt at row {} column {} (cached token {} mask "
        "{}, prompt token {} mask {}); a continuation must repeat the cached prefix exactly, with the "
        "same left padding",
        r, c, context.tokens()[r][c].item<int64_t>(), context.attention_mask()[r][c].item<int64_t>(),
        tokens[r][c].item<int64_t>(), mask[r][c].item<int64_t>());
  }
  // Same tokens are not enough: the cached images must be the request's images.
  for (const CachedImage& held : context.cached_images()) {
    auto it = std::find_if(spans.begin(), spans.end(), [&](const ImageSpan& s) {
      return s.row == held.row && s.begin == held.begin && s.end == held.end;
    });
    VLMGEN_CHECK(it != spans.end(),
                 "the context holds an image at row {} columns [{}, {}) but the request has none there", held.row,
                 held.begin, held.end);
    VLMGEN_CHECK(fingerprints.at(static_cast<size_t>(it->image)) == held.fingerprint,
                 "the request's image {} (row {} columns [{}, {})) is not the picture cached there; a "
                 "continuation must bring the same images, or truncate the context before them",
                 it->image, it->row, it->begin, it->end);
  }
  for (const ImageSpan& s : spans) {
    if (s.end > cached) continue;
    const auto& held = context.cached_images();
    VLMGEN_CHECK(std::any_of(held.begin(), held.end(),
                             [&](const CachedImage& h) { return h.row == s.row && h.begin == s.begin; }),
                 "the request's image {} (row {} columns [{}, {})) lies in the context's cached columns, but "
                 "the context holds no image there (those placeholders were cached without pixels)",
                 s.image, s.row, s.begin, s.end);
  }
}

}  // namespace vlmgen::detail
