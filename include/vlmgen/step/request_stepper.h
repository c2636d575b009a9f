#pragma once

// One request's way through the step loop, a step at a time: set up (validation, layout, KV
// cache, positions, images), then one forward call and one sampled token per row per step(),
// then the result. The synchronous Generator runs a stepper to the end; an engine can run
// several, interleaved.
//
//   detail::RequestStepper stepper(model, parallel, request, config, kv);
//   while (stepper.step()) {}
//   GenerationResult result = stepper.finish();

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "vlmgen/content_hash.h"
#include "vlmgen/engine/encoder_cache.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/model.h"
#include "vlmgen/parallel.h"
#include "vlmgen/positions.h"
#include "vlmgen/request.h"
#include "vlmgen/sampling.h"
#include "vlmgen/step/continuation.h"
#include "vlmgen/step/request_validation.h"
#include "vlmgen/step/scores.h"
#include "vlmgen/step/sequence_state.h"
#include "vlmgen/step/window_runner.h"
#include "vlmgen/step/window_vision.h"

namespace vlmgen::detail {

using Clock = std::chrono::steady_clock;

inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

/// Wall-clock figures of a finished call: total, time to the first token, and decode speed
/// (tokens after each row's first, per second after the first token).
inline void finish_stats(GenerationResult& result, Clock::time_point start,
                         const std::optional<Clock::time_point>& first_token) {
  const auto end = Clock::now();
  result.stats.total_s = seconds_between(start, end);
  if (!first_token) return;
  result.stats.time_to_first_token_s = seconds_between(start, *first_token);
  int64_t rows_started = 0;
  for (const auto& s : result.sequences) rows_started += !s.tokens.empty();
  const double decode_s = seconds_between(*first_token, end);
  const int64_t decode_tokens = result.stats.generated_tokens - rows_started;
  result.stats.decode_tokens_per_s = decode_s > 0 && decode_tokens > 0 ? decode_tokens / decode_s : 0.0;
}

class RequestStepper {
 public:
  /// Validates and sets up the request (vlmgen::Error before any forward call on bad input).
  /// `decide_kv` makes the caller's KV-cache decision once the request is laid out. Images are
  /// looked for in `shared_encoder_cache` (when given, with the encoder cache on) before they are
  /// encoded. With `record_images`, the images' fingerprints are recorded in the stepper's own
  /// KV cache too (as they always are in a caller's), so its columns can seed a continuation.
  /// `model`, `parallel` and the cache must outlive the stepper; the request and config are
  /// copied.
  template <typename DecideKv>
  RequestStepper(CausalVlm& model, const ParallelContext& parallel, GenerateRequest request, GenerationConfig config,
                 DecideKv&& decide_kv, EncoderCache* shared_encoder_cache = nullptr, bool record_images = false)
      : model_(model), parallel_(parallel), request_(std::move(request)), config_(std::move(config)) {
    const ModelTraits& traits = model.traits();
    const at::Device device = model.device();
    validate_request(request_, config_, traits);
    layout_ = lay_out_request(request_, config_, model);
    const KvCacheDecision kv = decide_kv(static_cast<const RequestLayout&>(layout_));
    rows_ = std::make_unique<SequenceState>(request_, config_, layout_, device);

    // The KV cache: the caller's (checked to fit and to hold this request's beginning, images
    // included, by fingerprint) or the stepper's own.
    const VisionInputs& vision = request_.vision;
    if ((request_.context != nullptr || record_images) && kv.use_kv_cache) fingerprints_ = vision.fingerprints();
    if (kv.use_kv_cache && request_.context != nullptr) {
      context_ = request_.context;
      check_context_fits(*context_, layout_.batch, layout_.fed_columns, layout_.prompt_len, layout_.max_new, traits,
                         device);
      check_continuation(*context_, rows_->tokens(), rows_->mask(), layout_.prompt_len, layout_.spans, fingerprints_);
    } else if (kv.use_kv_cache) {
      own_context_ =
          InferenceContext::allocate(traits.kv_cache, layout_.batch, std::max<int64_t>(layout_.fed_columns, 1), device);
      context_ = own_context_.get();
    }

    // Position ids of every column; the rope delta lives here, per request.
    const RopePlan plan =
        model.plan_positions_with_spans(rows_->tokens().narrow(1, 0, layout_.prompt_len),
                                        rows_->mask().narrow(1, 0, layout_.prompt_len), vision, layout_.spans);
    positions_ = extend_positions(plan, layout_.pads, layout_.total);  // [B, total] or [3, B, total]
    if (!device.is_cpu()) positions_ = positions_.to(device);
    window_vision_ = std::make_unique<WindowVision>(
        model, vision.empty() ? vision : vision.to(device), layout_.counts,
        config_.encoder_cache() && !vision.empty() && model.can_encode_images(), shared_encoder_cache);
    result_.sequences.resize(static_cast<size_t>(layout_.batch));
    result_.stats.used_kv_cache = kv.use_kv_cache;
    result_.stats.prompt_columns = layout_.prompt_len;
    vocab_parallel_ = traits.vocab_parallel_logits && parallel.tp_size() > 1;
    scores_ =
        std::make_unique<ScoreRecorder>(config_.prompt_logprobs(), config_.top_logprobs(), config_.return_logits(),
                                        traits.vocab_size, vocab_parallel_ ? parallel.tp_group().get() : nullptr);
    windows_ = std::make_unique<WindowRunner>(model, parallel_, config_, layout_, *rows_, positions_, *window_vision_,
                                              context_, fingerprints_, *scores_, result_);
    SamplingOptions sampling = config_.sampling();
    if (!config_.allow_placeholder_tokens()) {
      if (traits.image_token_id) sampling.suppressed_tokens.push_back(*traits.image_token_id);
      if (traits.video_token_id) sampling.suppressed_tokens.push_back(*traits.video_token_id);
    }
    sampler_ = std::make_unique<Sampler>(std::move(sampling), layout_.batch);
  }
  RequestStepper(const RequestStepper&) = delete;
  RequestStepper& operator=(const RequestStepper&) = delete;

  /// The next forward call and token of every generating row. False once the request is done
  /// (every row finished, max_new_tokens reached, or cancelled); then call finish().
  bool step() {
    if (!more_to_do()) return false;
    const int64_t end = layout_.prompt_len + step_;  // columns holding tokens so far
    if (step_ == 0 && context_ != nullptr) {
      const at::Tensor last = windows_->prefill(end, request_.cancel, prefill_columns_per_step_);
      if (last.defined()) return take_token(last);
      if (cancelled()) {  // between prefill chunks
        done_ = true;
        return false;
      }
      return true;  // the prompt goes on at the next step
    }
    return take_token(windows_->run(context_ != nullptr ? context_->length() : 0, end, step_));
  }

  /// When the next step is one decode window over the KV cache, its forward call, which an
  /// engine may batch with other requests' (CausalVlm::forward_batch); then step_with(call,
  /// its logits) completes the step. Otherwise (prefill, a recompute without a KV cache, or
  /// the request is done) nullopt: call step().
  std::optional<ForwardArgs> decode_call() {
    if (context_ == nullptr || step_ == 0 || !more_to_do()) return std::nullopt;
    return windows_->args_for(context_->length(), layout_.prompt_len + step_, step_);
  }
  /// The rest of a step whose forward call (from decode_call) returned `logits`; as step().
  bool step_with(const ForwardArgs& call, const at::Tensor& logits) {
    return take_token(windows_->accept(call, logits));
  }

  /// The result, once step() returned false. Rows a cancellation stopped end with kCancelled.
  GenerationResult finish() {
    if (layout_.max_new > 0 && cancelled()) rows_->cancel_all(result_.sequences);  // rows still generating
    result_.stats.images_encoded = window_vision_->images_encoded();
    scores_->finish(result_.sequences);
    finish_stats(result_, t_start_, t_first_);
    return std::move(result_);
  }

  /// Ends these rows (those still generating) with kCancelled before the next step, as their
  /// streaming callback returning false would have: an engine under tensor parallelism applies
  /// the answers of rank 0's callbacks on every rank at a step boundary.
  void cancel_rows(const std::vector<int64_t>& rows) {
    for (int64_t row : rows) rows_->cancel_row(row, result_.sequences);
  }

  /// Prompt columns computed per step() at most (0, the default: the whole prompt in the first
  /// step). A chunk never ends inside an image (WindowRunner::prefill).
  void set_prefill_columns_per_step(int64_t columns) { prefill_columns_per_step_ = std::max<int64_t>(columns, 0); }
  /// Whether the prompt's columns are all in the KV cache (false without one).
  bool prompt_cached() const { return context_ != nullptr && context_->length() >= layout_.prompt_len; }

  const RequestLayout& layout() const { return layout_; }
  /// The KV cache the request uses (the caller's or its own), or null without one.
  InferenceContext* context() const { return context_; }

 private:
  bool cancelled() const { return request_.cancel != nullptr && request_.cancel->load(); }

  // False (and done) once nothing is left to compute; a prompt-only request computes here.
  bool more_to_do() {
    if (done_) return false;
    if (layout_.max_new == 0) {
      prefill_only();
      done_ = true;
      return false;
    }
    if (step_ >= layout_.max_new || !rows_->any_active() || cancelled()) {
      done_ = true;
      return false;
    }
    return true;
  }

  // Chooses every active row's token from the last column's logits and moves to the next step.
  bool take_token(const at::Tensor& last) {
    const int64_t end = layout_.prompt_len + step_;
    const ModelTraits& traits = model_.traits();
    std::vector<float>* want_logprobs = config_.return_logprobs() ? &logprobs_ : nullptr;
    const std::vector<int64_t> chosen =
        vocab_parallel_ ? sampler_->choose_vocab_parallel(
                              last, {parallel_.tp_rank() * last.size(1), traits.vocab_size, parallel_.tp_group().get()},
                              rows_->active(), want_logprobs)
                        : sampler_->choose(last, rows_->active(), want_logprobs);
    if (!t_first_) t_first_ = Clock::now();
    scores_->record_step(last, rows_->active(), result_.sequences);
    result_.stats.generated_tokens +=
        rows_->accept(step_, end, chosen, logprobs_, request_.on_token, result_.sequences);
    ++step_;
    done_ = step_ >= layout_.max_new || !rows_->any_active();
    return !done_;
  }

  // max_new_tokens(0): a caller's context gets the prompt, to continue from later, or the
  // prompt is scored.
  void prefill_only() {
    for (auto& s : result_.sequences) s.finish_reason = FinishReason::kLength;
    const bool wanted = (request_.context != nullptr && context_ != nullptr) || config_.prompt_logprobs();
    if (!wanted || cancelled()) return;
    const at::Tensor last = context_ != nullptr ? windows_->prefill(layout_.prompt_len, request_.cancel)
                                                : windows_->run(0, layout_.prompt_len, 0);
    if (!last.defined()) rows_->cancel_all(result_.sequences);
  }

  const Clock::time_point t_start_ = Clock::now();
  CausalVlm& model_;
  const ParallelContext& parallel_;
  const GenerateRequest request_;
  const GenerationConfig config_;
  RequestLayout layout_;
  std::unique_ptr<SequenceState> rows_;
  std::unique_ptr<InferenceContext> own_context_;
  InferenceContext* context_ = nullptr;
  std::vector<ContentHash> fingerprints_;
  at::Tensor positions_;
  std::unique_ptr<WindowVision> window_vision_;
  GenerationResult result_;
  bool vocab_parallel_ = false;
  std::unique_ptr<ScoreRecorder> scores_;
  std::unique_ptr<WindowRunner> windows_;
  std::unique_ptr<Sampler> sampler_;
  int64_t step_ = 0;
  int64_t prefill_columns_per_step_ = 0;
  bool done_ = false;
  std::optional<Clock::time_point> t_first_;
  std::vector<float> logprobs_;
};

}  // namespace vlmgen::detail
