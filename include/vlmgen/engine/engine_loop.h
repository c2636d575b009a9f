#pragma once

// The bodies of vlmgen::Engine's step loops (engine.h declares the class and includes this at its
// end): rank 0's loop that admits requests and plans each step, the other ranks' loop that runs
// rank 0's plan, and how the plan and the ranks' state travel between them under tensor
// parallelism.

#include <c10/core/InferenceMode.h>

#include <cstdint>
#include <deque>
#include <exception>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "vlmgen/distributed/communicator.h"
#include "vlmgen/engine/engine.h"
#include "vlmgen/engine/step_plan.h"
#include "vlmgen/error.h"

namespace vlmgen {

// Rank 0's loop (the only one without tensor parallelism): admits, plans, sends the plan to
// the other ranks, steps.
inline void Engine::lead() {
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
inline bool Engine::send(const detail::StepPlan& plan, std::list<Running>& running, std::vector<Waiting>& starting) {
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
inline std::vector<int64_t> Engine::ranks_refusing(bool refuse) {
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
inline void Engine::abandon(const std::string& why, std::list<Running>& running, std::vector<Waiting>& starting) {
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
inline void Engine::follow() {
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
      VLMGEN_CHECK(refusing.empty(), "tensor-parallel rank(s) [{}] could not run rank 0's step plan; the engine stops",
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
inline detail::StepState Engine::state(const std::list<Running>& running) const {
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

}  // namespace vlmgen
