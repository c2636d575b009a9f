#pragma once

// The parts of vlmgen-serve its files share: the command-line options, a request in flight
// (Completion) and the Server class. serve.cpp holds main (options, signals, ranks), server.cpp
// the routes and the admission of a chat request, server_replies.cpp the replies (whole or
// streamed), the accounting and /metrics.

#include <fmt/format.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <ctime>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "openai_protocol.h"
#include "vlmgen/engine/engine.h"
#include "vlmgen/text/chat.h"
#include "vlmgen/text/detokenizer.h"
#include "vlmgen/text/tokenizer.h"

namespace vlmgen::serve {

using Clock = std::chrono::steady_clock;

inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

/// A line on stderr that never throws (a closed log pipe or a full disk must not turn a reply
/// that has gone out into a failed one).
template <class... Args>
void log_line(fmt::format_string<Args...> format, Args&&... args) noexcept {
  try {
    fmt::print(stderr, format, std::forward<Args>(args)...);
  } catch (...) {
  }
}

/// HTTP worker threads kept from generating: a stream holds its thread to the end, so with every
/// thread streaming nothing would answer /health, /metrics or a refusal (429).
constexpr int kReservedThreads = 4;
struct Options {
  std::string model;
  std::string dtype = "f32";  // weights dtype of the language model
  std::string kv_dtype = "f32";
  std::string device = "cpu";
  std::string model_name;
  std::string host = "127.0.0.1";
  int port = 8000;
  int64_t max_running = 16;
  int64_t max_waiting = 256;
  int64_t kv_cache_bytes = int64_t{1} << 30;
  int64_t max_body_bytes = int64_t{32} << 20;
  int64_t max_image_pixels = int64_t{16} << 20;
  int64_t max_images = 16;
  int64_t max_total_image_pixels = int64_t{32} << 20;
  int64_t default_max_tokens = 256;
  std::string api_key;
  std::string allow_local_images;
  double grace_seconds = 10.0;
  double keep_alive_seconds = 1.0;  // a silent stream sends an SSE comment this often (Server::stream_step)
  int threads = 64;                 // kReservedThreads of them never generate
  int nproc = 1;
  int64_t timeout_s = 600;
};

// Every rank's engine gets these (a tensor-parallel engine's ranks must agree on them).
inline EngineOptions engine_options(const Options& o) {
  return EngineOptions().max_running(o.max_running).kv_cache_bytes(o.kv_cache_bytes);
}

/// A Prometheus histogram with fixed upper bounds.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v) {
    size_t i = 0;
    while (i < bounds_.size() && v > bounds_[i]) ++i;
    ++counts_[i];
    sum_ += v;
    ++count_;
  }
  void render(std::string& out, const std::string& name, const std::string& help) const {
    out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
    int64_t cumulative = 0;
    for (size_t i = 0; i < bounds_.size(); ++i) {
      cumulative += counts_[i];
      out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cumulative);
    }
    out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count_, name, sum_, name, count_);
  }

 private:
  std::vector<double> bounds_;
  std::vector<int64_t> counts_;
  double sum_ = 0;
  int64_t count_ = 0;
};

/// A token's entry in an OpenAI logprobs list: its text, log-probability and UTF-8 bytes. The
/// bytes are the token's own (Tokenizer::token_bytes), so a character split over several tokens
/// rebuilds from them; the text shows such a part as U+FFFD, as decode does.
inline Json logprob_json(const Tokenizer& tokenizer, int64_t token, float logprob) {
  Json bytes = Json::array();
  for (unsigned char c : tokenizer.token_bytes(token)) bytes.push_back(static_cast<int>(c));
  return {{"token", tokenizer.decode({token})}, {"logprob", logprob}, {"bytes", bytes}};
}

/// One completion in flight: the engine's callback appends final text (after the stop strings),
/// the HTTP side reads it.
struct Completion {
  Completion(const Tokenizer& tokenizer_, std::vector<std::string> stops, bool logprobs)
      : tokenizer(tokenizer_),
        detok(tokenizer_, /*skip_special_tokens=*/true),
        stop(std::move(stops)),
        want_logprobs(logprobs) {}

  bool on_token(const TokenEvent& e) {
    std::lock_guard<std::mutex> lock(mu);
    const auto now = Clock::now();
    if (tokens == 0) {
      first_token = now;
    } else {
      token_gaps.push_back(seconds_between(last_token, now));
    }
    last_token = now;
    ++tokens;
    bool hit = false;
    text += stop.feed(detok.push(e.token), &hit);
    if (want_logprobs) {
      Json entry = logprob_json(tokenizer, e.token, e.logprob);
      entry["top_logprobs"] = Json::array();
      for (const auto& [token, lp] : e.top_logprobs)
        entry["top_logprobs"].push_back(logprob_json(tokenizer, token, lp));
      logprobs.push_back(std::move(entry));
    }
    if (hit) stop_hit = true;
    cv.notify_all();
    return !hit;  // a stop string ends the row
  }

  /// After the engine is done with this request: the text held back by the detokenizer and the
  /// stop matcher.
  void finish() {
    std::lock_guard<std::mutex> lock(mu);
    if (finished) return;
    finished = true;
    if (stop_hit) return;
    bool hit = false;
    text += stop.feed(detok.finish(), &hit);
    if (hit) {
      stop_hit = true;
    } else {
      text += stop.flush();
    }
  }

  const Tokenizer& tokenizer;
  std::mutex mu;
  std::condition_variable cv;
  StreamingDetokenizer detok;
  StopMatcher stop;
  bool want_logprobs;
  std::string text;
  size_t sent = 0;
  Json logprobs = Json::array();
  size_t logprobs_sent = 0;
  int64_t tokens = 0;
  bool stop_hit = false;
  bool finished = false;
  bool recorded = false;  // counted in /metrics (once: a stream's last writes may still fail after)
  Clock::time_point submitted = Clock::now();
  Clock::time_point last_write = Clock::now();                 // the stream's last bytes out (HTTP side only)
  int64_t created = static_cast<int64_t>(std::time(nullptr));  // the reply's "created": when it came
  Clock::time_point first_token;
  Clock::time_point last_token;
  std::vector<double> token_gaps;
  std::shared_ptr<RequestHandle> handle;
  std::shared_ptr<const void> slot;  // the server's count of generating connections, released last
};

/// The chat-completions server of rank 0: the model, its tokenizer and chat template, an Engine, and
/// the requests in flight.
class Server {
 public:
  Server(const Options& options, const ParallelContext& parallel);

  void install(httplib::Server& svr);

  /// From now on, new chat requests get 503.
  void drain() { draining_.store(true); }

  /// Cancels every request in flight (the grace period is over).
  void cancel_all() {
    std::lock_guard<std::mutex> lock(active_mu_);
    cancelled_all_ = true;  // a request admitted from now on is cancelled as it enters
    for (const auto& c : active_) {
      if (c->handle) c->handle->cancel();
    }
  }
  /// Requests past the draining check: those still being admitted (images decoding, prompt
  /// building) and those submitted.
  size_t in_flight() {
    std::lock_guard<std::mutex> lock(active_mu_);
    return active_.size() + static_cast<size_t>(admitting_.load());
  }

 private:
  static void reply_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    res.set_content(json_text(error_body(e)), "application/json");
  }

  void count_status(int status) {
    std::lock_guard<std::mutex> lock(metrics_mu_);
    ++requests_by_status_[status];
  }

  void chat_completions(const httplib::Request& req, httplib::Response& res);
  /// The checks a chat request passes, then its submission and reply (chat_completions answers
  /// anything else it throws with a 500).
  void admit_chat(const httplib::Request& req, httplib::Response& res);
  /// Why a request's body is not read (a Content-Encoding, no Content-Length, not JSON), or null.
  const ApiError* body_refusal(const httplib::Request& req) const;
  /// Images from data URLs decoded here, under the server's pixel limit, so an oversized picture
  /// is a 400 naming its message before anything is resized.
  void decode_images(std::vector<ChatMessage>& messages) const;

  Json usage(int64_t prompt_tokens, int64_t completion_tokens) const;
  Json chunk(const std::string& id, int64_t created, const Json& delta, const Json& finish,
             const Json& logprobs = Json()) const;
  void respond(httplib::Response& res, const std::string& id, const ChatRequest& chat, int64_t prompt_tokens,
               const std::shared_ptr<Completion>& c);
  void stream(httplib::Response& res, const std::string& id, const ChatRequest& chat, int64_t prompt_tokens,
              const std::shared_ptr<Completion>& c);
  bool stream_step(const std::string& id, bool include_usage, int64_t prompt_tokens,
                   const std::shared_ptr<Completion>& c, bool& role_sent, httplib::DataSink& sink);
  void done(const std::shared_ptr<Completion>& c);
  void finished(const std::shared_ptr<Completion>& c, int status, int64_t prompt_tokens, int64_t completion_tokens);
  /// The request's figures in /metrics.
  void record(const std::shared_ptr<Completion>& c, int status, int64_t prompt_tokens, int64_t completion_tokens);
  std::string metrics_text();

  Options options_;
  // Requests from admission to their end (kReservedThreads). Declared before the engine, which
  // may drop a request's last reference (and so release its slot) as it is destroyed.
  std::atomic<int> generating_{0};
  std::unique_ptr<CausalVlm> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ChatProcessor> processor_;
  std::vector<int64_t> end_ids_;
  std::unique_ptr<Engine> engine_;
  RequestLimits limits_;
  std::string model_name_;
  int64_t created_ = static_cast<int64_t>(std::time(nullptr));  // /v1/models: when the server started
  std::atomic<int64_t> next_id_{1};
  std::atomic<bool> draining_{false};
  // Raised before the draining check and lowered once the request is in active_ (or refused), so
  // a drain that reads in_flight() after setting draining_ sees every request that got past it.
  std::atomic<int64_t> admitting_{0};
  std::mutex active_mu_;
  std::set<std::shared_ptr<Completion>> active_;
  bool cancelled_all_ = false;  // under active_mu_
  std::mutex metrics_mu_;
  std::map<int, int64_t> requests_by_status_;
  int64_t prompt_tokens_ = 0;
  int64_t generation_tokens_ = 0;
  Histogram ttft_{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  Histogram per_token_{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};
};

}  // namespace vlmgen::serve
