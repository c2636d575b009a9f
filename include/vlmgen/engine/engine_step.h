#pragma once

// The bodies of how vlmgen::Engine steps its running requests (engine.h declares the class and
// includes this at its end): a plan's step, starting a request (with a prefix-cache lookup),
// the decoding requests' fused forward_batch, and ending a request with its result or error.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <iterator>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "vlmgen/engine/engine.h"
#include "vlmgen/engine/prefix_cache.h"
#include "vlmgen/engine/step_plan.h"
#include "vlmgen/error.h"
#include "vlmgen/step/rank_agreement.h"
#include "vlmgen/step/request_stepper.h"

namespace vlmgen {

// Applies a plan's cancellations and callback answers, starts its requests, and steps every
// running request.
inline void Engine::run_step(std::list<Running>& running, const detail::StepPlan& plan, std::vector<Waiting> admitted) {
  const auto named = [](const std::vector<uint64_t>& ids, uint64_t id) {
    return std::find(ids.begin(), ids.end(), id) != ids.end();
  };
  const bool work = !running.empty() || !admitted.empty();  // alike on every rank (the plan's state)
  failed_in_step_.clear();
  for (auto it = running.begin(); it != running.end();) {
    if (named(plan.failed, it->id)) {
      const std::exception_ptr error =
          it->answers != nullptr && it->answers->error
              ? it->answers->error
              : std::make_exception_ptr(Error(fmt::format("request {} ended: its streaming callback on rank 0 threw",
                                                          static_cast<int64_t>(it->id))));
      it = fail(running, it, error);
      continue;
    }
    if (named(plan.cancelled, it->id)) it->cancel->store(true);
    std::vector<int64_t> rows;
    for (const detail::RowCancel& c : plan.cancelled_rows) {
      if (c.id == it->id) rows.push_back(c.row);
    }
    try {
      if (!rows.empty()) it->stepper->cancel_rows(rows);
    } catch (...) {
      it = fail(running, it, std::current_exception());
      continue;
    }
    ++it;
  }
  std::vector<uint64_t> not_started;
  for (Waiting& w : admitted) {
    const uint64_t id = w.id;
    if (!start(std::move(w), running)) {
      not_started.push_back(id);
      failed_in_step_.push_back(id);  // where it started, agree_on_starts ends it with fail()
    }
  }
  if (has_followers() && !admitted.empty()) agree_on_starts(running, not_started, admitted.size());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    metrics_.running = static_cast<int64_t>(running.size());
    metrics_.max_running_seen = std::max(metrics_.max_running_seen, metrics_.running);
    if (!running.empty()) ++metrics_.steps;
  }
  if (!running.empty()) {
    const auto t = detail::Clock::now();
    step_all(running);
    std::lock_guard<std::mutex> lock(mutex_);
    metrics_.busy_s += detail::seconds_between(t, detail::Clock::now());
  }
  if (has_followers() && work) {
    // A request that failed on some ranks only (memory, a device error) has split the ranks'
    // collectives: this is found after the step, and no later step can be trusted.
    std::sort(failed_in_step_.begin(), failed_in_step_.end());
    Sha256 sha;
    for (uint64_t id : failed_in_step_) sha.update_int(static_cast<int64_t>(id));
    detail::check_ranks_agree(*parallel_.tp_group(), sha.finish(), at::kCPU, "sets of requests failing in one step",
                              "a request failed on some ranks only (memory, a device error), so their collectives "
                              "no longer pair up; the engine stops");
  }
}

// Under tensor parallelism, after the plan's requests started: one that failed to start on
// any rank (its KV cache did not fit there, say) ends on every rank before any of them makes
// a forward call. `not_started` lists the plan's requests that failed here, of `admitted`.
inline void Engine::agree_on_starts(std::list<Running>& running, const std::vector<uint64_t>& not_started,
                                    size_t admitted) {
  // Ids + 1 (0: no entry), below 2^40: exact in float64 on any backend.
  at::Tensor mine = at::zeros({1, static_cast<int64_t>(admitted)}, at::kDouble);
  for (size_t i = 0; i < not_started.size(); ++i) {
    mine[0][static_cast<int64_t>(i)] = static_cast<double>(not_started[i] % (uint64_t{1} << 40) + 1);
  }
  const at::Tensor all = parallel_.tp_group()->all_gather(mine, 0).to(at::kCPU).contiguous();
  std::vector<uint64_t> anywhere;
  const double* ids = all.data_ptr<double>();
  for (int64_t i = 0; i < all.numel(); ++i) {
    if (ids[i] > 0) anywhere.push_back(static_cast<uint64_t>(ids[i]) - 1);
  }
  if (anywhere.empty()) return;
  for (auto it = running.begin(); it != running.end();) {
    if (std::find(anywhere.begin(), anywhere.end(), it->id % (uint64_t{1} << 40)) == anywhere.end()) {
      ++it;
      continue;
    }
    it = fail(running, it,
              std::make_exception_ptr(Error(fmt::format(
                  "request {} could not start on every tensor-parallel rank (another rank refused it, e.g. its KV "
                  "cache did not fit there); it ended on every rank",
                  static_cast<int64_t>(it->id)))));
  }
}

// One step of every running request. Those decoding over their KV cache make their calls
// together in one forward_batch (the model reads its weights once for all of them); a
// prefill chunk, or a recompute without a KV cache, runs on its own. When the batched call
// throws, its calls run again one by one, and a request whose own call throws ends with the
// error while the others go on.
inline void Engine::step_all(std::list<Running>& running) {
  std::vector<std::list<Running>::iterator> batch;
  std::vector<ForwardArgs> calls;
  for (auto it = running.begin(); it != running.end();) {
    std::optional<ForwardArgs> call;
    try {
      call = it->stepper->decode_call();
    } catch (...) {
      it = fail(running, it, std::current_exception());
      continue;
    }
    if (!call) {
      it = step(running, it, [&] { return it->stepper->step(); });
      continue;
    }
    batch.push_back(it++);
    calls.push_back(std::move(*call));
  }
  if (batch.empty()) return;
  std::vector<const ForwardArgs*> pointers;
  for (const ForwardArgs& c : calls) pointers.push_back(&c);
  std::vector<at::Tensor> logits;
  try {
    logits = model_.forward_batch(pointers);
    VLMGEN_CHECK(logits.size() == calls.size(), "forward_batch returned {} logits for {} calls", logits.size(),
                 calls.size());
  } catch (...) {
    if (batch.size() == 1) {
      fail(running, batch[0], std::current_exception());
      return;
    }
    // Under tensor parallelism a fused pass that failed on some ranks only has split their
    // collectives even when the calls then succeed one by one: the step's check sees this.
    if (has_followers()) failed_in_step_.push_back(kFusedPassFailed);
    // A call failed the batch: the calls run one by one instead (nothing was committed), so
    // only the requests whose own call fails end with the error.
    for (size_t i = 0; i < batch.size(); ++i) {
      auto it = batch[i];
      step(running, it, [&] { return it->stepper->step_with(calls[i], model_.forward(calls[i])); });
    }
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++metrics_.decode_batches;
    metrics_.max_decode_batch = std::max(metrics_.max_decode_batch, static_cast<int64_t>(batch.size()));
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    auto it = batch[i];
    step(running, it, [&] { return it->stepper->step_with(calls[i], logits[i]); });
  }
}

// Builds a request's stepper (outside the lock: validation and allocation take time). A
// request that fails to start ends with its error (false).
inline bool Engine::start(Waiting w, std::list<Running>& running) {
  const bool want_kv = w.config.enable_kv_cache();
  const ReplayMode replay = w.config.replay_mode();
  const ModelTraits& traits = model_.traits();
  try {
    Running r;
    r.id = w.id;
    r.cancel = std::make_unique<std::atomic<bool>>(false);
    r.handle = w.handle;
    r.kv_blocks = w.kv_blocks;
    w.request.cancel = r.cancel.get();
    if (has_followers() && w.request.on_token) {
      // The other ranks have no callback: its answers reach them with the next plan, and
      // here take effect at the same step boundary.
      r.answers = std::make_shared<CallbackAnswers>();
      w.request.on_token = [user = std::move(w.request.on_token), answers = r.answers](const TokenEvent& event) {
        if (answers->error) return true;
        try {
          if (!user(event)) answers->cancelled_rows.push_back(event.row);
        } catch (...) {
          answers->error = std::current_exception();
        }
        return true;
      };
    }
    if (options_.prefix_cache_bytes() > 0 && want_kv && traits.supports_kv_cache && w.request.prompts.size() == 1) {
      seed_from_prefix_cache(w, r);
    }
    // The stepper's clock starts now: the time before it (queue, prefix lookup) is added to
    // its time to first token.
    r.queued_s = detail::seconds_between(w.submitted, detail::Clock::now());
    r.stepper = std::make_unique<detail::RequestStepper>(
        model_, parallel_, std::move(w.request), std::move(w.config),
        [&](const detail::RequestLayout& layout) {
          const KvCacheDecision kv =
              decide_kv_cache(want_kv, traits.supports_kv_cache, traits.kv_cache_under_sequence_parallel, parallel_);
          detail::check_replay_with_cache(kv.use_kv_cache, replay, layout);
          return kv;
        },
        options_.encoder_cache_bytes() > 0 ? &encoder_cache_ : nullptr, /*record_images=*/!r.prefix_keys.empty());
    r.stepper->set_prefill_columns_per_step(options_.prefill_columns_per_step());
    running.push_back(std::move(r));
    return true;
  } catch (...) {
    end(w.kv_blocks, /*failed=*/true, 0);
    w.handle->promise_.set_exception(std::current_exception());
    return false;
  }
}

// Looks the prompt up in the prefix cache: on a hit the request continues from a copy of the
// cached columns (check_continuation then verifies tokens and pictures, as for any caller's
// context). Remembers the prompt's block keys, to cache its prefill. A request that asks for
// prompt_logprobs computes its whole prompt (a hit's columns would have no scores).
inline void Engine::seed_from_prefix_cache(Waiting& w, Running& r) {
  detail::validate_request(w.request, w.config, model_.traits());
  const detail::RequestLayout layout = detail::lay_out_request(w.request, w.config, model_);
  const std::vector<ContentHash> fingerprints = w.request.vision.fingerprints();
  r.prefix_keys = prefix_cache_.block_keys(w.request.prompts[0], layout.spans, fingerprints);
  // Scores for every prompt token need the prefill of every column: such a request caches its
  // prompt for others but starts from none.
  if (w.config.prompt_logprobs()) return;
  const PrefixCache::Hit hit = prefix_cache_.lookup(r.prefix_keys, layout.spans, layout.prompt_len);
  if (hit.columns == 0) return;
  r.context = hit.context->copy_prefix(hit.columns, std::max<int64_t>(layout.fed_columns, 1));
  w.request.context = r.context.get();
}

// One step of a running request (`advance`: the stepper's step, true while more is left);
// ends the request (result or error) when it is done. The metrics count a request as ended
// before its handle is fulfilled.
template <typename Advance>
std::list<Engine::Running>::iterator Engine::step(std::list<Running>& running, std::list<Running>::iterator it,
                                                  Advance&& advance) {
  std::shared_ptr<RequestHandle> handle = it->handle;
  GenerationResult result;
  try {
    const bool more = advance();
    if (!it->prefix_keys.empty() && it->stepper->prompt_cached()) {
      prefix_cache_.insert(it->prefix_keys, *it->stepper->context());
      it->prefix_keys.clear();
    }
    if (more) return std::next(it);
    result = it->stepper->finish();
  } catch (...) {  // this request's error; the others go on
    return fail(running, it, std::current_exception());
  }
  const int64_t tokens = result.stats.generated_tokens;
  if (it->answers != nullptr && it->answers->error) {
    // The streaming callback threw during the request's last step: it ends with that error,
    // as with Generator (the other ranks count it finished; the same tokens either way).
    const std::exception_ptr error = it->answers->error;
    const auto next = retire(running, it, /*failed=*/true, tokens);
    handle->promise_.set_exception(error);
    return next;
  }
  if (tokens > 0) {  // from submit: the wait for admission counts
    std::lock_guard<std::mutex> lock(mutex_);
    metrics_.time_to_first_token_s_sum += it->queued_s + result.stats.time_to_first_token_s;
    ++metrics_.first_tokens;
  }
  const auto next = retire(running, it, /*failed=*/false, tokens);
  handle->promise_.set_value(std::move(result));
  return next;
}

inline std::list<Engine::Running>::iterator Engine::fail(std::list<Running>& running, std::list<Running>::iterator it,
                                                         const std::exception_ptr& error) {
  failed_in_step_.push_back(it->id);
  std::shared_ptr<RequestHandle> handle = it->handle;
  const auto next = retire(running, it, /*failed=*/true, 0);
  handle->promise_.set_exception(error);
  return next;
}

inline std::list<Engine::Running>::iterator Engine::retire(std::list<Running>& running, std::list<Running>::iterator it,
                                                           bool failed, int64_t tokens) {
  end(it->kv_blocks, failed, tokens);
  auto next = running.erase(it);  // frees the request's KV cache
  std::lock_guard<std::mutex> lock(mutex_);
  metrics_.running = static_cast<int64_t>(running.size());
  return next;
}

inline void Engine::end(int64_t kv_blocks, bool failed, int64_t tokens) {
  std::lock_guard<std::mutex> lock(mutex_);
  metrics_.kv_blocks_used -= kv_blocks;
  metrics_.kv_bytes_used = metrics_.kv_blocks_used * block_bytes();
  ++(failed ? metrics_.failed : metrics_.finished);
  metrics_.generated_tokens += tokens;
}

}  // namespace vlmgen
