// vlmgen-serve's HTTP side: loading the model and the engine, the routes (API key, errors, /health,
// /v1/models, /metrics, /v1/chat/completions) and the checks a chat request passes before it is
// submitted. The replies themselves are in server_replies.cpp.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <filesystem>

#include "serve_internal.h"
#include "vlmgen/error.h"
#include "vlmgen/image/image.h"
#include "vlmgen/image/preprocessor_config.h"
#include "vlmgen/io/files.h"
#include "vlmgen/io/json.h"
#include "vlmgen/models/load_model.h"

namespace vlmgen::serve {

Server::Server(const Options& options, const ParallelContext& parallel) : options_(options) {
  // The tokenizer, template and image format first: a folder vlmgen cannot write prompts for
  // fails before its weights are read.
  tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_pretrained(options.model));
  std::string source;
  processor_ = std::make_unique<ChatProcessor>(ChatProcessor::from_pretrained(
      options.model, *tokenizer_, ChatImageFormat::from_pretrained(options.model, *tokenizer_, &source)));
  model_ = load_model(options.model, parallel, load_options_for(options.dtype, options.device, options.kv_dtype));
  end_ids_ = end_token_ids_from_pretrained(options.model, *tokenizer_);
  engine_ = std::make_unique<Engine>(*model_, engine_options(options), parallel);
  limits_.default_max_tokens = options.default_max_tokens;
  limits_.max_images = options.max_images;
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

void Server::install(httplib::Server& svr) {
  svr.set_payload_max_length(static_cast<size_t>(options_.max_body_bytes));
  // Before a body is read: the key, then what the body may be.
  svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    auto refuse = [&](const ApiError& e) {
      // The body stays unread, so the connection cannot carry another request: the client is
      // told not to reuse it (the HTTP library, 0.11.4, answers nothing more on it).
      reply_error(res, e);
      res.set_header("Connection", "close");
      count_status(e.status);
      return httplib::Server::HandlerResponse::Handled;
    };
    if (!options_.api_key.empty() && req.path.rfind("/v1/", 0) == 0 &&
        req.get_header_value("Authorization") != "Bearer " + options_.api_key) {
      return refuse(ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", "", "authentication_error",
                             "invalid_api_key"));
    }
    if (req.method != "GET" && req.method != "HEAD" && req.method != "POST") {
      // The HTTP library reads a PUT's, PATCH's or DELETE's body before it finds no route, with
      // no limit: refused first.
      res.set_header("Allow", "GET, HEAD, POST");
      return refuse(ApiError(405, fmt::format("method {} is not served (GET or POST)", req.method.substr(0, 16)), "",
                             "invalid_request_error", "method_not_allowed"));
    }
    if (const ApiError* e = body_refusal(req)) return refuse(*e);
    return httplib::Server::HandlerResponse::Unhandled;
  });
  svr.set_error_handler([this](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (res.status == 413) {
      reply_error(
          res, ApiError(413, fmt::format("request body is larger than --max-body-bytes {}", options_.max_body_bytes)));
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
    res.set_content(json_text(Json{{"status", "broken"}, {"reason", broken}}), "application/json");
  });
  svr.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    Json body = {
        {"object", "list"},
        {"data",
         Json::array({{{"id", model_name_}, {"object", "model"}, {"created", created_}, {"owned_by", "vlmgen"}}})}};
    res.set_content(json_text(body), "application/json");
  });
  svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_text(), "text/plain; version=0.0.4");
  });
  svr.Post("/v1/chat/completions",
           [this](const httplib::Request& req, httplib::Response& res) { chat_completions(req, res); });
}

const ApiError* Server::body_refusal(const httplib::Request& req) const {
  // --max-body-bytes holds for bodies with a Content-Length only: a compressed body would be
  // inflated, and a chunked one read, whole before any check.
  static const ApiError compressed(415, "request bodies are read as sent: no Content-Encoding (send plain JSON)", "",
                                   "invalid_request_error", "unsupported_content_encoding");
  static const ApiError unsized(
      411, "a request body needs a Content-Length and no Transfer-Encoding (chunked bodies are not read)", "",
      "invalid_request_error", "length_required");
  static const ApiError not_json(415, "the request body must be JSON (Content-Type: application/json)", "",
                                 "invalid_request_error", "unsupported_media_type");
  if (req.method != "POST") return nullptr;  // GET and HEAD bodies are not read (others are refused)
  // A value in lower case, without its parameters (application/json; charset=utf-8).
  auto value = [&](const char* header) {
    std::string v = req.get_header_value(header);
    v = v.substr(0, v.find(';'));
    while (!v.empty() && v.back() == ' ') v.pop_back();
    for (char& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return v;
  };
  const std::string encoding = value("Content-Encoding");
  if (!encoding.empty() && encoding != "identity") return &compressed;
  // Chunked (with or without a Content-Length beside it) or unsized (read until the client
  // closes): neither is held to --max-body-bytes by the HTTP library.
  if (req.has_header("Transfer-Encoding") || !req.has_header("Content-Length")) return &unsized;
  // A form body (curl -d's default type) the HTTP library would answer 413 past 8 KiB.
  const std::string type = value("Content-Type");
  if (!type.empty() && type != "application/json") return &not_json;
  return nullptr;
}

void Server::chat_completions(const httplib::Request& req, httplib::Response& res) {
  try {
    admit_chat(req, res);
  } catch (const std::exception& e) {  // not a refusal of the request: a failure of ours, said so
    reply_error(res, ApiError(500, fmt::format("the server failed on this request: {}", e.what()), "", "server_error"));
    count_status(500);
    log_line("[serve] 500 {}\n", e.what());
  }
}

void Server::admit_chat(const httplib::Request& req, httplib::Response& res) {
  const int64_t number = next_id_.fetch_add(1);
  const std::string id = fmt::format("chatcmpl-{}", number);
  // Refused at once while draining, without touching the count a drain waits on.
  if (draining_.load()) {
    const ApiError refusal(503, "the server is shutting down", "", "server_error", "shutting_down");
    reply_error(res, refusal);
    count_status(refusal.status);
    log_line("[serve] {} {} {}\n", id, refusal.status, refusal.what());
    return;
  }
  struct Admitting {  // in flight from the draining check until it is in active_, or refused
    std::atomic<int64_t>& count;
    bool counted = true;
    void done() {
      if (counted) count.fetch_sub(1);
      counted = false;
    }
    ~Admitting() { done(); }
  } admitting{admitting_};
  admitting_.fetch_add(1);
  try {
    if (draining_.load()) throw ApiError(503, "the server is shutting down", "", "server_error", "shutting_down");
    // A connection that may generate, taken before any work and held until the request ends
    // (its Completion, kept by the stream's callbacks, holds it).
    const int slots = options_.threads - kReservedThreads;
    if (generating_.fetch_add(1) >= slots) {
      generating_.fetch_sub(1);
      res.set_header("Retry-After", "1");
      throw ApiError(429,
                     fmt::format("all {} connections that may generate are busy (--threads {} keeps {} for /health, "
                                 "/metrics and refusals); try again later",
                                 slots, options_.threads, kReservedThreads),
                     "", "rate_limit_error", "connections_busy");
    }
    const std::shared_ptr<const void> slot(nullptr, [this](const void*) { generating_.fetch_sub(1); });
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
    // No max_tokens asked for: --default-max-tokens, or the context the prompt leaves if less.
    if (!chat.max_tokens_given && context > 0 && prompt_tokens < context) {
      chat.max_tokens = std::min(chat.max_tokens, context - prompt_tokens);
    }
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
    completion->slot = slot;
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
      admitting.done();
      if (cancelled_all_) completion->handle->cancel();  // admitted after the grace period ended
    }
    if (chat.stream) {
      stream(res, id, chat, prompt_tokens, completion);
    } else {
      respond(res, id, chat, prompt_tokens, completion);
    }
  } catch (const ApiError& e) {
    reply_error(res, e);
    count_status(e.status);
    log_line("[serve] {} {} {}\n", id, e.status, e.what());
  }
}

void Server::decode_images(std::vector<ChatMessage>& messages) const {
  int64_t total_pixels = 0;
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
        total_pixels += image.width * image.height;
        if (total_pixels > options_.max_total_image_pixels) {
          throw Error(
              fmt::format("the request's images up to this one hold {} pixels, above "
                          "--max-total-image-pixels {}",
                          total_pixels, options_.max_total_image_pixels));
        }
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

}  // namespace vlmgen::serve
