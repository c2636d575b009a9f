#pragma once

// What an Engine is built with and what it hands back: EngineOptions (its limits and budgets),
// EngineMetrics (what it is doing, read from any thread) and RequestHandle (a submitted
// request's result, and a way to cancel it).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>

#include "vlmgen/request.h"

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

}  // namespace vlmgen
