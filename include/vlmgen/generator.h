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
#include "vlmgen/step/request_stepper.h"
#include "vlmgen/step/request_validation.h"
#include "vlmgen/step/scores.h"
#include "vlmgen/step/sequence_state.h"
#include "vlmgen/step/stop_rules.h"
#include "vlmgen/step/window_runner.h"
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
  // KV cache or full-prefix recompute for this request (logs a fallback once per Generator).
  KvCacheDecision decide_cache(const GenerateRequest& request, const GenerationConfig& config,
                               const detail::RequestLayout& layout);

  CausalVlm& model_;
  ParallelContext parallel_;
  bool fallback_logged_ = false;
};

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

inline KvCacheDecision Generator::decide_cache(const GenerateRequest& request, const GenerationConfig& config,
                                               const detail::RequestLayout& layout) {
  const ModelTraits& traits = model_.traits();
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
  detail::check_replay_with_cache(kv.use_kv_cache, config.replay_mode(), layout);
  return kv;
}

inline GenerationResult Generator::generate_unguarded(const GenerateRequest& request, const GenerationConfig& config) {
  detail::RequestStepper stepper(model_, parallel_, request, config, [&](const detail::RequestLayout& layout) {
    return decide_cache(request, config, layout);
  });
  while (stepper.step()) {
  }
  return stepper.finish();
}

}  // namespace vlmgen
