#pragma once

// vlmgen::Engine: requests submitted from any thread, served by one step loop that admits them
// while others decode. Each step, every running request makes its next forward call and takes
// its next token (RequestStepper, the same pieces the synchronous Generator runs), so a request
// gets the span rule, the encoder cache, sampling and stop rules exactly as with Generator and
// the same tokens. Image embeddings (EncoderCache) and KV-cache prefixes (PrefixCache) are shared
// across requests, keyed by token ids and image content hashes. Admission is bounded by
// a KV-cache byte budget: a request waits until its KV cache fits, and one that can never fit is refused at submit.
//
//   vlmgen::Engine engine(model, vlmgen::EngineOptions().max_running(8).kv_cache_bytes(1 << 30));
//   auto handle = engine.submit({{prompt}, vision}, vlmgen::GenerationConfig().max_new_tokens(64));
//   vlmgen::GenerationResult result = handle->wait();   // or handle->cancel()
//
// Each step, the requests that are decoding over their KV cache make their forward calls
// together (CausalVlm::forward_batch: each call keeps its own window, cache, mask and positions;
// a model that fuses them reads its weights once per step for all); a request's prefill or a
// no-cache recompute (which carries its images) is a call of its own.

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <future>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "vlmgen/engine/encoder_cache.h"
#include "vlmgen/engine/prefix_cache.h"
#include "vlmgen/error.h"
#include "vlmgen/model.h"
#include "vlmgen/parallel.h"
#include "vlmgen/request.h"
#include "vlmgen/step/request_stepper.h"

namespace vlmgen {

/// Options of an Engine.
class EngineOptions {
 public:
  /// Requests stepping at once (>= 1). Default 16.
  EngineOptions& max_running(int64_t value) {
    max_running_ = value;
    return *this;
  }
  int64_t max_running() const { return max_running_; }
  /// KV-cache bytes all running requests may hold together (> 0), in blocks of
  /// kv_block_columns columns. Default 1 GiB.
  EngineOptions& kv_cache_bytes(int64_t value) {
    kv_cache_bytes_ = value;
    return *this;
  }
  int64_t kv_cache_bytes() const { return kv_cache_bytes_; }
  /// Bytes of image embeddings kept across requests (EncoderCache; 0 = none). Default 256 MiB.
  EngineOptions& encoder_cache_bytes(int64_t value) {
    encoder_cache_bytes_ = value;
    return *this;
  }
  int64_t encoder_cache_bytes() const { return encoder_cache_bytes_; }
  /// Bytes of KV-cache prefixes kept across requests (PrefixCache; 0 = none). Default 256 MiB.
  EngineOptions& prefix_cache_bytes(int64_t value) {
    prefix_cache_bytes_ = value;
    return *this;
  }
  int64_t prefix_cache_bytes() const { return prefix_cache_bytes_; }
  /// Columns per prefix-cache block (>= 1): prefixes are found in whole blocks. Default 16.
  EngineOptions& prefix_block_columns(int64_t value) {
    prefix_block_columns_ = value;
    return *this;
  }
  int64_t prefix_block_columns() const { return prefix_block_columns_; }
  /// Columns per KV block (>= 1): a request holds, per row, the blocks its prompt and new
  /// tokens fill, and the budget is counted in blocks. Default 16.
  EngineOptions& kv_block_columns(int64_t value) {
    kv_block_columns_ = value;
    return *this;
  }
  int64_t kv_block_columns() const { return kv_block_columns_; }
  /// Prompt columns a request computes per step at most (0 = its whole prompt in one step), so a
  /// long prompt does not stall the requests that are decoding. A chunk never ends inside an
  /// image: it ends before the image, or, for an image longer than the budget, takes all of it.
  /// Default 512.
  EngineOptions& prefill_columns_per_step(int64_t value) {
    prefill_columns_per_step_ = value;
    return *this;
  }
  int64_t prefill_columns_per_step() const { return prefill_columns_per_step_; }

 private:
  int64_t max_running_ = 16;
  int64_t kv_cache_bytes_ = int64_t{1} << 30;
  int64_t encoder_cache_bytes_ = int64_t{256} << 20;
  int64_t prefix_cache_bytes_ = int64_t{256} << 20;
  int64_t prefix_block_columns_ = 16;
  int64_t kv_block_columns_ = 16;
  int64_t prefill_columns_per_step_ = 512;
};

/// What the engine is doing, read at any time from any thread.
struct EngineMetrics {
  int64_t running = 0;               ///< requests stepping
  int64_t waiting = 0;               ///< submitted, not yet admitted
  int64_t finished = 0;              ///< completed with a result (cancelled ones included)
  int64_t failed = 0;                ///< completed with an error
  int64_t kv_bytes_used = 0;         ///< KV cache held by running requests (their blocks)
  int64_t kv_bytes_budget = 0;       ///< EngineOptions::kv_cache_bytes
  int64_t kv_blocks_used = 0;        ///< KV blocks held by running requests
  int64_t kv_blocks_total = 0;       ///< blocks the budget holds
  int64_t max_running_seen = 0;      ///< most requests ever running at once
  int64_t generated_tokens = 0;      ///< over all finished requests
  int64_t steps = 0;                 ///< step-loop iterations that ran a request
  int64_t encoder_cache_hits = 0;    ///< images whose embeddings came from the cross-request cache
  int64_t encoder_cache_misses = 0;  ///< images looked for there and encoded
  int64_t prefix_cache_lookups = 0;
  int64_t prefix_cache_hits = 0;
  int64_t prefix_cache_hit_columns = 0;  ///< prompt columns not computed thanks to the cache
  int64_t decode_batches = 0;            ///< forward_batch calls (one per step that had decoding requests)
  int64_t max_decode_batch = 0;          ///< most requests' decode calls in one forward_batch
  double busy_s = 0;                     ///< seconds the step loop spent stepping requests
  double time_to_first_token_s_sum = 0;  ///< from submit, over finished requests that produced a token
  int64_t first_tokens = 0;              ///< how many requests that sum covers

  /// Generated tokens per second of stepping (0 before any).
  double tokens_per_s() const { return busy_s > 0 ? static_cast<double>(generated_tokens) / busy_s : 0.0; }
  /// Mean time to first token over finished requests (0 before any).
  double mean_time_to_first_token_s() const {
    return first_tokens > 0 ? time_to_first_token_s_sum / static_cast<double>(first_tokens) : 0.0;
  }
};

/// A submitted request: its result (or error) when it ends, and a way to cancel it.
class RequestHandle {
 public:
  /// Blocks until the request ends; returns its result or rethrows its error.
  GenerationResult wait() { return future_.get(); }
  /// Whether it has ended.
  bool done() const { return future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }
  /// Ends every unfinished row with kCancelled before the request's next step (a waiting
  /// request ends without running).
  void cancel() { cancel_.store(true); }

 private:
  friend class Engine;
  RequestHandle() : future_(promise_.get_future().share()) {}
  std::promise<GenerationResult> promise_;
  std::shared_future<GenerationResult> future_;
  std::atomic<bool> cancel_{false};
};

class Engine {
 public:
  /// Starts the step loop on its own thread. `model` must outlive the engine and is used only
  /// by that thread.
  explicit Engine(CausalVlm& model, EngineOptions options = EngineOptions())
      : model_(model),
        options_(options),
        parallel_(ParallelContext::single()),
        encoder_cache_(std::max<int64_t>(options.encoder_cache_bytes(), 0)),
        prefix_cache_(std::max<int64_t>(options.prefix_block_columns(), 1),
                      std::max<int64_t>(options.prefix_cache_bytes(), 0)) {
    VLMGEN_CHECK(options.prefix_block_columns() >= 1, "prefix_block_columns must be >= 1, got {}",
                 options.prefix_block_columns());
    VLMGEN_CHECK(options.max_running() >= 1, "max_running must be >= 1, got {}", options.max_running());
    VLMGEN_CHECK(options.encoder_cache_bytes() >= 0, "encoder_cache_bytes must be >= 0, got {}",
                 options.encoder_cache_bytes());
    VLMGEN_CHECK(options.kv_cache_bytes() > 0, "kv_cache_bytes must be > 0, got {}", options.kv_cache_bytes());
    VLMGEN_CHECK(options.kv_block_columns() >= 1, "kv_block_columns must be >= 1, got {}", options.kv_block_columns());
    VLMGEN_CHECK(options.prefill_columns_per_step() >= 0, "prefill_columns_per_step must be >= 0, got {}",
                 options.prefill_columns_per_step());
    metrics_.kv_bytes_budget = options.kv_cache_bytes();
    metrics_.kv_blocks_total = block_bytes() > 0 ? options.kv_cache_bytes() / block_bytes() : 0;
    loop_ = std::thread([this] { run(); });
  }
  /// Cancels what is waiting or running, lets those requests end (with kCancelled), and stops
  /// the loop.
  ~Engine() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      for (auto& w : waiting_) w.handle->cancel();
    }
    wake_.notify_all();
    loop_.join();
  }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Queues a request (one or more rows; GenerateRequest::context must be null: the engine
  /// gives each request its own KV cache; GenerateRequest::cancel is replaced by the handle's
  /// cancel()). The streaming callback runs on the engine's thread. Throws vlmgen::Error at
  /// once when the request's KV cache alone exceeds the budget; every other check runs when it
  /// is admitted, and its error ends the request (wait() rethrows it).
  std::shared_ptr<RequestHandle> submit(GenerateRequest request, GenerationConfig config) {
    VLMGEN_CHECK(request.context == nullptr,
                 "an engine request cannot bring its own InferenceContext; the engine allocates each request's");
    const int64_t need = kv_blocks_needed(request, config);
    VLMGEN_CHECK(need <= metrics_.kv_blocks_total,
                 "the request needs {} KV blocks ({} rows x {} columns, {} columns and {} bytes per block) but the "
                 "engine's whole budget of {} bytes holds {}",
                 need, request.prompts.size(), columns_needed(request, config), options_.kv_block_columns(),
                 block_bytes(), options_.kv_cache_bytes(), metrics_.kv_blocks_total);
    std::shared_ptr<RequestHandle> handle(new RequestHandle());
    {
      std::lock_guard<std::mutex> lock(mutex_);
      VLMGEN_CHECK(!stopping_, "the engine is shutting down");
      waiting_.push_back(Waiting{std::move(request), std::move(config), handle, need, detail::Clock::now()});
      metrics_.waiting = static_cast<int64_t>(waiting_.size());
    }
    wake_.notify_all();
    return handle;
  }

  EngineMetrics metrics() const {
    const EncoderCache::Stats cache = encoder_cache_.stats();
    std::lock_guard<std::mutex> lock(mutex_);
    EngineMetrics m = metrics_;
    m.encoder_cache_hits = cache.hits;
    m.encoder_cache_misses = cache.misses;
    const PrefixCache::Stats prefixes = prefix_cache_.stats();
    m.prefix_cache_lookups = prefixes.lookups;
    m.prefix_cache_hits = prefixes.hits;
    m.prefix_cache_hit_columns = prefixes.hit_columns;
    return m;
  }

 private:
  struct Waiting {
    GenerateRequest request;
    GenerationConfig config;
    std::shared_ptr<RequestHandle> handle;
    int64_t kv_blocks;
    detail::Clock::time_point submitted;
  };
  struct Running {
    std::unique_ptr<InferenceContext> context;  // seeded from the prefix cache (else the stepper's own)
    std::unique_ptr<detail::RequestStepper> stepper;
    std::shared_ptr<RequestHandle> handle;
    int64_t kv_blocks;
    std::vector<ContentHash> prefix_keys;  // blocks to cache once the prompt is computed
    double queued_s = 0;                   // from submit to the stepper's start
  };

  static int64_t columns_needed(const GenerateRequest& request, const GenerationConfig& config) {
    int64_t longest = 0;
    for (const auto& p : request.prompts) longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
    return longest + std::max<int64_t>(config.max_new_tokens() - 1, 0);
  }
  // Bytes of one KV block (one row, kv_block_columns columns, every layer); kv_blocks_total is
  // read without the lock (set once in the constructor).
  int64_t block_bytes() const { return model_.traits().kv_cache.bytes_per_token() * options_.kv_block_columns(); }
  int64_t kv_blocks_needed(const GenerateRequest& request, const GenerationConfig& config) const {
    const ModelTraits& traits = model_.traits();
    if (!config.enable_kv_cache() || !traits.supports_kv_cache || block_bytes() == 0) return 0;
    const int64_t per_row =
        (columns_needed(request, config) + options_.kv_block_columns() - 1) / options_.kv_block_columns();
    return per_row * static_cast<int64_t>(request.prompts.size());
  }

  // Takes the waiting requests that fit (slots and KV budget) off the queue and books their KV
  // blocks. Called with the lock held.
  std::vector<Waiting> admit(int64_t running) {
    std::vector<Waiting> admitted;
    while (!waiting_.empty() && running + static_cast<int64_t>(admitted.size()) < options_.max_running() &&
           metrics_.kv_blocks_used + waiting_.front().kv_blocks <= metrics_.kv_blocks_total) {
      metrics_.kv_blocks_used += waiting_.front().kv_blocks;
      metrics_.kv_bytes_used = metrics_.kv_blocks_used * block_bytes();
      admitted.push_back(std::move(waiting_.front()));
      waiting_.pop_front();
    }
    metrics_.waiting = static_cast<int64_t>(waiting_.size());
    return admitted;
  }

  void run() {
    c10::InferenceMode inference_mode;  // as in Generator::generate
    std::list<Running> running;         // only this thread touches it
    while (true) {
      std::vector<Waiting> admitted;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !running.empty() || !waiting_.empty(); });
        if (stopping_) {
          for (Running& r : running) r.handle->cancel();
          if (running.empty() && waiting_.empty()) return;
        }
        admitted = admit(static_cast<int64_t>(running.size()));
      }
      for (Waiting& w : admitted) start(std::move(w), running);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        metrics_.running = static_cast<int64_t>(running.size());
        metrics_.max_running_seen = std::max(metrics_.max_running_seen, metrics_.running);
        if (!running.empty()) ++metrics_.steps;
      }
      if (running.empty()) continue;
      const auto t = detail::Clock::now();
      step_all(running);
      std::lock_guard<std::mutex> lock(mutex_);
      metrics_.busy_s += detail::seconds_between(t, detail::Clock::now());
    }
  }

  // One step of every running request. Those decoding over their KV cache make their calls
  // together in one forward_batch (the model reads its weights once for all of them); a
  // prefill chunk, or a recompute without a KV cache, runs on its own. When the batched call
  // throws, its calls run again one by one, and a request whose own call throws ends with the
  // error while the others go on.
  void step_all(std::list<Running>& running) {
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
  // request cancelled while waiting ends without running; one that fails to start ends with
  // its error.
  void start(Waiting w, std::list<Running>& running) {
    if (w.handle->cancel_.load()) {
      GenerationResult result;
      result.sequences.resize(w.request.prompts.size());
      for (auto& s : result.sequences) s.finish_reason = FinishReason::kCancelled;
      end(w.kv_blocks, /*failed=*/false, 0);
      w.handle->promise_.set_value(std::move(result));
      return;
    }
    w.request.cancel = &w.handle->cancel_;
    const bool want_kv = w.config.enable_kv_cache();
    const ReplayMode replay = w.config.replay_mode();
    const ModelTraits& traits = model_.traits();
    try {
      Running r{nullptr, nullptr, w.handle, w.kv_blocks, {}, 0.0};
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
    } catch (...) {
      end(w.kv_blocks, /*failed=*/true, 0);
      w.handle->promise_.set_exception(std::current_exception());
    }
  }

  // Looks the prompt up in the prefix cache: on a hit the request continues from a copy of the
  // cached columns (check_continuation then verifies tokens and pictures, as for any caller's
  // context). Remembers the prompt's block keys, to cache its prefill.
  void seed_from_prefix_cache(Waiting& w, Running& r) {
    detail::validate_request(w.request, w.config, model_.traits());
    const detail::RequestLayout layout = detail::lay_out_request(w.request, w.config, model_);
    const std::vector<ContentHash> fingerprints = w.request.vision.fingerprints();
    r.prefix_keys = prefix_cache_.block_keys(w.request.prompts[0], layout.spans, fingerprints);
    const PrefixCache::Hit hit = prefix_cache_.lookup(r.prefix_keys, layout.spans, layout.prompt_len);
    if (hit.columns == 0) return;
    r.context = hit.context->copy_prefix(hit.columns, std::max<int64_t>(layout.fed_columns, 1));
    w.request.context = r.context.get();
  }

  // One step of a running request (`advance`: the stepper's step, true while more is left);
  // ends the request (result or error) when it is done. The metrics count a request as ended
  // before its handle is fulfilled.
  template <typename Advance>
  std::list<Running>::iterator step(std::list<Running>& running, std::list<Running>::iterator it, Advance&& advance) {
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
    if (tokens > 0) {  // from submit: the wait for admission counts
      std::lock_guard<std::mutex> lock(mutex_);
      metrics_.time_to_first_token_s_sum += it->queued_s + result.stats.time_to_first_token_s;
      ++metrics_.first_tokens;
    }
    const auto next = retire(running, it, /*failed=*/false, tokens);
    handle->promise_.set_value(std::move(result));
    return next;
  }

  std::list<Running>::iterator fail(std::list<Running>& running, std::list<Running>::iterator it,
                                    const std::exception_ptr& error) {
    std::shared_ptr<RequestHandle> handle = it->handle;
    const auto next = retire(running, it, /*failed=*/true, 0);
    handle->promise_.set_exception(error);
    return next;
  }

  std::list<Running>::iterator retire(std::list<Running>& running, std::list<Running>::iterator it, bool failed,
                                      int64_t tokens) {
    end(it->kv_blocks, failed, tokens);
    auto next = running.erase(it);  // frees the request's KV cache
    std::lock_guard<std::mutex> lock(mutex_);
    metrics_.running = static_cast<int64_t>(running.size());
    return next;
  }

  void end(int64_t kv_blocks, bool failed, int64_t tokens) {
    std::lock_guard<std::mutex> lock(mutex_);
    metrics_.kv_blocks_used -= kv_blocks;
    metrics_.kv_bytes_used = metrics_.kv_blocks_used * block_bytes();
    ++(failed ? metrics_.failed : metrics_.finished);
    metrics_.generated_tokens += tokens;
  }

  CausalVlm& model_;
  const EngineOptions options_;
  const ParallelContext parallel_;
  EncoderCache encoder_cache_;
  PrefixCache prefix_cache_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Waiting> waiting_;  // guarded by mutex_
  bool stopping_ = false;        // guarded by mutex_
  EngineMetrics metrics_;        // guarded by mutex_
  std::thread loop_;
};

}  // namespace vlmgen
