#pragma once

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

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
#include "vlmgen/request.h"
#include "vlmgen/sampling.h"
#include "vlmgen/step/continuation.h"
#include "vlmgen/step/logits_check.h"
#include "vlmgen/step/rank_agreement.h"
#include "vlmgen/step/request_validation.h"
#include "vlmgen/step/scores.h"
#include "vlmgen/step/stop_rules.h"
#include "vlmgen/step/window_vision.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen {

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

}  // namespace detail

inline GenerationResult Generator::generate(const GenerateRequest& request, const GenerationConfig& config) {
  InferenceContext* context = request.context;
  const int64_t entry_length = context != nullptr ? context->length() : 0;
  if (parallel_.tp_size() > 1 && parallel_.tp_group()) {
    // First, before anything a rank could refuse on its own: all ranks raise together.
    detail::check_ranks_agree(*parallel_.tp_group(), detail::request_digest(request, config), model_.device(),
                              "requests");
  }
  // No autograd anywhere in generation: no graph is recorded and tensors skip version counting.
  c10::InferenceMode inference_mode;
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
  const detail::RequestLayout layout = detail::lay_out_request(request, config, model_);
  const int64_t batch = layout.batch, prompt_len = layout.prompt_len, max_new = layout.max_new, total = layout.total;
  const std::vector<int64_t>& pads = layout.pads;
  const std::vector<ImageSpan>& spans = layout.spans;
  const VisionInputs& vision = request.vision;

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

  // The KV cache: the caller's (checked to fit and to hold this request's beginning) or the
  // call's own.
  std::unique_ptr<InferenceContext> own_context;
  InferenceContext* context = nullptr;
  // Fingerprints of the request's images, to record in (and check against) a caller's context.
  const std::vector<ContentHash> fingerprints =
      request.context != nullptr && kv.use_kv_cache ? vision.fingerprints() : std::vector<ContentHash>{};
  if (kv.use_kv_cache && request.context != nullptr) {
    context = request.context;
    detail::check_context_fits(*context, batch, layout.fed_columns, prompt_len, max_new, traits, model_.device());
    detail::check_continuation(*context, tokens, mask, prompt_len, spans, fingerprints);
  } else if (kv.use_kv_cache) {
    own_context =
        InferenceContext::allocate(traits.kv_cache, batch, std::max<int64_t>(layout.fed_columns, 1), model_.device());
    context = own_context.get();
  }

  // Position ids of every column; the rope delta lives here, per request.
  RopePlan plan = model_.plan_positions(tokens.narrow(1, 0, prompt_len), mask.narrow(1, 0, prompt_len), vision);
  const at::Tensor positions = extend_positions(plan, pads, total);  // [B, total] or [3, B, total]

  const at::Device device = model_.device();
  const VisionInputs vision_on_device = vision.empty() ? vision : vision.to(device);
  const ReplayPolicy policy(config.replay_mode(), traits.accepts_partial_image_span);
  detail::WindowVision window_vision(model_, vision_on_device, layout.counts,
                                     config.encoder_cache() && !vision.empty() && model_.can_encode_images());

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
    window_vision.fill(images, args);
    at::Tensor logits = model_.forward(args);
    // Every column of the window, or only the last when that is all the generator asked for.
    detail::check_window_logits(logits, batch, end - start, args.last_column_logits, traits, vocab_parallel,
                                parallel_.tp_size());
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
      seq.finish_reason = detail::finish_reason_after(token, static_cast<int64_t>(seq.tokens.size()), config);
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

  result.stats.images_encoded = window_vision.images_encoded();
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
