// vlmgen-serve: an OpenAI-compatible chat-completions server on vlmgen's Engine.
//
//   vlmgen-serve --model DIR [--host 127.0.0.1] [--port 8000] [--max-running 16]
//                [--kv-cache-bytes N] [--api-key KEY] [--allow-local-images DIR] ...
//
// POST /v1/chat/completions (JSON or server-sent events), GET /v1/models, GET /health and
// GET /metrics (Prometheus text). Every request is checked before it reaches the engine; a bad
// one gets an OpenAI-style error naming the field. SIGINT/SIGTERM stop accepting, let in-flight
// requests finish for --grace-seconds, cancel the rest, and exit 0.

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <httplib.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "openai_protocol.h"
#include "vlmgen/distributed/launch.h"
#include "vlmgen/engine/engine.h"
#include "vlmgen/error.h"
#include "vlmgen/image/image.h"
#include "vlmgen/image/preprocessor_config.h"
#include "vlmgen/io/files.h"
#include "vlmgen/io/json.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/text/chat.h"
#include "vlmgen/text/detokenizer.h"
#include "vlmgen/text/tokenizer.h"

namespace vlmgen::serve {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Options {
  std::string model;
  std::string dtype = "f32";  // weights dtype of the language model
  std::string device = "cpu";
  std::string model_name;
  std::string host = "127.0.0.1";
  int port = 8000;
  int64_t max_running = 16;
  int64_t max_waiting = 256;
  int64_t kv_cache_bytes = int64_t{1} << 30;
  int64_t max_body_bytes = int64_t{32} << 20;
  int64_t max_image_pixels = int64_t{16} << 20;
  int64_t default_max_tokens = 256;
  std::string api_key;
  std::string allow_local_images;
  double grace_seconds = 10.0;
  int threads = 64;
  int nproc = 1;
  int64_t timeout_s = 600;
};

// Every rank's engine gets these (a tensor-parallel engine's ranks must agree on them).
EngineOptions engine_options(const Options& o) {
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

/// A token's entry in an OpenAI logprobs list: its text, log-probability and UTF-8 bytes.
Json logprob_json(const Tokenizer& tokenizer, int64_t token, float logprob) {
  const std::string piece = tokenizer.decode({token});
  Json bytes = Json::array();
  for (unsigned char c : piece) bytes.push_back(static_cast<int>(c));
  return {{"token", piece}, {"logprob", logprob}, {"bytes", bytes}};
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
  Clock::time_point submitted = Clock::now();
  Clock::time_point first_token;
  Clock::time_point last_token;
  std::vector<double> token_gaps;
  std::shared_ptr<RequestHandle> handle;
};

const char* finish_reason(const Completion& c, FinishReason r) {
  if (c.stop_hit) return "stop";
  return r == FinishReason::kLength ? "length" : "stop";
}

std::string sse(const Json& j) { return "data: " + j.dump() + "\n\n"; }

class Server {
 public:
  Server(const Options& options, const ParallelContext& parallel) : options_(options) {
    // The tokenizer, template and image format first: a folder vlmgen cannot write prompts for
    // fails before its weights are read.
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_pretrained(options.model));
    std::string source;
    processor_ = std::make_unique<ChatProcessor>(ChatProcessor::from_pretrained(
        options.model, *tokenizer_, ChatImageFormat::from_pretrained(options.model, *tokenizer_, &source)));
    model_ = load_model(options.model, parallel, load_options_for(options.dtype, options.device));
    end_ids_ = end_token_ids_from_pretrained(options.model, *tokenizer_);
    engine_ = std::make_unique<Engine>(*model_, engine_options(options), parallel);
    limits_.default_max_tokens = options.default_max_tokens;
    if (!options.allow_local_images.empty()) limits_.local_image_dir = options.allow_local_images;
    model_name_ =
        options.model_name.empty() ? std::filesystem::path(options.model).filename().string() : options.model_name;
    if (model_name_.empty()) model_name_ = "vlmgen";
    fmt::print(stderr,
               "[serve] model {} ({}, vocab {}, tensor-parallel ranks {}); chat template {}; images: {}; "
               "end tokens {}\n",
               options.model, checkpoint_model_type(options.model), tokenizer_->vocab_size(), parallel.tp_size(),
               processor_->chat_template().name(), source, fmt::join(end_ids_, ","));
  }

  void install(httplib::Server& svr) {
    svr.set_payload_max_length(static_cast<size_t>(options_.max_body_bytes));
    svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (options_.api_key.empty() || req.path.rfind("/v1/", 0) != 0)
        return httplib::Server::HandlerResponse::Unhandled;
      if (req.get_header_value("Authorization") == "Bearer " + options_.api_key) {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      reply_error(res, ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", "", "authentication_error",
                                "invalid_api_key"));
      count_status(401);
      return httplib::Server::HandlerResponse::Handled;
    });
    svr.set_error_handler([this](const httplib::Request&, httplib::Response& res) {
      if (!res.body.empty()) return;
      if (res.status == 413) {
        reply_error(res, ApiError(413, fmt::format("request body is larger than --max-body-bytes {}",
                                                   options_.max_body_bytes)));
      } else if (res.status == 404) {
        reply_error(res, ApiError(404, "no such endpoint", "", "invalid_request_error", "not_found"));
      } else {
        reply_error(res, ApiError(res.status, "request failed"));
      }
      count_status(res.status);
    });
    svr.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
      const std::string broken = engine_->broken();  // the tensor-parallel ranks no longer step together
      if (broken.empty()) {
        res.set_content("{\"status\":\"ok\"}", "application/json");
        return;
      }
      res.status = 503;
      res.set_content(Json{{"status", "broken"}, {"reason", broken}}.dump(), "application/json");
    });
    svr.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
      Json body = {
          {"object", "list"},
          {"data",
           Json::array({{{"id", model_name_}, {"object", "model"}, {"created", created_}, {"owned_by", "vlmgen"}}})}};
      res.set_content(body.dump(), "application/json");
    });
    svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics_text(), "text/plain; version=0.0.4");
    });
    svr.Post("/v1/chat/completions",
             [this](const httplib::Request& req, httplib::Response& res) { chat_completions(req, res); });
  }

  /// From now on, new chat requests get 503.
  void drain() { draining_.store(true); }

  /// Cancels every request in flight (the grace period is over).
  void cancel_all() {
    std::lock_guard<std::mutex> lock(active_mu_);
    for (const auto& c : active_) {
      if (c->handle) c->handle->cancel();
    }
  }
  size_t in_flight() {
    std::lock_guard<std::mutex> lock(active_mu_);
    return active_.size();
  }

 private:
  static void reply_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    res.set_content(error_body(e).dump(), "application/json");
  }

  void count_status(int status) {
    std::lock_guard<std::mutex> lock(metrics_mu_);
    ++requests_by_status_[status];
  }

  void chat_completions(const httplib::Request& req, httplib::Response& res) {
    const int64_t number = next_id_.fetch_add(1);
    const std::string id = fmt::format("chatcmpl-{}", number);
    try {
      if (draining_.load()) throw ApiError(503, "the server is shutting down", "", "server_error", "shutting_down");
      Json body;
      try {
        // Depth first, on the raw text: a body nested thousands of levels deep never reaches the parser.
        check_json_limits(req.body, JsonLimits().max_bytes(options_.max_body_bytes), "the request body");
      } catch (const Error& e) {
        throw ApiError(400, e.what());
      }
      try {
        body = Json::parse(req.body);
      } catch (const Json::exception& e) {
        throw ApiError(400, fmt::format("the body is not valid JSON: {}", e.what()));
      }
      ChatRequest chat = parse_chat_request(body, limits_);
      decode_images(chat.messages);
      ChatPrompt prompt;
      try {
        prompt = processor_->build(chat.messages);
      } catch (const Error& e) {
        throw ApiError(400, e.what(), "messages");
      }
      const int64_t context = model_->traits().max_sequence_length;
      const auto prompt_tokens = static_cast<int64_t>(prompt.ids.size());
      if (context > 0 && prompt_tokens + chat.max_tokens > context) {
        throw ApiError(400,
                       fmt::format("the prompt has {} tokens and max_tokens is {}: {} in all, above the model's "
                                   "context of {} tokens",
                                   prompt_tokens, chat.max_tokens, prompt_tokens + chat.max_tokens, context),
                       "messages", "invalid_request_error", "context_length_exceeded");
      }
      if (engine_->metrics().waiting >= options_.max_waiting) {
        res.set_header("Retry-After", "1");
        throw ApiError(429, fmt::format("{} requests are waiting; try again later", options_.max_waiting), "",
                       "rate_limit_error", "queue_full");
      }
      auto completion = std::make_shared<Completion>(*tokenizer_, chat.stop, chat.logprobs);
      GenerateRequest request({prompt.ids}, prompt.vision);
      request.on_token = [completion](const TokenEvent& e) { return completion->on_token(e); };
      auto config = GenerationConfig()
                        .max_new_tokens(chat.max_tokens)
                        .temperature(chat.temperature)
                        .top_p(chat.top_p)
                        .seed(chat.seed)
                        .end_token_ids(end_ids_)
                        .return_logprobs(chat.logprobs)
                        .top_logprobs(chat.top_logprobs);
      try {
        completion->handle = engine_->submit(std::move(request), config);
      } catch (const Error& e) {
        const std::string broken = engine_->broken();
        if (!broken.empty()) {
          throw ApiError(503, "the server cannot serve requests any more: " + broken, "", "server_error",
                         "engine_stopped");
        }
        throw ApiError(400, e.what(), "messages");
      }
      {
        std::lock_guard<std::mutex> lock(active_mu_);
        active_.insert(completion);
      }
      if (chat.stream) {
        stream(res, id, chat, prompt_tokens, completion);
      } else {
        respond(res, id, chat, prompt_tokens, completion);
      }
    } catch (const ApiError& e) {
      reply_error(res, e);
      count_status(e.status);
      fmt::print(stderr, "[serve] {} {} {}\n", id, e.status, e.what());
    }
  }

  /// Images from data URLs decoded here, under the server's pixel limit, so an oversized picture
  /// is a 400 naming its message before anything is resized.
  void decode_images(std::vector<ChatMessage>& messages) const {
    for (size_t i = 0; i < messages.size(); ++i) {
      for (size_t j = 0; j < messages[i].content.size(); ++j) {
        ContentPart& part = messages[i].content[j];
        if (part.kind != ContentPart::Kind::kImageBytes && part.kind != ContentPart::Kind::kImageFile) continue;
        try {
          // A local file (behind --allow-local-images) is read here too, under the same limits.
          const std::string bytes = part.kind == ContentPart::Kind::kImageFile
                                        ? read_regular_file(part.text, "image file", options_.max_body_bytes)
                                        : std::move(part.text);
          Image image = decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                                     ImageLimits().max_pixels(options_.max_image_pixels));
          part.kind = ContentPart::Kind::kImagePixels;
          part.pixels = std::make_shared<const Image>(std::move(image));
          part.text.clear();
        } catch (const Error& e) {
          throw ApiError(400, fmt::format("the image cannot be used: {}", e.what()),
                         fmt::format("messages[{}].content[{}].image_url.url", i, j));
        }
      }
    }
  }

  Json usage(int64_t prompt_tokens, int64_t completion_tokens) const {
    return {{"prompt_tokens", prompt_tokens},
            {"completion_tokens", completion_tokens},
            {"total_tokens", prompt_tokens + completion_tokens}};
  }

  Json chunk(const std::string& id, const Json& delta, const Json& finish, const Json& logprobs = Json()) const {
    Json choice = {{"index", 0}, {"delta", delta}, {"finish_reason", finish}, {"logprobs", logprobs}};
    return {{"id", id},
            {"object", "chat.completion.chunk"},
            {"created", created_},
            {"model", model_name_},
            {"choices", Json::array({choice})}};
  }

  void respond(httplib::Response& res, const std::string& id, const ChatRequest& chat, int64_t prompt_tokens,
               const std::shared_ptr<Completion>& c) {
    GenerationResult result;
    try {
      result = c->handle->wait();
    } catch (const Error& e) {
      done(c);
      throw ApiError(500, fmt::format("generation failed: {}", e.what()), "", "server_error");
    }
    c->finish();
    const SequenceOutput& out = result.sequences.at(0);
    Json choice = {{"index", 0},
                   {"message", {{"role", "assistant"}, {"content", c->text}}},
                   {"finish_reason", finish_reason(*c, out.finish_reason)},
                   {"logprobs", Json()}};
    if (chat.logprobs) choice["logprobs"] = {{"content", c->logprobs}};  // top alternatives came with each token
    const auto completion_tokens = static_cast<int64_t>(out.tokens.size());
    Json body = {{"id", id},
                 {"object", "chat.completion"},
                 {"created", created_},
                 {"model", model_name_},
                 {"choices", Json::array({choice})},
                 {"usage", usage(prompt_tokens, completion_tokens)}};
    res.set_content(body.dump(), "application/json");
    finished(c, 200, prompt_tokens, completion_tokens);
    fmt::print(stderr, "[serve] {} 200 prompt {} completion {} {:.3f} s\n", id, prompt_tokens, completion_tokens,
               seconds_between(c->submitted, Clock::now()));
  }

  void stream(httplib::Response& res, const std::string& id, const ChatRequest& chat, int64_t prompt_tokens,
              const std::shared_ptr<Completion>& c) {
    auto role_sent = std::make_shared<bool>(false);
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, id, chat, prompt_tokens, c, role_sent](size_t, httplib::DataSink& sink) {
          auto write = [&](const std::string& s) { return sink.write(s.data(), s.size()); };
          if (!*role_sent) {
            *role_sent = true;
            return write(sse(chunk(id, {{"role", "assistant"}, {"content", ""}}, Json())));
          }
          std::string delta;
          Json logprobs;
          bool ended = false;
          {
            std::unique_lock<std::mutex> lock(c->mu);
            c->cv.wait_for(lock, std::chrono::milliseconds(50),
                           [&] { return c->text.size() > c->sent || c->handle->done(); });
            ended = c->handle->done();
            delta = c->text.substr(c->sent);
            c->sent = c->text.size();
            if (c->want_logprobs && c->logprobs.size() > c->logprobs_sent) {
              logprobs = {{"content", Json(std::vector<Json>(c->logprobs.begin() + static_cast<long>(c->logprobs_sent),
                                                             c->logprobs.end()))}};
              c->logprobs_sent = c->logprobs.size();
            }
          }
          if ((!delta.empty() || !logprobs.is_null()) &&
              !write(sse(chunk(id, {{"content", delta}}, Json(), logprobs)))) {
            return false;
          }
          if (!ended) return true;
          GenerationResult result;
          try {
            result = c->handle->wait();
          } catch (const Error& e) {
            write(sse(error_body(ApiError(500, fmt::format("generation failed: {}", e.what()), "", "server_error"))));
            record(c, 500, prompt_tokens, 0);  // counted before the client can see the end
            write("data: [DONE]\n\n");
            sink.done();
            done(c);  // in flight (a draining server waits) until the last bytes are out
            return true;
          }
          c->finish();
          std::string rest;
          {
            std::lock_guard<std::mutex> lock(c->mu);
            rest = c->text.substr(c->sent);
            c->sent = c->text.size();
          }
          if (!rest.empty()) write(sse(chunk(id, {{"content", rest}}, Json())));
          const SequenceOutput& out = result.sequences.at(0);
          write(sse(chunk(id, Json::object(), finish_reason(*c, out.finish_reason))));
          const auto completion_tokens = static_cast<int64_t>(out.tokens.size());
          if (chat.include_usage) {
            write(sse({{"id", id},
                       {"object", "chat.completion.chunk"},
                       {"created", created_},
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
          fmt::print(stderr, "[serve] {} 200 (stream) prompt {} completion {} {:.3f} s\n", id, prompt_tokens,
                     completion_tokens, seconds_between(c->submitted, Clock::now()));
          return true;
        },
        [this, id, c](bool success) {
          if (success) return;
          // The client went away: cancel, and account for the request once the engine ends it.
          c->handle->cancel();
          try {
            c->handle->wait();
          } catch (const std::exception&) {
          }
          finished(c, 499, 0, 0);
          fmt::print(stderr, "[serve] {} 499 client closed the stream; cancelled\n", id);
        });
  }

  void done(const std::shared_ptr<Completion>& c) {
    std::lock_guard<std::mutex> lock(active_mu_);
    active_.erase(c);
  }

  void finished(const std::shared_ptr<Completion>& c, int status, int64_t prompt_tokens, int64_t completion_tokens) {
    done(c);
    record(c, status, prompt_tokens, completion_tokens);
  }

  /// The request's figures in /metrics.
  void record(const std::shared_ptr<Completion>& c, int status, int64_t prompt_tokens, int64_t completion_tokens) {
    std::lock_guard<std::mutex> lock(metrics_mu_);
    ++requests_by_status_[status];
    prompt_tokens_ += prompt_tokens;
    generation_tokens_ += completion_tokens;
    std::lock_guard<std::mutex> c_lock(c->mu);
    if (c->tokens > 0) ttft_.observe(seconds_between(c->submitted, c->first_token));
    for (double gap : c->token_gaps) per_token_.observe(gap);
  }

  std::string metrics_text() {
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

  Options options_;
  std::unique_ptr<CausalVlm> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<ChatProcessor> processor_;
  std::vector<int64_t> end_ids_;
  std::unique_ptr<Engine> engine_;
  RequestLimits limits_;
  std::string model_name_;
  int64_t created_ = static_cast<int64_t>(std::time(nullptr));
  std::atomic<int64_t> next_id_{1};
  std::atomic<bool> draining_{false};
  std::mutex active_mu_;
  std::set<std::shared_ptr<Completion>> active_;
  std::mutex metrics_mu_;
  std::map<int, int64_t> requests_by_status_;
  int64_t prompt_tokens_ = 0;
  int64_t generation_tokens_ = 0;
  Histogram ttft_{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  Histogram per_token_{{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};
};

std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal.store(sig); }

// A rank other than 0 under --nproc: its shard of the model and an engine that runs rank 0's
// plans, until rank 0's engine stops. Signals (the launcher passes them to every rank) are
// left to rank 0, which drains and then stops the engines.
int follow(const Options& o, const ParallelContext& parallel) {
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  auto model = load_model(o.model, parallel, load_options_for(o.dtype, o.device));
  Engine engine(*model, engine_options(o), parallel);
  engine.join();
  return 0;
}

}  // namespace
}  // namespace vlmgen::serve

int main(int argc, char** argv) {
  using namespace vlmgen::serve;  // NOLINT(google-build-using-namespace)
  CLI::App app("vlmgen-serve: an OpenAI-compatible chat-completions server");
  Options o;
  app.add_option("--model", o.model, "HF checkpoint folder: config.json, *.safetensors, tokenizer.json, chat template")
      ->required();
  app.add_option("--served-model-name", o.model_name, "the model id clients see (default: the folder's name)");
  app.add_option("--host", o.host, "address to listen on")->capture_default_str();
  app.add_option("--dtype", o.dtype,
                 "weights of the language model: f32, bf16 (half the bytes a decode step reads), f16, or fp8 (an FP8 "
                 "checkpoint's linears kept as bytes, the rest bf16; CPU)")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "fp8"}))
      ->capture_default_str();
  app.add_option("--device", o.device,
                 "cpu, cuda or cuda:N (with --nproc, 'cuda' gives each rank the device of its local rank; use "
                 "--dtype bf16 there)")
      ->capture_default_str();
  app.add_option("--port", o.port, "port to listen on (0: any free port; the chosen one is printed)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  app.add_option("--max-running", o.max_running, "requests stepping at once")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-waiting", o.max_waiting, "requests queued before new ones get 429")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--kv-cache-bytes", o.kv_cache_bytes, "KV-cache bytes all running requests share")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-body-bytes", o.max_body_bytes, "largest request body (413 above)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--max-image-pixels", o.max_image_pixels, "largest decoded image, width x height (400 above)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--default-max-tokens", o.default_max_tokens, "max_tokens when a request gives none")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--api-key", o.api_key, "require Authorization: Bearer KEY on /v1/*");
  app.add_option("--allow-local-images", o.allow_local_images, "serve image_url paths inside this folder")
      ->check(CLI::ExistingDirectory);
  app.add_option("--grace-seconds", o.grace_seconds, "on SIGINT/SIGTERM, how long in-flight requests may finish")
      ->capture_default_str();
  app.add_option("--threads", o.threads, "HTTP worker threads (connections served at once)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--nproc", o.nproc,
                 "tensor-parallel ranks to start on this machine (rank 0 serves HTTP and schedules; the others run "
                 "its plan)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--timeout", o.timeout_s, "seconds a rank waits for its peers")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  const bool in_a_launch = std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr;
  try {
    vlmgen::LaunchOptions launch;
    launch.timeout = std::chrono::hours(24 * 365);
    launch.forward_signals = true;  // rank 0 drains on SIGTERM, then every rank exits
    if (auto status = vlmgen::relaunch_as_local_ranks(o.nproc, argc, argv, launch)) return *status;
  } catch (const vlmgen::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  if (in_a_launch) {  // the launcher passes signals on to every rank, even while they connect and load
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
  }
  try {
    vlmgen::ParallelContext parallel = vlmgen::ParallelContext::single();
    if (in_a_launch) {
      parallel =
          vlmgen::init_parallel_from_env(0, vlmgen::DistributedOptions().timeout(std::chrono::seconds(o.timeout_s)));
    }
    if (parallel.tp_rank() != 0) return follow(o, parallel);
    // From here a signal drains the server once it listens (the launcher passes signals on to
    // every rank, possibly while the model still loads).
    std::signal(SIGINT, on_signal);
    std::signal(SIGTERM, on_signal);
    Server server(o, parallel);
    httplib::Server svr;
    const int threads = o.threads;
    svr.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
    server.install(svr);
    const int port = o.port == 0 ? svr.bind_to_any_port(o.host) : (svr.bind_to_port(o.host, o.port) ? o.port : -1);
    if (port < 0) {
      fmt::print(stderr, "error: cannot listen on {}:{}\n", o.host, o.port);
      return 1;
    }
    std::signal(SIGPIPE, SIG_IGN);
    std::thread watcher([&] {
      while (g_signal.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (g_signal.load() > 0) {
        // Drain: new requests get 503, the ones in flight (streams included) run to their end
        // within the grace period and are cancelled after it; then the listener stops.
        server.drain();
        fmt::print(stderr, "[serve] signal {}: refusing new requests; {} in flight get {} s\n", g_signal.load(),
                   server.in_flight(), o.grace_seconds);
        auto wait_until = [&](double seconds) {
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
          while (server.in_flight() > 0 && std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
        };
        wait_until(o.grace_seconds);
        if (server.in_flight() > 0) {
          fmt::print(stderr, "[serve] grace period over: cancelling {} requests\n", server.in_flight());
          server.cancel_all();
          wait_until(5.0);
        }
      }
      svr.stop();
    });
    fmt::print("vlmgen-serve: listening on http://{}:{}\n", o.host, port);
    std::fflush(stdout);
    svr.listen_after_bind();
    if (g_signal.load() == 0) g_signal.store(-1);  // listen ended on its own: let the watcher go
    watcher.join();
    fmt::print(stderr, "[serve] stopped\n");
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
