#pragma once

// The OpenAI chat-completions request as vlmgen-serve reads it: JSON in, chat messages and
// generation options out, or an ApiError that names the offending field (OpenAI's error object).
// Also the stop-string matcher the streams use. Header-only, used by vlmgen-serve (tools/serve).

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "vlmgen/text/chat.h"

namespace vlmgen::serve {

using Json = nlohmann::json;

/// An HTTP error with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}.
struct ApiError : std::runtime_error {
  ApiError(int status_, const std::string& message, std::string param_ = "",
           std::string type_ = "invalid_request_error", std::string code_ = "")
      : std::runtime_error(message),
        status(status_),
        param(std::move(param_)),
        type(std::move(type_)),
        code(std::move(code_)) {}
  int status;
  std::string param;
  std::string type;
  std::string code;
};

/// A reply's JSON text: bytes that are not UTF-8 (a parser's message quoting the body, a name cut
/// inside a character) become U+FFFD instead of failing the reply.
inline std::string json_text(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

inline Json error_body(const ApiError& e) {
  return {{"error",
           {{"message", e.what()},
            {"type", e.type},
            {"param", e.param.empty() ? Json() : Json(e.param)},
            {"code", e.code.empty() ? Json() : Json(e.code)}}}};
}

/// Strict standard base64 (A-Z a-z 0-9 + /, '=' padding to a multiple of 4); std::nullopt for
/// anything else.
inline std::optional<std::string> decode_base64(const std::string& in) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  if (in.empty() || in.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(in.size() / 4 * 3);
  for (size_t i = 0; i < in.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int j = 0; j < 4; ++j) {
      const char c = in[i + j];
      if (c == '=') {
        // Padding only in the last group, only at its end.
        if (i + 4 != in.size() || j < 2) return std::nullopt;
        ++pad;
        v[j] = 0;
        continue;
      }
      if (pad > 0) return std::nullopt;
      v[j] = value(c);
      if (v[j] < 0) return std::nullopt;
    }
    const uint32_t n = (uint32_t(v[0]) << 18) | (uint32_t(v[1]) << 12) | (uint32_t(v[2]) << 6) | uint32_t(v[3]);
    out.push_back(static_cast<char>(n >> 16));
    if (pad < 2) out.push_back(static_cast<char>((n >> 8) & 0xff));
    if (pad < 1) out.push_back(static_cast<char>(n & 0xff));
  }
  return out;
}

/// What the server allows.
struct RequestLimits {
  int64_t default_max_tokens = 256;
  int64_t max_max_tokens = 1 << 20;
  size_t max_messages = 4096;
  size_t max_stop = 4;
  size_t max_stop_bytes = 256;
  int64_t max_top_logprobs = 20;
  /// Images in one request (counted before any is decoded).
  int64_t max_images = 16;
  /// Local image paths are read only from inside this folder (none: refused).
  std::optional<std::filesystem::path> local_image_dir;
};

/// A chat-completions request, checked.
struct ChatRequest {
  std::vector<ChatMessage> messages;
  int64_t max_tokens = 0;
  bool max_tokens_given = false;  // false: the server's default, cut to the context left
  double temperature = 1.0;
  double top_p = 1.0;
  uint64_t seed = 0;  // a fresh random one where the request gives none
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;
  int64_t top_logprobs = 0;
  int64_t images = 0;
};

namespace detail_protocol {

inline const Json* field(const Json& body, const char* key) {
  auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

inline std::string type_name(const Json& v) { return v.type_name(); }

/// An image part's URL: a data: URL with base64 PNG/JPEG, or (behind local_image_dir) a path
/// inside that folder.
inline void add_image(ChatMessage& message, const std::string& url, const std::string& param,
                      const RequestLimits& limits) {
  const std::string data_prefix = "data:";
  if (url.rfind(data_prefix, 0) == 0) {
    const size_t comma = url.find(',');
    if (comma == std::string::npos) throw ApiError(400, "image data URL has no ',' before its data", param);
    const std::string header = url.substr(data_prefix.size(), comma - data_prefix.size());
    if (header != "image/png;base64" && header != "image/jpeg;base64" && header != "image/jpg;base64") {
      throw ApiError(400,
                     "image data URL must be data:image/png;base64,... or data:image/jpeg;base64,..., got data:" +
                         header.substr(0, 64),
                     param);
    }
    std::optional<std::string> bytes = decode_base64(url.substr(comma + 1));
    if (!bytes) throw ApiError(400, "image data URL holds invalid base64", param);
    message.image_bytes(std::move(*bytes));
    return;
  }
  if (url.rfind("http://", 0) == 0 || url.rfind("https://", 0) == 0) {
    throw ApiError(400, "remote image URLs are not fetched; send the image as a data:image/...;base64 URL", param);
  }
  if (!limits.local_image_dir) {
    throw ApiError(400, "image URL must be a data:image/...;base64 URL (local paths need --allow-local-images)", param);
  }
  std::string path = url.rfind("file://", 0) == 0 ? url.substr(7) : url;
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::weakly_canonical(*limits.local_image_dir, ec);
  const std::filesystem::path file = std::filesystem::weakly_canonical(std::filesystem::path(path), ec);
  if (ec) throw ApiError(400, "image path cannot be resolved", param);
  auto rel = file.lexically_relative(dir);
  if (rel.empty() || *rel.begin() == ".." || rel.is_absolute()) {
    throw ApiError(400, "image path is outside the folder allowed by --allow-local-images", param);
  }
  if (!std::filesystem::is_regular_file(file, ec)) throw ApiError(400, "image path is not a file", param);
  message.image_file(file.string());
}

}  // namespace detail_protocol

/// Reads a chat-completions body. Throws ApiError(400) naming the field for anything it cannot
/// serve.
inline ChatRequest parse_chat_request(const Json& body, const RequestLimits& limits) {
  using detail_protocol::field;
  if (!body.is_object())
    throw ApiError(400, std::string("the request body must be a JSON object, got ") + body.type_name());
  ChatRequest r;
  const Json* messages = field(body, "messages");
  if (messages == nullptr) throw ApiError(400, "'messages' is required", "messages");
  if (!messages->is_array())
    throw ApiError(400, std::string("'messages' must be an array, got ") + messages->type_name(), "messages");
  if (messages->empty()) throw ApiError(400, "'messages' must not be empty", "messages");
  if (messages->size() > limits.max_messages) {
    throw ApiError(400,
                   "'messages' has " + std::to_string(messages->size()) + " entries, at most " +
                       std::to_string(limits.max_messages) + " are served",
                   "messages");
  }
  for (size_t i = 0; i < messages->size(); ++i) {
    const Json& m = (*messages)[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) throw ApiError(400, at + " must be an object, got " + m.type_name(), at);
    const Json* role = field(m, "role");
    if (role == nullptr || !role->is_string()) throw ApiError(400, at + ".role must be a string", at + ".role");
    const std::string role_name = role->get<std::string>();
    if (role_name != "system" && role_name != "user" && role_name != "assistant") {
      throw ApiError(400, at + ".role '" + role_name.substr(0, 32) + "' is not one of system, user, assistant",
                     at + ".role");
    }
    const Json* content = field(m, "content");
    if (content == nullptr) throw ApiError(400, at + ".content is required", at + ".content");
    if (content->is_string()) {
      r.messages.emplace_back(role_name, content->get<std::string>());
      continue;
    }
    if (!content->is_array()) {
      throw ApiError(400, at + ".content must be a string or an array of parts, got " + content->type_name(),
                     at + ".content");
    }
    if (content->empty()) throw ApiError(400, at + ".content must not be an empty array", at + ".content");
    ChatMessage message(role_name);
    for (size_t j = 0; j < content->size(); ++j) {
      const Json& part = (*content)[j];
      const std::string pat = at + ".content[" + std::to_string(j) + "]";
      if (!part.is_object()) throw ApiError(400, pat + " must be an object", pat);
      const Json* type = field(part, "type");
      if (type == nullptr || !type->is_string()) throw ApiError(400, pat + ".type must be a string", pat + ".type");
      const std::string kind = type->get<std::string>();
      if (kind == "text") {
        const Json* text = field(part, "text");
        if (text == nullptr || !text->is_string()) throw ApiError(400, pat + ".text must be a string", pat + ".text");
        message.text(text->get<std::string>());
      } else if (kind == "image_url") {
        if (role_name != "user") throw ApiError(400, "only user messages may carry images", pat);
        const Json* image = field(part, "image_url");
        const Json* url = image == nullptr ? nullptr : image->is_string() ? image : field(*image, "url");
        if (url == nullptr || !url->is_string()) {
          throw ApiError(400, pat + ".image_url.url must be a string", pat + ".image_url.url");
        }
        if (r.images >= limits.max_images) {
          throw ApiError(400,
                         "the request carries more than " + std::to_string(limits.max_images) +
                             " images (--max-images); image " + std::to_string(r.images + 1) + " is " + pat,
                         "messages");
        }
        detail_protocol::add_image(message, url->get<std::string>(), pat + ".image_url.url", limits);
        ++r.images;
      } else {
        throw ApiError(400, pat + ".type '" + kind.substr(0, 32) + "' is not served (text or image_url)",
                       pat + ".type");
      }
    }
    r.messages.push_back(std::move(message));
  }

  auto integer = [&](const char* key, int64_t lo, int64_t hi) -> std::optional<int64_t> {
    const Json* v = field(body, key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number_integer()) throw ApiError(400, std::string("'") + key + "' must be an integer", key);
    // An unsigned value above int64's range is out of range too (not wrapped to a negative one).
    const bool huge = v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX);
    const int64_t x = huge ? INT64_MAX : v->get<int64_t>();
    if (huge || x < lo || x > hi) {
      throw ApiError(400,
                     std::string("'") + key + "' is " + v->dump() + ", expected " + std::to_string(lo) + " to " +
                         std::to_string(hi),
                     key);
    }
    return x;
  };
  auto number = [&](const char* key, double lo, double hi) -> std::optional<double> {
    const Json* v = field(body, key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_number()) throw ApiError(400, std::string("'") + key + "' must be a number", key);
    const double x = v->get<double>();
    if (!(x >= lo && x <= hi)) {
      auto shortest = [](double d) {  // 1e-09, not to_string's 0.000000
        char text[32];
        std::snprintf(text, sizeof(text), "%g", d);
        return std::string(text);
      };
      throw ApiError(
          400,
          std::string("'") + key + "' is " + v->dump() + ", out of range [" + shortest(lo) + ", " + shortest(hi) + "]",
          key);
    }
    return x;
  };
  auto boolean = [&](const Json& object, const char* key, const std::string& name) -> bool {
    const Json* v = field(object, key);
    if (v == nullptr) return false;
    if (!v->is_boolean()) throw ApiError(400, "'" + name + "' must be a boolean", name);
    return v->get<bool>();
  };

  if (auto n = integer("n", 1, 1000)) {
    if (*n != 1) throw ApiError(400, "'n' must be 1 (one choice per request)", "n");
  }
  // Both checked when both are given; max_completion_tokens (the newer name) wins.
  auto max_tokens = integer("max_completion_tokens", 1, limits.max_max_tokens);
  const auto legacy_max_tokens = integer("max_tokens", 1, limits.max_max_tokens);
  if (!max_tokens) max_tokens = legacy_max_tokens;
  r.max_tokens = max_tokens.value_or(limits.default_max_tokens);
  r.max_tokens_given = max_tokens.has_value();
  r.temperature = number("temperature", 0.0, 2.0).value_or(1.0);
  r.top_p = number("top_p", 1e-9, 1.0).value_or(1.0);
  if (const Json* seed = field(body, "seed")) {
    if (!seed->is_number_integer()) throw ApiError(400, "'seed' must be an integer", "seed");
    r.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : static_cast<uint64_t>(seed->get<int64_t>());
  } else {  // as OpenAI's API: without a seed, each request samples afresh
    std::random_device entropy;
    r.seed = (static_cast<uint64_t>(entropy()) << 32) ^ entropy();
  }
  if (const Json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      r.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const Json& s : *stop) {
        if (!s.is_string()) throw ApiError(400, "'stop' entries must be strings", "stop");
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      throw ApiError(400, "'stop' must be a string or an array of strings", "stop");
    }
    if (r.stop.size() > limits.max_stop) {
      throw ApiError(
          400, "'stop' has " + std::to_string(r.stop.size()) + " strings, at most " + std::to_string(limits.max_stop),
          "stop");
    }
    for (const std::string& s : r.stop) {
      if (s.empty() || s.size() > limits.max_stop_bytes) {
        throw ApiError(400, "'stop' strings must have 1 to " + std::to_string(limits.max_stop_bytes) + " bytes",
                       "stop");
      }
    }
  }
  r.stream = boolean(body, "stream", "stream");
  if (const Json* options = field(body, "stream_options")) {
    if (!options->is_object()) throw ApiError(400, "'stream_options' must be an object", "stream_options");
    if (!r.stream) throw ApiError(400, "'stream_options' is only allowed with stream: true", "stream_options");
    r.include_usage = boolean(*options, "include_usage", "stream_options.include_usage");
  }
  r.logprobs = boolean(body, "logprobs", "logprobs");
  if (auto top = integer("top_logprobs", 0, limits.max_top_logprobs)) {
    if (!r.logprobs) throw ApiError(400, "'top_logprobs' needs logprobs: true", "top_logprobs");
    r.top_logprobs = *top;
  }
  // Penalties vlmgen does not apply: their default (0) is accepted, anything else refused rather
  // than silently sampled without.
  for (const char* penalty : {"frequency_penalty", "presence_penalty"}) {
    if (number(penalty, -2.0, 2.0).value_or(0.0) != 0.0) {
      throw ApiError(400, std::string("'") + penalty + "' is not supported by vlmgen-serve (only 0)", penalty);
    }
  }
  for (const char* unsupported : {"tools", "tool_choice", "functions", "response_format", "logit_bias"}) {
    if (field(body, unsupported) != nullptr) {
      throw ApiError(400, std::string("'") + unsupported + "' is not supported by vlmgen-serve", unsupported);
    }
  }
  return r;
}

/// Cuts generated text at the first of the stop strings, also when a stop string spans several
/// tokens: text that could still begin a stop string is held back until it cannot.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

  /// Adds a piece; returns the text that is final now. Sets *stopped when a stop string
  /// appeared (the text before it is returned; nothing after it ever is).
  std::string feed(const std::string& piece, bool* stopped) {
    *stopped = false;
    if (done_) return {};
    buffer_ += piece;
    if (stops_.empty()) return std::exchange(buffer_, {});
    size_t first = std::string::npos;
    for (const std::string& s : stops_) first = std::min(first, buffer_.find(s));
    if (first != std::string::npos) {
      done_ = true;
      *stopped = true;
      std::string out = buffer_.substr(0, first);
      buffer_.clear();
      return out;
    }
    // Hold back the longest suffix that is a proper prefix of a stop string.
    size_t keep = 0;
    for (const std::string& s : stops_) {
      for (size_t len = std::min(s.size() - 1, buffer_.size()); len > keep; --len) {
        if (buffer_.compare(buffer_.size() - len, len, s, 0, len) == 0) {
          keep = len;
          break;
        }
      }
    }
    std::string out = buffer_.substr(0, buffer_.size() - keep);
    buffer_.erase(0, buffer_.size() - keep);
    return out;
  }
  /// The end of the stream: what was held back (nothing after a stop string).
  std::string flush() { return done_ ? std::string() : std::exchange(buffer_, {}); }
  bool stopped() const { return done_; }

 private:
  std::vector<std::string> stops_;
  std::string buffer_;
  bool done_ = false;
};

}  // namespace vlmgen::serve
