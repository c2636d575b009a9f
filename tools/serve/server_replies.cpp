// vlmgen-serve's replies: a whole chat completion or a stream of server-sent events, the
// accounting of each request when it ends, and the Prometheus text of /metrics.

#include <fmt/format.h>

#include <chrono>

#include "serve_internal.h"
#include "vlmgen/error.h"

namespace vlmgen::serve {
namespace {

const char* finish_reason(const Completion& c, FinishReason r) {
  if (c.stop_hit) return "stop";
  return r == FinishReason::kLength ? "length" : "stop";
}

/// Cancelled by the server (the grace period of a shutdown ended), not ended by a stop string
/// (whose callback also ends the row with kCancelled).
bool cut_by_shutdown(const Completion& c, FinishReason r) { return r == FinishReason::kCancelled && !c.stop_hit; }

const char* const kCutByShutdown =
    "the server shut down before the reply was complete (in-flight requests get --grace-seconds)";

/// The message of the exception being handled, whatever its type.
std::string current_exception_text() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

std::string sse(const Json& j) { return "data: " + json_text(j) + "\n\n"; }

}  // namespace

Json Server::usage(int64_t prompt_tokens, int64_t completion_tokens) const {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

Json Server::chunk(const std::string& id, int64_t created, const Json& delta, const Json& finish,
                   const Json& logprobs) const {
  Json choice = {{"index", 0}, {"delta", delta}, {"finish_reason", finish}, {"logprobs", logprobs}};
  return {{"id", id},
          {"object", "chat.completion.chunk"},
          {"created", created},
          {"model", model_name_},
          {"choices", Json::array({choice})}};
}

void Server::respond(httplib::Response& res, const std::string& id, const ChatRequest& chat, int64_t prompt_tokens,
                     const std::shared_ptr<Completion>& c) {
  struct NoLongerActive {  // however respond ends, the request is no longer in flight
    Server& server;
    const std::shared_ptr<Completion>& c;
    ~NoLongerActive() { server.done(c); }
  } no_longer_active{*this, c};
  GenerationResult result;
  try {
    result = c->handle->wait();
  } catch (...) {  // whatever the engine passed on (a vlmgen::Error, LibTorch's, std::bad_alloc)
    throw ApiError(500, fmt::format("generation failed: {}", current_exception_text()), "", "server_error");
  }
  c->finish();
  const SequenceOutput& out = result.sequences.at(0);
  if (cut_by_shutdown(*c, out.finish_reason)) {
    throw ApiError(503, kCutByShutdown, "", "server_error", "shutting_down");
  }
  Json choice = {{"index", 0},
                 {"message", {{"role", "assistant"}, {"content", c->text}}},
                 {"finish_reason", finish_reason(*c, out.finish_reason)},
                 {"logprobs", Json()}};
  if (chat.logprobs) choice["logprobs"] = {{"content", c->logprobs}};  // top alternatives came with each token
  const auto completion_tokens = static_cast<int64_t>(out.tokens.size());
  Json body = {{"id", id},
               {"object", "chat.completion"},
               {"created", c->created},
               {"model", model_name_},
               {"choices", Json::array({choice})},
               {"usage", usage(prompt_tokens, completion_tokens)}};
  res.set_content(json_text(body), "application/json");
  finished(c, 200, prompt_tokens, completion_tokens);
  log_line("[serve] {} 200 prompt {} completion {} {:.3f} s\n", id, prompt_tokens, completion_tokens,
           seconds_between(c->submitted, Clock::now()));
}

void Server::stream(httplib::Response& res, const std::string& id, const ChatRequest& chat, int64_t prompt_tokens,
                    const std::shared_ptr<Completion>& c) {
  auto role_sent = std::make_shared<bool>(false);
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, id, include_usage = chat.include_usage, prompt_tokens, c, role_sent](size_t, httplib::DataSink& sink) {
        try {
          return stream_step(id, include_usage, prompt_tokens, c, *role_sent, sink);
        } catch (...) {  // an exception leaving this callback would end the process: the stream ends instead
          const std::string why = current_exception_text();
          try {
            const std::string event =
                sse(error_body(ApiError(500, "the server failed on this stream: " + why, "", "server_error")));
            sink.write(event.data(), event.size());
            record(c, 500, prompt_tokens, 0);
            sink.done();
          } catch (...) {
          }
          done(c);
          return false;
        }
      },
      [this, id, c](bool success) {
        if (success) return;
        // The client went away: cancel, and account for the request once the engine ends it.
        // (Called from the response's destructor: nothing may leave it.)
        try {
          c->handle->cancel();
          try {
            c->handle->wait();
          } catch (...) {  // cancelled, or failed: either way it is over
          }
          finished(c, 499, 0, 0);
          log_line("[serve] {} 499 client closed the stream; cancelled\n", id);
        } catch (...) {
          done(c);
        }
      });
}

/// One call of a stream's content provider: the role chunk first, then whatever text came, then
/// (once the engine is done) the end: finish_reason, usage, [DONE]. False: the client is gone.
bool Server::stream_step(const std::string& id, bool include_usage, int64_t prompt_tokens,
                         const std::shared_ptr<Completion>& c, bool& role_sent, httplib::DataSink& sink) {
  auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
  if (!role_sent) {
    role_sent = true;
    return write(sse(chunk(id, c->created, {{"role", "assistant"}, {"content", ""}}, Json())));
  }
  std::string delta;
  Json logprobs;
  bool ended = false;
  {
    std::unique_lock<std::mutex> lock(c->mu);
    c->cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return c->text.size() > c->sent || c->handle->done(); });
    ended = c->handle->done();
    delta = c->text.substr(c->sent);
    c->sent = c->text.size();
    if (c->want_logprobs && c->logprobs.size() > c->logprobs_sent) {
      logprobs = {{"content", Json(std::vector<Json>(c->logprobs.begin() + static_cast<long>(c->logprobs_sent),
                                                     c->logprobs.end()))}};
      c->logprobs_sent = c->logprobs.size();
    }
  }
  const auto now = Clock::now();
  if (!delta.empty() || !logprobs.is_null()) {
    if (!write(sse(chunk(id, c->created, {{"content", delta}}, Json(), logprobs)))) return false;
    c->last_write = now;
  } else if (!ended && now - c->last_write >= std::chrono::duration<double>(options_.keep_alive_seconds)) {
    // An SSE comment (clients skip it) while the request waits or computes a long prompt: a
    // client that left is found by the failing write, and its request cancelled (the releaser),
    // instead of holding its queue place and connection until its first token.
    if (!write(": keep-alive\n\n")) return false;
    c->last_write = now;
  }
  if (!ended) return true;
  // An end without a finish_reason: the error as an event, counted before the client can see the
  // end, and in flight (a draining server waits) until the last bytes are out.
  auto end_with = [&](const ApiError& e, int64_t completion_tokens) {
    write(sse(error_body(e)));
    record(c, e.status, prompt_tokens, completion_tokens);
    write("data: [DONE]\n\n");
    sink.done();
    done(c);
    return true;
  };
  GenerationResult result;
  try {
    result = c->handle->wait();
  } catch (...) {  // any type (an exception leaving the provider would end the process)
    return end_with(ApiError(500, fmt::format("generation failed: {}", current_exception_text()), "", "server_error"),
                    0);
  }
  c->finish();
  std::string rest;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    rest = c->text.substr(c->sent);
    c->sent = c->text.size();
  }
  if (!rest.empty()) write(sse(chunk(id, c->created, {{"content", rest}}, Json())));
  const SequenceOutput& out = result.sequences.at(0);
  if (cut_by_shutdown(*c, out.finish_reason)) {
    return end_with(ApiError(503, kCutByShutdown, "", "server_error", "shutting_down"),
                    static_cast<int64_t>(out.tokens.size()));
  }
  write(sse(chunk(id, c->created, Json::object(), finish_reason(*c, out.finish_reason))));
  const auto completion_tokens = static_cast<int64_t>(out.tokens.size());
  if (include_usage) {
    write(sse({{"id", id},
               {"object", "chat.completion.chunk"},
               {"created", c->created},
               {"model", model_name_},
               {"choices", Json::array()},
               {"usage", usage(prompt_tokens, completion_tokens)}}));
  }
  // Counted before the last bytes go out: a client that reads /metrics right after its
  // stream ends sees its request there. In flight until they are out.
  record(c, 200, prompt_tokens, completion_tokens);
  write("data: [DONE]\n\n");
  sink.done();
  done(c);
  log_line("[serve] {} 200 (stream) prompt {} completion {} {:.3f} s\n", id, prompt_tokens, completion_tokens,
           seconds_between(c->submitted, Clock::now()));
  return true;
}

void Server::done(const std::shared_ptr<Completion>& c) {
  std::lock_guard<std::mutex> lock(active_mu_);
  active_.erase(c);
}

void Server::finished(const std::shared_ptr<Completion>& c, int status, int64_t prompt_tokens,
                      int64_t completion_tokens) {
  done(c);
  record(c, status, prompt_tokens, completion_tokens);
}

void Server::record(const std::shared_ptr<Completion>& c, int status, int64_t prompt_tokens,
                    int64_t completion_tokens) {
  {
    std::lock_guard<std::mutex> c_lock(c->mu);
    if (c->recorded) return;
    c->recorded = true;
  }
  std::lock_guard<std::mutex> lock(metrics_mu_);
  ++requests_by_status_[status];
  prompt_tokens_ += prompt_tokens;
  generation_tokens_ += completion_tokens;
  std::lock_guard<std::mutex> c_lock(c->mu);
  if (c->tokens > 0) ttft_.observe(seconds_between(c->submitted, c->first_token));
  for (double gap : c->token_gaps) per_token_.observe(gap);
}

std::string Server::metrics_text() {
  const EngineMetrics m = engine_->metrics();
  std::string out;
  std::lock_guard<std::mutex> lock(metrics_mu_);
  out += "# HELP vlmgen_requests_total Chat-completion requests by HTTP status (499: client closed the stream).\n";
  out += "# TYPE vlmgen_requests_total counter\n";
  for (const auto& [status, n] : requests_by_status_)
    out += fmt::format("vlmgen_requests_total{{status=\"{}\"}} {}\n", status, n);
  auto gauge = [&](const char* name, const char* type, const char* help, double v) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, v);
  };
  gauge("vlmgen_prompt_tokens_total", "counter", "Prompt tokens of completed requests.", prompt_tokens_);
  gauge("vlmgen_generation_tokens_total", "counter", "Generated tokens of completed requests.", generation_tokens_);
  gauge("vlmgen_requests_running", "gauge", "Requests the engine is stepping.", m.running);
  gauge("vlmgen_requests_waiting", "gauge", "Requests waiting for admission.", m.waiting);
  gauge("vlmgen_kv_cache_bytes_used", "gauge", "KV-cache bytes held by running requests.", m.kv_bytes_used);
  gauge("vlmgen_kv_cache_bytes_budget", "gauge", "KV-cache byte budget (--kv-cache-bytes).", m.kv_bytes_budget);
  gauge("vlmgen_kv_blocks_used", "gauge", "KV-cache blocks held by running requests.", m.kv_blocks_used);
  gauge("vlmgen_kv_blocks_total", "gauge", "KV-cache blocks the budget holds.", m.kv_blocks_total);
  gauge("vlmgen_prefix_cache_lookups_total", "counter", "Prompts looked up in the prefix cache.",
        m.prefix_cache_lookups);
  gauge("vlmgen_prefix_cache_hits_total", "counter", "Prefix-cache lookups that hit.", m.prefix_cache_hits);
  gauge("vlmgen_prefix_cache_hit_rate", "gauge", "Prefix-cache hits / lookups.",
        m.prefix_cache_lookups > 0 ? double(m.prefix_cache_hits) / double(m.prefix_cache_lookups) : 0.0);
  gauge("vlmgen_encoder_cache_hits_total", "counter", "Images whose embeddings came from the cache.",
        m.encoder_cache_hits);
  gauge("vlmgen_encoder_cache_misses_total", "counter", "Images encoded.", m.encoder_cache_misses);
  const int64_t looked = m.encoder_cache_hits + m.encoder_cache_misses;
  gauge("vlmgen_encoder_cache_hit_rate", "gauge", "Encoder-cache hits / lookups.",
        looked > 0 ? double(m.encoder_cache_hits) / double(looked) : 0.0);
  ttft_.render(out, "vlmgen_time_to_first_token_seconds", "Time from submission to the first token.");
  per_token_.render(out, "vlmgen_time_per_output_token_seconds", "Time between consecutive tokens of a request.");
  return out;
}

}  // namespace vlmgen::serve
