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
#include "vlmgen/engine/prefix_cache.h"
#include "vlmgen/engine/step_plan.h"
#include "vlmgen/error.h"
#include "vlmgen/model.h"
#include "vlmgen/parallel.h"
#include "vlmgen/request.h"
#include "vlmgen/step/rank_agreement.h"
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
  /// Under tensor parallelism: the longest rank 0 stays silent while idle (> 0). It then sends
  /// an empty plan, so the other ranks, waiting for the next step, do not reach their
  /// communicator's timeout. Default 1000 ms.
  EngineOptions& idle_plan_interval(std::chrono::milliseconds value) {
    idle_plan_interval_ = value;
    return *this;
  }
  std::chrono::milliseconds idle_plan_interval() const { return idle_plan_interval_; }

 private:
  int64_t max_running_ = 16;
  int64_t kv_cache_bytes_ = int64_t{1} << 30;
  int64_t encoder_cache_bytes_ = int64_t{256} << 20;
  int64_t prefix_cache_bytes_ = int64_t{256} << 20;
  int64_t prefix_block_columns_ = 16;
  int64_t kv_block_columns_ = 16;
  int64_t prefill_columns_per_step_ = 512;
  std::chrono::milliseconds idle_plan_interval_{1000};
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
  /// once when the request's KV cache alone exceeds the budget; every other check runs when it
  /// is admitted, and its error ends the request (wait() rethrows it).
  std::shared_ptr<RequestHandle> submit(GenerateRequest request, GenerationConfig config) {
    VLMGEN_CHECK(leads_,
                 "this engine is rank {} of a tensor-parallel group of {} and runs rank 0's plan; submit requests to "
                 "rank 0's engine",
                 parallel_.tp_rank(), parallel_.tp_size());
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

  bool has_followers() const { return parallel_.tp_size() > 1; }

  // Rank 0's loop (the only one without tensor parallelism): admits, plans, sends the plan to
  // the other ranks, steps.
  void lead() {
    c10::InferenceMode inference_mode;  // as in Generator::generate
    std::list<Running> running;         // only this thread touches it
    while (true) {
      std::vector<Waiting> admitted;
      bool stop = false;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        const auto ready = [&] { return stopping_ || !running.empty() || !waiting_.empty(); };
        if (!has_followers()) {
          wake_.wait(lock, ready);
        } else if (!wake_.wait_for(lock, options_.idle_plan_interval(), ready)) {
          lock.unlock();  // idle: an empty plan keeps the other ranks' communicators alive
          detail::StepPlan idle;
          idle.state = state(running);
          std::vector<Waiting> none;
          if (!send(idle, running, none)) return;
          continue;
        }
        if (stopping_) {
          for (Running& r : running) r.handle->cancel();
          stop = running.empty() && waiting_.empty();
        }
        if (!stop) admitted = admit(static_cast<int64_t>(running.size()));
      }
      detail::StepPlan plan;
      plan.stop = stop;
      plan.state = state(running);
      for (const Running& r : running) {
        if (r.handle->cancel_.load() && !r.cancel->load()) plan.cancelled.push_back(r.id);
        if (r.answers == nullptr) continue;
        for (int64_t row : r.answers->cancelled_rows) plan.cancelled_rows.push_back({r.id, row});
        r.answers->cancelled_rows.clear();
        if (r.answers->error) plan.failed.push_back(r.id);
      }
      std::vector<Waiting> starting;
      for (Waiting& w : admitted) {
        if (w.handle->cancel_.load()) {  // cancelled while waiting: ends without running
          GenerationResult result;
          result.sequences.resize(w.request.prompts.size());
          for (auto& s : result.sequences) s.finish_reason = FinishReason::kCancelled;
          end(w.kv_blocks, /*failed=*/false, 0);
          w.handle->promise_.set_value(std::move(result));
          continue;
        }
        if (has_followers()) {
          try {
            detail::ByteWriter bytes;
            detail::write_request(bytes, w.request, w.config);
            plan.admitted.emplace_back(w.id, std::move(bytes.bytes()));
          } catch (...) {
            end(w.kv_blocks, /*failed=*/true, 0);
            w.handle->promise_.set_exception(std::current_exception());
            continue;
          }
        }
        starting.push_back(std::move(w));
      }
      if (has_followers() && !send(plan, running, starting)) return;
      if (stop) return;
      try {
        run_step(running, plan, std::move(starting));
      } catch (const std::exception& e) {  // the ranks disagree, or their collectives failed
        std::vector<Waiting> none;
        abandon(fmt::format("the tensor-parallel ranks can no longer step together: {}", e.what()), running, none);
        return;
      }
    }
  }

  // Sends rank 0's plan to the other ranks. When that fails (a rank died or fell silent), the
  // engine cannot step again: every request (running, admitted by this plan, or waiting) ends
  // with the error, and submit refuses new ones. `starting` is given back on success.
  bool send(const detail::StepPlan& plan, std::list<Running>& running, std::vector<Waiting>& starting) {
    std::vector<int64_t> refusing;
    try {
      std::string bytes = plan.encode();
      broadcast_bytes(*parallel_.tp_group(), bytes, 0);
      refusing = ranks_refusing(false);
    } catch (const std::exception& e) {
      abandon(fmt::format("sending a step plan to the other tensor-parallel ranks failed: {}", e.what()), running,
              starting);
      return false;
    }
    if (refusing.empty()) return true;
    abandon(fmt::format("tensor-parallel rank(s) [{}] could not run rank 0's step plan (their engine drifted from "
                        "rank 0's or was destroyed; their error says which)",
                        fmt::join(refusing, ", ")),
            running, starting);
    return false;
  }

  // Under tensor parallelism, after every plan: each rank says whether it can run it. Returns
  // the ranks that cannot, on every rank, so rank 0 stops at once rather than at a timeout (and
  // an idle plan doubles as a check that the other ranks are alive).
  std::vector<int64_t> ranks_refusing(bool refuse) {
    const at::Tensor mine = at::full({1}, refuse ? 1.0 : 0.0, at::kDouble);
    const at::Tensor all = parallel_.tp_group()->all_gather(mine, 0).to(at::kCPU).contiguous();
    std::vector<int64_t> refusing;
    for (int64_t r = 0; r < all.numel(); ++r) {
      if (all.data_ptr<double>()[r] > 0) refusing.push_back(r);
    }
    return refusing;
  }

  // Rank 0 stops for good: every request (running, starting, or waiting) ends with `why`, and
  // submit refuses new ones.
  void abandon(const std::string& why, std::list<Running>& running, std::vector<Waiting>& starting) {
    const auto error = std::make_exception_ptr(Error(why));
    std::deque<Waiting> waiting;
    {  // first: from now on submit refuses, so nothing queues behind the requests ended below
      std::lock_guard<std::mutex> lock(mutex_);
      broken_ = why;
      waiting.swap(waiting_);
      metrics_.waiting = 0;
    }
    while (!running.empty()) fail(running, running.begin(), error);
    for (Waiting& w : starting) {
      end(w.kv_blocks, /*failed=*/true, 0);
      w.handle->promise_.set_exception(error);
    }
    starting.clear();
    for (Waiting& w : waiting) {
      end(0, /*failed=*/true, 0);
      w.handle->promise_.set_exception(error);
    }
  }

  // The loop of the other ranks: receives rank 0's plan, checks it starts from this rank's
  // state, and runs the same step.
  void follow() {
    c10::InferenceMode inference_mode;
    std::list<Running> running;
    std::exception_ptr error;
    try {
      while (true) {
        std::string bytes;
        broadcast_bytes(*parallel_.tp_group(), bytes, 0);
        const detail::StepPlan plan = detail::StepPlan::decode(bytes);
        std::string problem;
        if (!plan.stop) {
          bool destroyed = false;
          {
            std::lock_guard<std::mutex> lock(mutex_);
            destroyed = stopping_;
          }
          const detail::StepState mine = state(running);
          if (destroyed) {
            problem = fmt::format("the engine of rank {} was destroyed while rank 0's still runs", parallel_.tp_rank());
          } else if (mine.values != plan.state.values) {
            problem = fmt::format(
                "rank {}'s engine drifted from rank 0's: before this step {} (this rank vs rank 0); every rank must "
                "build its engine with the same options",
                parallel_.tp_rank(), mine.differences(plan.state));
          }
        }
        const std::vector<int64_t> refusing = ranks_refusing(!problem.empty());
        VLMGEN_CHECK(problem.empty(), "{}", problem);
        VLMGEN_CHECK(refusing.empty(),
                     "tensor-parallel rank(s) [{}] could not run rank 0's step plan; the engine stops",
                     fmt::join(refusing, ", "));
        if (plan.stop) break;
        std::vector<Waiting> admitted;
        for (const auto& [id, request_bytes] : plan.admitted) {
          detail::ByteReader reader(request_bytes);
          auto [request, config] = detail::read_request(reader, model_.device());
          const int64_t blocks = kv_blocks_needed(request, config);
          {
            std::lock_guard<std::mutex> lock(mutex_);
            metrics_.kv_blocks_used += blocks;
            metrics_.kv_bytes_used = metrics_.kv_blocks_used * block_bytes();
          }
          admitted.push_back(Waiting{std::move(request), std::move(config),
                                     std::shared_ptr<RequestHandle>(new RequestHandle()), blocks, detail::Clock::now(),
                                     id});
        }
        run_step(running, plan, std::move(admitted));
      }
    } catch (...) {
      error = std::current_exception();
    }
    while (!running.empty()) retire(running, running.begin(), /*failed=*/true, 0);
    std::lock_guard<std::mutex> lock(mutex_);
    follow_error_ = error;
    followed_ = true;
    ended_.notify_all();
  }

  // What both sides of a plan compute before a step and compare: the options that steer
  // scheduling and the caches, the running requests in order, the caches' contents and the
  // counters the step loop moves. Equal caches answer the step's lookups alike.
  detail::StepState state(const std::list<Running>& running) const {
    uint64_t ids = 1469598103934665603ULL;  // FNV-1a over the running ids, in order
    for (const Running& r : running) ids = (ids ^ r.id) * 1099511628211ULL;
    const EncoderCache::Stats encoded = encoder_cache_.stats();
    const PrefixCache::Stats prefixes = prefix_cache_.stats();
    std::lock_guard<std::mutex> lock(mutex_);
    return {{options_.kv_block_columns(), options_.prefix_block_columns(), options_.prefix_cache_bytes(),
             options_.encoder_cache_bytes(), options_.prefill_columns_per_step(), static_cast<int64_t>(running.size()),
             static_cast<int64_t>(ids >> 1), metrics_.generated_tokens, prefixes.hits, prefixes.hit_columns,
             prefixes.entries, prefixes.bytes, prefixes.evictions, encoded.hits, encoded.misses, encoded.entries,
             encoded.bytes, encoded.evictions}};
  }

  // Applies a plan's cancellations and callback answers, starts its requests, and steps every
  // running request.
  void run_step(std::list<Running>& running, const detail::StepPlan& plan, std::vector<Waiting> admitted) {
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
  void agree_on_starts(std::list<Running>& running, const std::vector<uint64_t>& not_started, size_t admitted) {
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
  bool start(Waiting w, std::list<Running>& running) {
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

  std::list<Running>::iterator fail(std::list<Running>& running, std::list<Running>::iterator it,
                                    const std::exception_ptr& error) {
    failed_in_step_.push_back(it->id);
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
