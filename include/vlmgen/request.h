#pragma once

// What one generation call takes and gives: its options (GenerationConfig), the request
// (prompts, images, context, streaming callback), and the result. Shared by the synchronous
// Generator and the pieces of its step loop (include/vlmgen/step/).

#include <atomic>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "vlmgen/inference_context.h"
#include "vlmgen/replay_policy.h"
#include "vlmgen/sampling.h"
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
  /// The top_logprobs() most likely tokens at this step and their log-probabilities, most likely
  /// first (empty unless GenerationConfig::top_logprobs > 0).
  std::vector<std::pair<int64_t, float>> top_logprobs;
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

}  // namespace vlmgen
