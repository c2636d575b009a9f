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
//
// Under tensor parallelism every rank builds an Engine over its shard of the model with the
// model's ParallelContext. Rank 0 takes the requests and schedules; before each step it sends the
// others its plan (admitted requests with their prompts, images and options; cancellations
// taking effect), and every rank runs that step, so all make the same forward calls and sample
// the same tokens. The other ranks call join(), which returns when rank 0's engine shuts down.
//
//   vlmgen::Engine engine(model, options, parallel);
//   if (parallel.tp_rank() != 0) engine.join();   // rank 0 submits as above

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <future>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "vlmgen/distributed/communicator.h"
#include "vlmgen/engine/encoder_cache.h"
#include "vlmgen/engine/engine_options.h"
#include "vlmgen/engine/prefix_cache.h"
#include "vlmgen/engine/step_plan.h"
#include "vlmgen/error.h"
#include "vlmgen/model.h"
#include "vlmgen/parallel.h"
#include "vlmgen/request.h"
#include "vlmgen/step/rank_agreement.h"
#include "vlmgen/step/request_stepper.h"

namespace vlmgen {

class Engine {
 public:
  /// Starts the step loop on its own thread. `model` must outlive the engine and is used only
  /// by that thread. Under tensor parallelism `parallel` is the model's ParallelContext, and
  /// every rank builds its Engine with the same options.
  explicit Engine(CausalVlm& model, EngineOptions options = EngineOptions(),
                  ParallelContext parallel = ParallelContext::single())
      : model_(model),
        options_(options),
        parallel_(std::move(parallel)),
        leads_(parallel_.tp_rank() == 0),
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
    VLMGEN_CHECK(options.idle_plan_interval().count() > 0, "idle_plan_interval must be > 0 ms, got {}",
                 options.idle_plan_interval().count());
    VLMGEN_CHECK(parallel_.tp_size() == 1 || parallel_.tp_group() != nullptr,
                 "a tensor-parallel engine of {} ranks needs the group's communicator", parallel_.tp_size());
    metrics_.kv_bytes_budget = options.kv_cache_bytes();
    metrics_.kv_blocks_total = block_bytes() > 0 ? options.kv_cache_bytes() / block_bytes() : 0;
    loop_ = std::thread([this] { leads_ ? lead() : follow(); });
  }
  /// Cancels what is waiting or running, lets those requests end (with kCancelled), and stops
  /// the loop (on rank 0 of a tensor-parallel engine, the other ranks' loops too). On another
  /// rank, returns once rank 0's engine has stopped; destroyed before it, it stops at the next
  /// plan and rank 0's following step fails with its communicator's error.
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
  /// once when max_new_tokens is outside [0, GenerationConfig::kMaxSequenceColumns] or the
  /// request's KV cache alone exceeds the budget; every other check runs when it is admitted,
  /// and its error ends the request (wait() rethrows it).
  std::shared_ptr<RequestHandle> submit(GenerateRequest request, GenerationConfig config) {
    VLMGEN_CHECK(leads_,
                 "this engine is rank {} of a tensor-parallel group of {} and runs rank 0's plan; submit requests to "
                 "rank 0's engine",
                 parallel_.tp_rank(), parallel_.tp_size());
    VLMGEN_CHECK(request.context == nullptr,
                 "an engine request cannot bring its own InferenceContext; the engine allocates each request's");
    // Before the booking arithmetic (validate_request checks the same, against the model too).
    VLMGEN_CHECK(config.max_new_tokens() >= 0 && config.max_new_tokens() <= GenerationConfig::kMaxSequenceColumns,
                 "max_new_tokens must be in [0, {}] (GenerationConfig::kMaxSequenceColumns), got {}",
                 GenerationConfig::kMaxSequenceColumns, config.max_new_tokens());
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
      VLMGEN_CHECK(broken_.empty(), "the engine stopped: {}", broken_);
      waiting_.push_back(
          Waiting{std::move(request), std::move(config), handle, need, detail::Clock::now(), next_id_++});
      metrics_.waiting = static_cast<int64_t>(waiting_.size());
    }
    wake_.notify_all();
    return handle;
  }

  /// Rank 0 of a tensor-parallel engine whose ranks can no longer step together (a rank died,
  /// drifted, or failed alone): why, and submit refuses requests from then on. Empty while it
  /// works (always, without tensor parallelism).
  std::string broken() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return broken_;
  }

  /// On a rank other than 0 of a tensor-parallel engine: blocks while the engine runs rank 0's
  /// plans, and returns when rank 0's engine stops; rethrows the error that ended the loop
  /// early (a failed collective, a rank whose state drifted from rank 0's).
  void join() {
    VLMGEN_CHECK(!leads_, "join() is for the ranks that run rank 0's plan; this engine is rank 0 and takes requests");
    std::unique_lock<std::mutex> lock(mutex_);
    ended_.wait(lock, [&] { return followed_; });
    if (follow_error_) std::rethrow_exception(follow_error_);
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
    uint64_t id;  // rank 0 numbers requests in submit order; the plans name them by it
  };
  struct CallbackAnswers {
    std::vector<int64_t> cancelled_rows;
    std::exception_ptr error;
  };
  struct Running {
    uint64_t id = 0;
    // What the stepper reads: set at a step boundary, from the handle on rank 0 and from rank
    // 0's plan elsewhere, so every rank stops the request at the same step.
    std::unique_ptr<std::atomic<bool>> cancel;
    std::unique_ptr<InferenceContext> context;  // seeded from the prefix cache (else the stepper's own)
    std::unique_ptr<detail::RequestStepper> stepper;
    std::shared_ptr<RequestHandle> handle;
    int64_t kv_blocks = 0;
    std::vector<ContentHash> prefix_keys;  // blocks to cache once the prompt is computed
    double queued_s = 0;                   // from submit to the stepper's start
    // Rank 0 of a tensor-parallel engine: what the request's streaming callback answered during
    // a step, sent with the next plan and applied on every rank at that step boundary.
    std::shared_ptr<CallbackAnswers> answers;
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
  // Requests cancelled while waiting leave the queue wherever they stand, booking nothing (lead()
  // ends them without running): they neither wait for a slot nor hold up the requests behind.
  std::vector<Waiting> admit(int64_t running) {
    std::vector<Waiting> admitted;
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (!it->handle->cancel_.load()) {
        ++it;
        continue;
      }
      it->kv_blocks = 0;
      admitted.push_back(std::move(*it));
      it = waiting_.erase(it);
    }
    int64_t taken = 0;
    while (!waiting_.empty() && running + taken < options_.max_running() &&
           metrics_.kv_blocks_used + waiting_.front().kv_blocks <= metrics_.kv_blocks_total) {
      metrics_.kv_blocks_used += waiting_.front().kv_blocks;
      metrics_.kv_bytes_used = metrics_.kv_blocks_used * block_bytes();
      admitted.push_back(std::move(waiting_.front()));
      waiting_.pop_front();
      ++taken;
    }
    metrics_.waiting = static_cast<int64_t>(waiting_.size());
    return admitted;
  }

  bool has_followers() const { return parallel_.tp_size() > 1; }

  // The step loops and the plans between ranks (engine_loop.h).
  void lead();
  bool send(const detail::StepPlan& plan, std::list<Running>& running, std::vector<Waiting>& starting);
  std::vector<int64_t> ranks_refusing(bool refuse);
  void abandon(const std::string& why, std::list<Running>& running, std::vector<Waiting>& starting);
  void follow();
  detail::StepState state(const std::list<Running>& running) const;

  // Stepping the running requests (engine_step.h).
  void run_step(std::list<Running>& running, const detail::StepPlan& plan, std::vector<Waiting> admitted);
  void agree_on_starts(std::list<Running>& running, const std::vector<uint64_t>& not_started, size_t admitted);
  void step_all(std::list<Running>& running);
  bool start(Waiting w, std::list<Running>& running);
  void seed_from_prefix_cache(Waiting& w, Running& r);
  template <typename Advance>
  std::list<Running>::iterator step(std::list<Running>& running, std::list<Running>::iterator it, Advance&& advance);
  std::list<Running>::iterator fail(std::list<Running>& running, std::list<Running>::iterator it,
                                    const std::exception_ptr& error);
  std::list<Running>::iterator retire(std::list<Running>& running, std::list<Running>::iterator it, bool failed,
                                      int64_t tokens);
  void end(int64_t kv_blocks, bool failed, int64_t tokens);

  CausalVlm& model_;
  const EngineOptions options_;
  const ParallelContext parallel_;
  const bool leads_;  // rank 0 (or no tensor parallelism): takes requests and plans the steps
  EncoderCache encoder_cache_;
  PrefixCache prefix_cache_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Waiting> waiting_;  // guarded by mutex_
  bool stopping_ = false;        // guarded by mutex_
  EngineMetrics metrics_;        // guarded by mutex_
  uint64_t next_id_ = 0;         // guarded by mutex_
  std::string broken_;           // guarded by mutex_: why rank 0 can no longer plan steps
  std::condition_variable ended_;
  bool followed_ = false;                                     // guarded by mutex_: a following rank's loop has ended
  std::exception_ptr follow_error_;                           // guarded by mutex_: what ended it early
  std::vector<uint64_t> failed_in_step_;                      // the loop thread's: requests failed since the step began
  static constexpr uint64_t kFusedPassFailed = ~uint64_t{0};  // in failed_in_step_: a fused pass threw
  std::thread loop_;
};

}  // namespace vlmgen

// The out-of-class bodies of Engine's private member functions.
#include "vlmgen/engine/engine_loop.h"
#include "vlmgen/engine/engine_step.h"
