#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "vlmgen/content_hash.h"
#include "vlmgen/error.h"
#include "vlmgen/image_spans.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/logging.h"
#include "vlmgen/model.h"
#include "vlmgen/parallel.h"
#include "vlmgen/positions.h"
#include "vlmgen/replay_policy.h"
#include "vlmgen/sampling.h"
#include "vlmgen/step/rank_agreement.h"
#include "vlmgen/step/scores.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen {

/// Why a row stopped.
enum class FinishReason { kNotFinished, kEndId, kStopWords, kLength, kCancelled };

inline const char* to_string(FinishReason r) {
  switch (r) {
    case FinishReason::kNotFinished: return "not-finished";
    case FinishReason::kEndId: return "end-id";
    case FinishReason::kStopWords: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "?";
}

/// One generated token, as the streaming callback sees it.
struct TokenEvent {
  int64_t row = 0;
  int64_t step = 0;  ///< 0 for the first new token of the row
  int64_t token = 0;
  float logprob = 0.0f;  ///< log-probability of `token` (0 unless return_logprobs is on)
  FinishReason finish_reason = FinishReason::kNotFinished;  ///< set when this token ends the row
};

/// Called for every token of every row, in order. Return false to cancel that row (it finishes
/// with kCancelled; its other rows go on). Exceptions propagate out of generate().
using TokenCallback = std::function<bool(const TokenEvent&)>;

// Setters chain on lvalues (returning a reference) and on temporaries (returning the value, so
// `const auto& c = GenerationConfig().seed(1);` does not dangle).
#define VLMGEN_OPTION(Type, name, ...)                                \
 public:                                                              \
  auto name(Type value)&->decltype(*this) {                           \
    name##_ = std::move(value);                                       \
    return *this;                                                     \
  }                                                                   \
  auto name(Type value)&&->std::remove_reference_t<decltype(*this)> { \
    name##_ = std::move(value);                                       \
    return std::move(*this);                                          \
  }                                                                   \
  const Type& name() const { return name##_; }                        \
                                                                      \
 private:                                                             \
  Type name##_ = __VA_ARGS__;

/// Options of one generate call, with chaining setters. Checked by generate(), which throws
/// vlmgen::Error naming the bad value.
///
///   auto config = vlmgen::GenerationConfig().max_new_tokens(32).enable_kv_cache(false)
///                     .temperature(0.7).top_p(0.9).seed(1234).end_token_ids({2});
class GenerationConfig {
  /// New tokens per row at most (>= 0). Default 16.
  VLMGEN_OPTION(int64_t, max_new_tokens, 16)
  /// Decode with a KV cache (prefill once, then one token per call). Without it every step
  /// recomputes the whole prefix. Falls back to no cache when the model or sequence
  /// parallelism rules it out (logged once per Generator). Default true.
  VLMGEN_OPTION(bool, enable_kv_cache, true)
  /// Which images each forward call gets. Default kSpanAware, the correct rule.
  VLMGEN_OPTION(ReplayMode, replay_mode, ReplayMode::kSpanAware)
  /// Tokens that end a row with kEndId (the token is kept in the output). Default none.
  VLMGEN_OPTION(std::vector<int64_t>, end_token_ids, {})
  /// Tokens that end a row with kStopWords (kept in the output). Default none.
  VLMGEN_OPTION(std::vector<int64_t>, stop_token_ids, {})
  /// Token used for left padding and after a row has finished (always masked). Default 0.
  VLMGEN_OPTION(int64_t, pad_token_id, 0)
  /// 0 = greedy; > 0 samples from softmax(logits / temperature). Default 0.
  VLMGEN_OPTION(double, temperature, 0.0)
  /// Sample among the k most likely tokens only (0 = off). Default 0.
  VLMGEN_OPTION(int64_t, top_k, 0)
  /// Sample from the smallest set of tokens whose mass reaches top_p (1 = off). Default 1.
  VLMGEN_OPTION(double, top_p, 1.0)
  /// Seed of every row's random stream. Same seed, same tokens. Default 0.
  VLMGEN_OPTION(uint64_t, seed, 0)
  /// Per-row seeds overriding `seed` (empty = all rows use `seed`). Default empty.
  VLMGEN_OPTION(std::vector<uint64_t>, row_seeds, {})
  /// Return the log-probability of every chosen token. Default false.
  VLMGEN_OPTION(bool, return_logprobs, false)
  /// With a KV cache, prefill at most this many columns per call (0 = all at once). A chunk
  /// boundary never splits an image's placeholders: it moves to the nearest span edge.
  /// Default 0.
  VLMGEN_OPTION(int64_t, prefill_chunk_size, 0)
  /// When the model can encode images on their own (CausalVlm::can_encode_images), run its
  /// vision tower once per image per request and replay the embeddings instead of the pixels.
  /// Default true.
  VLMGEN_OPTION(bool, encoder_cache, true)
  /// Let the model generate its own image/video placeholder tokens. Off by default: a
  /// generated placeholder has no image behind it, so every later full-prefix recompute would
  /// present the model more placeholders than embeddings. Default false.
  VLMGEN_OPTION(bool, allow_placeholder_tokens, false)
  /// Ask the model for the logits of every column of each window (tests and analysis read
  /// them through a ForwardSpy). Off by default: the generator needs the last column only, and
  /// the output layer over a long prompt costs time and B x S x vocab floats. Default false.
  VLMGEN_OPTION(bool, full_logits, false)
  /// Refuse pixel_values holding a NaN or an infinity before the model runs (one min/max
  /// reduction over the pixels per call). Turn off only when the caller checks itself.
  /// Default true.
  VLMGEN_OPTION(bool, check_pixel_values, true)
  /// Return, per row, log P(prompt token i | tokens before it) for every prompt token
  /// (SequenceOutput::prompt_logprobs). The prefill then computes every column's logits. With
  /// max_new_tokens(0) the prompt is still computed, so a harness can score prompts. Default false.
  VLMGEN_OPTION(bool, prompt_logprobs, false)
  /// Return the k most likely (id, log-probability) pairs of every generated step (0 = off).
  /// Default 0.
  VLMGEN_OPTION(int64_t, top_logprobs, 0)
  /// Return the logits every generated token was chosen from, [tokens, vocab_size], gathered
  /// over the tensor-parallel group for vocab-parallel models. Default false.
  VLMGEN_OPTION(bool, return_logits, false)

 public:
  /// Most columns a row may reach (left-padded prompt + max_new_tokens) when the model sets no
  /// lower max_sequence_length. The generator sizes its buffers and KV cache for the whole
  /// request up front, so this bound is checked before anything is allocated.
  static constexpr int64_t kMaxSequenceColumns = int64_t{1} << 20;

  SamplingOptions sampling() const {
    SamplingOptions s;
    s.temperature = temperature_;
    s.top_k = top_k_;
    s.top_p = top_p_;
    s.seed = seed_;
    s.row_seeds = row_seeds_;
    return s;
  }
};

#undef VLMGEN_OPTION

/// One generate call's input.
struct GenerateRequest {
  GenerateRequest() = default;
  GenerateRequest(std::vector<std::vector<int64_t>> prompts_, VisionInputs vision_ = {},
                  InferenceContext* context_ = nullptr, TokenCallback on_token_ = {})
      : prompts(std::move(prompts_)), vision(std::move(vision_)), context(context_), on_token(std::move(on_token_)) {}

  /// One prompt per batch row, unpadded (rows may differ in length; the generator left-pads).
  std::vector<std::vector<int64_t>> prompts;
  /// Every image of every prompt, in order of appearance (row 0 first). When continuing from a
  /// context, that includes the images of the cached prefix: each call is sent only those
  /// whose placeholders it computes.
  VisionInputs vision;
  /// A KV cache to use and keep: if it already holds columns, they must equal the first
  /// columns of the left-padded prompts, and only the rest is computed. Null: the generator
  /// allocates one for the call when it decodes with a cache.
  InferenceContext* context = nullptr;
  /// Streaming: every token of every row as it is chosen.
  TokenCallback on_token;
  /// Set to true (from any thread) to cancel every unfinished row before the next call.
  const std::atomic<bool>* cancel = nullptr;
};

/// One row's output (with the scores of RowScores when asked for).
struct SequenceOutput : RowScores {
  std::vector<int64_t> tokens;  ///< new tokens only, including the end/stop token if any
  FinishReason finish_reason = FinishReason::kNotFinished;
  std::vector<float> logprobs;  ///< per token, when return_logprobs is on
};

struct GenerationStats {
  bool used_kv_cache = false;
  int64_t forward_calls = 0;
  int64_t prompt_columns = 0;    ///< left-padded prompt length
  int64_t generated_tokens = 0;  ///< over all rows
  int64_t images_encoded = 0;    ///< vision tower runs through the encoder cache (images)
  double time_to_first_token_s = 0.0;
  double decode_tokens_per_s = 0.0;  ///< tokens after each row's first, per second
  double total_s = 0.0;
};

struct GenerationResult {
  std::vector<SequenceOutput> sequences;
  GenerationStats stats;
};

/// The generation loop. Keeps no state between calls apart from having logged the KV-cache
/// fallback once; a failed call leaves it (and a caller's context) usable. Not thread-safe:
/// one call at a time per Generator.
///
///   vlmgen::Generator gen(model);
///   auto out = gen.generate({{prompt}, vision}, vlmgen::GenerationConfig().max_new_tokens(32));
///   for (int64_t t : out.sequences[0].tokens) ...
///
/// Tensor parallelism: every rank of the group runs its own Generator over its shard of the
/// model, built with the model's ParallelContext, and calls generate with the same request and
/// config. All ranks choose the same tokens at every step. The streaming callback and the
/// cancel flag must decide the same on every rank (for example, only rank 0 prints but all
/// return true): a rank that stops early leaves the others waiting in a collective until the
/// communicator's timeout raises vlmgen::Error.
class Generator {
 public:
  explicit Generator(CausalVlm& model, ParallelContext parallel = ParallelContext::single())
      : model_(model), parallel_(std::move(parallel)) {}

  CausalVlm& model() const { return model_; }
  const ParallelContext& parallel() const { return parallel_; }

  /// Runs one request. Throws vlmgen::Error for bad input (before any forward call) and passes
  /// on what the model or the callback throws; either way a caller's context is left exactly
  /// as it was before the call.
  GenerationResult generate(const GenerateRequest& request, const GenerationConfig& config = GenerationConfig());

 private:
  GenerationResult generate_unguarded(const GenerateRequest& request, const GenerationConfig& config);

  CausalVlm& model_;
  ParallelContext parallel_;
  bool fallback_logged_ = false;
};

namespace detail {

using Clock = std::chrono::steady_clock;

inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

inline bool contains(const std::vector<int64_t>& ids, int64_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

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
    VLMGEN_CHECK(static_cast<int64_t>(p.size()) <= max_columns && config.max_new_tokens() <= max_columns,
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

}  // namespace detail

inline GenerationResult Generator::generate(const GenerateRequest& request, const GenerationConfig& config) {
  InferenceContext* context = request.context;
  const int64_t entry_length = context != nullptr ? context->length() : 0;
  if (parallel_.tp_size() > 1 && parallel_.tp_group()) {
    // First, before anything a rank could refuse on its own: all ranks raise together.
    detail::check_ranks_agree(*parallel_.tp_group(), detail::request_digest(request, config), model_.device(),
                              "requests");
  }
  try {
    return generate_unguarded(request, config);
  } catch (...) {
    // Roll back what this call committed, so a retry sees the context as it was.
    if (context != nullptr && context->length() > entry_length) context->truncate(entry_length);
    throw;
  }
}

inline GenerationResult Generator::generate_unguarded(const GenerateRequest& request, const GenerationConfig& config) {
  const auto t_start = detail::Clock::now();
  const ModelTraits& traits = model_.traits();
  detail::validate_request(request, config, traits);

  const int64_t batch = static_cast<int64_t>(request.prompts.size());
  int64_t prompt_len = 0;
  for (const auto& p : request.prompts) prompt_len = std::max<int64_t>(prompt_len, static_cast<int64_t>(p.size()));
  std::vector<int64_t> pads(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) pads[b] = prompt_len - static_cast<int64_t>(request.prompts[b].size());

  // Where each image's placeholders sit; counts checked against the bundle.
  const VisionInputs& vision = request.vision;
  std::vector<ImageSpan> spans;
  std::vector<int64_t> counts;
  if (traits.image_token_id) {
    if (!vision.empty()) {
      counts = model_.placeholder_counts(vision);
      VLMGEN_CHECK(static_cast<int64_t>(counts.size()) == vision.num_images(),
                   "the model's placeholder_counts gave {} counts for {} images", counts.size(), vision.num_images());
    }
    spans = find_image_spans(request.prompts, *traits.image_token_id, counts, pads);
    detail::check_span_frames(request.prompts, spans, pads, traits);
  }

  const int64_t max_new = config.max_new_tokens();
  const int64_t total = prompt_len + max_new;
  VLMGEN_CHECK(traits.max_sequence_length <= 0 || total <= traits.max_sequence_length,
               "prompt of {} columns + max_new_tokens {} = {} exceeds the model's maximum sequence length {}",
               prompt_len, max_new, total, traits.max_sequence_length);
  // The last chosen token is never fed back, so the cache needs one column less.
  const int64_t fed_columns = prompt_len + std::max<int64_t>(max_new - 1, 0);

  // KV cache or full-prefix recompute.
  VLMGEN_CHECK(request.context == nullptr || config.enable_kv_cache(),
               "a context was given but enable_kv_cache is false; pass no context for no-cache decoding");
  const KvCacheDecision kv = decide_kv_cache(config.enable_kv_cache(), traits.supports_kv_cache,
                                             traits.kv_cache_under_sequence_parallel, parallel_);
  if (!kv.reason.empty() && !fallback_logged_) {
    log(LogLevel::kWarning, "KV cache requested but not used: {}", kv.reason);
    fallback_logged_ = true;
  }
  if (request.context != nullptr && !kv.use_kv_cache) {
    log(LogLevel::kWarning, "the request's context is neither read nor extended: {}", kv.reason);
  }
  VLMGEN_CHECK(!(kv.use_kv_cache && config.replay_mode() == ReplayMode::kAlways && !spans.empty()),
               "replay mode 'always' sends every image to every call, which a KV-cache decode step (no placeholders "
               "in its window) cannot take; use kSpanAware, or enable_kv_cache(false)");

  // Left-padded tokens and mask of every column, prompt then generated. Host masters.
  at::Tensor tokens = at::full({batch, total}, config.pad_token_id(), at::kLong);  // [B, total]
  at::Tensor mask = at::zeros({batch, total}, at::kLong);                          // [B, total]
  for (int64_t b = 0; b < batch; ++b) {
    const auto& p = request.prompts[b];
    tokens[b].narrow(0, pads[b], static_cast<int64_t>(p.size())).copy_(at::tensor(p, at::kLong));
    mask[b].narrow(0, pads[b], static_cast<int64_t>(p.size())).fill_(1);
  }
  if (max_new > 0) mask.narrow(1, prompt_len, max_new).fill_(1);

  std::unique_ptr<InferenceContext> own_context;
  InferenceContext* context = nullptr;
  // Fingerprints of the request's images, to record in (and check against) a caller's context.
  const std::vector<ContentHash> fingerprints =
      request.context != nullptr && kv.use_kv_cache ? vision.fingerprints() : std::vector<ContentHash>{};
  if (kv.use_kv_cache) {
    if (request.context != nullptr) {
      context = request.context;
      VLMGEN_CHECK(context->batch_size() == batch, "the context holds {} rows but the request has {}",
                   context->batch_size(), batch);
      VLMGEN_CHECK(context->capacity() >= fed_columns,
                   "prompt of {} columns + max_new_tokens {} needs {} KV cache columns but the context has capacity {}",
                   prompt_len, max_new, fed_columns, context->capacity());
      const KvCacheSpec& have = context->spec();
      const KvCacheSpec& want = traits.kv_cache;
      VLMGEN_CHECK(have.num_layers == want.num_layers && have.num_kv_heads == want.num_kv_heads &&
                       have.head_dim == want.head_dim,
                   "the context was made for layers={} kv_heads={} head_dim={} but the model has {} / {} / {}",
                   have.num_layers, have.num_kv_heads, have.head_dim, want.num_layers, want.num_kv_heads,
                   want.head_dim);
      VLMGEN_CHECK(have.dtype == want.dtype && context->device() == model_.device(),
                   "the context stores {} on {} but the model needs {} on {}", c10::toString(have.dtype),
                   context->device().str(), c10::toString(want.dtype), model_.device().str());
      const int64_t cached = context->length();
      if (cached > 0) {
        VLMGEN_CHECK(cached < prompt_len,
                     "the context already holds {} columns; the prompt ({} columns, left-padded) must extend it by at "
                     "least one token",
                     cached, prompt_len);
        at::Tensor differs = (context->tokens() != tokens.narrow(1, 0, cached)) |
                             (context->attention_mask() != mask.narrow(1, 0, cached));
        if (differs.any().item<bool>()) {
          at::Tensor where = differs.nonzero()[0];
          const int64_t r = where[0].item<int64_t>(), c = where[1].item<int64_t>();
          VLMGEN_FAIL(
              "the context's cached columns differ from the prompt at row {} column {} (cached token {} mask "
              "{}, prompt token {} mask {}); a continuation must repeat the cached prefix exactly, with the "
              "same left padding",
              r, c, context->tokens()[r][c].item<int64_t>(), context->attention_mask()[r][c].item<int64_t>(),
              tokens[r][c].item<int64_t>(), mask[r][c].item<int64_t>());
        }
        // Same tokens are not enough: the cached images must be the request's images.
        for (const CachedImage& held : context->cached_images()) {
          auto it = std::find_if(spans.begin(), spans.end(), [&](const ImageSpan& s) {
            return s.row == held.row && s.begin == held.begin && s.end == held.end;
          });
          VLMGEN_CHECK(it != spans.end(),
                       "the context holds an image at row {} columns [{}, {}) but the request has none "
                       "there",
                       held.row, held.begin, held.end);
          VLMGEN_CHECK(fingerprints.at(static_cast<size_t>(it->image)) == held.fingerprint,
                       "the request's image {} (row {} columns [{}, {})) is not the picture cached there; a "
                       "continuation must bring the same images, or truncate the context before them",
                       it->image, it->row, it->begin, it->end);
        }
        for (const ImageSpan& s : spans) {
          if (s.end > cached) continue;
          const auto& held = context->cached_images();
          VLMGEN_CHECK(std::any_of(held.begin(), held.end(),
                                   [&](const CachedImage& h) { return h.row == s.row && h.begin == s.begin; }),
                       "the request's image {} (row {} columns [{}, {})) lies in the context's cached columns, but "
                       "the context holds no image there (those placeholders were cached without pixels)",
                       s.image, s.row, s.begin, s.end);
        }
      }
    } else {
      own_context =
          InferenceContext::allocate(traits.kv_cache, batch, std::max<int64_t>(fed_columns, 1), model_.device());
      context = own_context.get();
    }
  }

  // Position ids of every column; the rope delta lives here, per request.
  RopePlan plan = model_.plan_positions(tokens.narrow(1, 0, prompt_len), mask.narrow(1, 0, prompt_len), vision);
  const at::Tensor positions = extend_positions(plan, pads, total);  // [B, total] or [3, B, total]

  const at::Device device = model_.device();
  const VisionInputs vision_on_device = vision.empty() ? vision : vision.to(device);
  const ReplayPolicy policy(config.replay_mode(), traits.accepts_partial_image_span);
  const bool use_encoder_cache = config.encoder_cache() && !vision.empty() && model_.can_encode_images();
  std::vector<at::Tensor> embeddings(static_cast<size_t>(vision.num_images()));  // per image, when encoded
  std::vector<int64_t> last_images;
  VisionInputs last_vision;
  at::Tensor last_embeddings;

  SamplingOptions sampling = config.sampling();
  if (!config.allow_placeholder_tokens()) {
    if (traits.image_token_id) sampling.suppressed_tokens.push_back(*traits.image_token_id);
    if (traits.video_token_id) sampling.suppressed_tokens.push_back(*traits.video_token_id);
  }
  Sampler sampler(std::move(sampling), batch);
  // Vocab-parallel logits: each rank holds a block of the vocabulary; tokens are chosen across
  // the tensor-parallel group (see Sampler::choose_vocab_parallel).
  const bool vocab_parallel = traits.vocab_parallel_logits && parallel_.tp_size() > 1;
  GenerationResult result;
  result.sequences.resize(static_cast<size_t>(batch));
  detail::ScoreRecorder scores(config.prompt_logprobs(), config.top_logprobs(), config.return_logits(),
                               traits.vocab_size, vocab_parallel ? parallel_.tp_group().get() : nullptr);
  result.stats.used_kv_cache = kv.use_kv_cache;
  result.stats.prompt_columns = prompt_len;

  // One forward call over columns [start, end); returns the last column's logits [B, vocab].
  // Device copies of tokens, mask and positions, kept in step with the host masters one column
  // at a time, so no step copies the whole prefix (aliases on CPU).
  const bool on_host = device.is_cpu();
  at::Tensor tokens_dev = on_host ? tokens : tokens.to(device);  // [B, total]
  at::Tensor mask_dev = on_host ? mask : mask.to(device);        // [B, total]
  const at::Tensor positions_dev = on_host ? positions : positions.to(device);
  auto run_window = [&](int64_t start, int64_t end, int64_t step) {
    std::vector<int64_t> images = policy.images_for_window({start, end}, spans, step);
    ForwardArgs args;
    at::Tensor window_ids = tokens.narrow(1, start, end - start);
    at::Tensor window_mask = mask.narrow(1, start, end - start);
    args.input_ids = tokens_dev.narrow(1, start, end - start);
    args.position_ids = positions_dev.narrow(-1, start, end - start);
    args.attention_mask = mask_dev.narrow(1, 0, end);
    args.context = context;
    args.window_start = start;
    args.step = step;
    args.last_column_logits = !config.full_logits() && !(step == 0 && scores.wants_prompt_columns());
    if (!images.empty()) {
      if (images != last_images) {
        last_images = images;
        last_vision = vision_on_device.select(images);
        last_embeddings = at::Tensor();
        if (use_encoder_cache) {
          std::vector<int64_t> missing;
          for (int64_t i : images) {
            if (!embeddings[i].defined()) missing.push_back(i);
          }
          if (!missing.empty()) {
            at::Tensor encoded = model_.encode_images(vision_on_device.select(missing));
            int64_t rows = 0;
            for (int64_t i : missing) rows += counts[i];
            VLMGEN_CHECK(encoded.defined() && encoded.dim() == 2 && encoded.size(0) == rows,
                         "encode_images returned {} for {} images needing {} embedding rows",
                         detail::shape_str(encoded), missing.size(), rows);
            int64_t offset = 0;
            for (int64_t i : missing) {
              embeddings[i] = encoded.narrow(0, offset, counts[i]);
              offset += counts[i];
            }
            result.stats.images_encoded += static_cast<int64_t>(missing.size());
          }
          std::vector<at::Tensor> parts;
          for (int64_t i : images) parts.push_back(embeddings[i]);
          last_embeddings = parts.size() == 1 ? parts[0] : at::cat(parts, 0);
        }
      }
      args.images = images;
      args.vision = last_vision;
      args.image_embeddings = last_embeddings;
      // The embeddings are authoritative: the pixels stay behind, so a model cannot use the
      // wrong one and they do not cross to the device again for every call.
      if (last_embeddings.defined()) args.vision.pixel_values = at::Tensor();
    } else {
      args.vision.layout = vision.layout;
    }
    at::Tensor logits = model_.forward(args);
    // Every column of the window, or only the last when that is all the generator asked for.
    auto columns_ok = [&](const at::Tensor& l) {
      return l.size(1) == end - start || (args.last_column_logits && l.size(1) == 1);
    };
    if (vocab_parallel) {
      VLMGEN_CHECK(logits.defined() && logits.dim() == 3 && logits.size(0) == batch && columns_ok(logits) &&
                       logits.size(2) * parallel_.tp_size() >= traits.vocab_size,
                   "the model returned vocab-parallel logits {} for a window of [{}, {}, >= {} / {}]: tensor-parallel "
                   "size {} times the block of {} ids must cover the vocabulary of {}",
                   detail::shape_str(logits), batch, end - start, traits.vocab_size, parallel_.tp_size(),
                   parallel_.tp_size(), logits.dim() == 3 ? logits.size(2) : 0, traits.vocab_size);
    } else {
      VLMGEN_CHECK(logits.defined() && logits.dim() == 3 && logits.size(0) == batch && columns_ok(logits) &&
                       logits.size(2) >= traits.vocab_size,
                   "the model returned logits {} for a window of [{}, {}, >= {}]{}", detail::shape_str(logits), batch,
                   end - start, traits.vocab_size,
                   traits.vocab_parallel_logits
                       ? " (the model's logits are vocab-parallel: give the Generator the model's ParallelContext)"
                       : "");
    }
    if (context != nullptr) {
      context->commit(window_ids, window_mask);
      if (!fingerprints.empty()) {
        for (const ImageSpan& s : spans) {
          if (s.end > start && s.end <= end) {
            context->record_image({s.row, s.begin, s.end, fingerprints[static_cast<size_t>(s.image)]});
          }
        }
      }
    }
    ++result.stats.forward_calls;
    if (step == 0) scores.record_prompt(logits, start, end, prompt_len, tokens, mask, pads, result.sequences);
    at::Tensor last_column = logits.select(1, logits.size(1) - 1);
    return vocab_parallel ? last_column : last_column.narrow(-1, 0, traits.vocab_size);
  };

  std::vector<bool> active(static_cast<size_t>(batch), true);
  auto cancelled = [&] { return request.cancel != nullptr && request.cancel->load(); };
  auto cancel_all = [&] {
    for (int64_t b = 0; b < batch; ++b) {
      if (active[b]) {
        active[b] = false;
        result.sequences[b].finish_reason = FinishReason::kCancelled;
      }
    }
  };
  auto any_active = [&] { return std::find(active.begin(), active.end(), true) != active.end(); };

  // The prompt's columns [cached, end) into the context, in chunks that never split an image;
  // returns the last column's logits, or an undefined tensor when cancelled between chunks.
  auto prefill = [&](int64_t end) {
    const int64_t first = context->length();
    const int64_t chunk = config.prefill_chunk_size() > 0 ? config.prefill_chunk_size() : end - first;
    at::Tensor last;
    int64_t start = first;
    while (start < end && !(start > first && cancelled())) {
      const int64_t chunk_end = policy.chunk_end(start, end - start <= chunk ? end : start + chunk, spans);
      last = run_window(start, chunk_end, 0);
      start = chunk_end;
    }
    return start < end ? at::Tensor() : last;
  };

  if (max_new == 0) {
    for (auto& s : result.sequences) s.finish_reason = FinishReason::kLength;
    // Prefill only: a caller's context gets the prompt, to continue from later, or the prompt
    // is scored.
    const bool wanted = (request.context != nullptr && context != nullptr) || config.prompt_logprobs();
    if (wanted && !cancelled()) {
      const at::Tensor last = context != nullptr ? prefill(prompt_len) : run_window(0, prompt_len, 0);
      if (!last.defined()) cancel_all();
    }
  } else if (cancelled()) {
    cancel_all();
  }

  std::optional<detail::Clock::time_point> t_first;
  std::vector<float> logprobs;
  for (int64_t step = 0; step < max_new && any_active(); ++step) {
    if (cancelled()) {
      cancel_all();
      break;
    }
    const int64_t end = prompt_len + step;  // columns holding tokens so far
    at::Tensor last;
    if (step == 0 && context != nullptr) {
      last = prefill(end);
      if (!last.defined()) {  // cancelled between chunks
        cancel_all();
        break;
      }
    } else {
      last = run_window(context != nullptr ? context->length() : 0, end, step);
    }

    std::vector<float>* want_logprobs = config.return_logprobs() ? &logprobs : nullptr;
    std::vector<int64_t> chosen =
        vocab_parallel ? sampler.choose_vocab_parallel(
                             last, {parallel_.tp_rank() * last.size(1), traits.vocab_size, parallel_.tp_group().get()},
                             active, want_logprobs)
                       : sampler.choose(last, active, want_logprobs);
    if (!t_first) t_first = detail::Clock::now();
    scores.record_step(last, active, result.sequences);
    for (int64_t b = 0; b < batch; ++b) {
      if (!active[b]) continue;
      const int64_t token = chosen[b];
      auto& seq = result.sequences[b];
      tokens[b][end] = token;
      seq.tokens.push_back(token);
      if (config.return_logprobs()) seq.logprobs.push_back(logprobs[b]);
      ++result.stats.generated_tokens;
      if (detail::contains(config.end_token_ids(), token)) {
        seq.finish_reason = FinishReason::kEndId;
      } else if (detail::contains(config.stop_token_ids(), token)) {
        seq.finish_reason = FinishReason::kStopWords;
      } else if (static_cast<int64_t>(seq.tokens.size()) == max_new) {
        seq.finish_reason = FinishReason::kLength;
      }
      if (request.on_token) {
        TokenEvent event{b, step, token, config.return_logprobs() ? logprobs[b] : 0.0f, seq.finish_reason};
        if (!request.on_token(event) && seq.finish_reason == FinishReason::kNotFinished) {
          seq.finish_reason = FinishReason::kCancelled;
        }
      }
      if (seq.finish_reason != FinishReason::kNotFinished) {
        active[b] = false;
        // The filler fed after a row's last token is padding: mask it.
        if (end + 1 < total) {
          mask[b].narrow(0, end + 1, total - end - 1).zero_();
          if (!on_host) mask_dev[b].narrow(0, end + 1, total - end - 1).zero_();
        }
      }
    }
    if (!on_host) tokens_dev.select(1, end).copy_(tokens.select(1, end));
  }

  scores.finish(result.sequences);
  const auto t_end = detail::Clock::now();
  result.stats.total_s = detail::seconds_between(t_start, t_end);
  if (t_first) {
    result.stats.time_to_first_token_s = detail::seconds_between(t_start, *t_first);
    int64_t rows_started = 0;
    for (const auto& s : result.sequences) rows_started += !s.tokens.empty();
    const double decode_s = detail::seconds_between(*t_first, t_end);
    const int64_t decode_tokens = result.stats.generated_tokens - rows_started;
    result.stats.decode_tokens_per_s = decode_s > 0 && decode_tokens > 0 ? decode_tokens / decode_s : 0.0;
  }
  return result;
}

}  // namespace vlmgen
