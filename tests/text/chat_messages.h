#pragma once

// Chat messages as a Jinja template sees them (JSON) and as vlmgen takes them, for the chat tests.

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "vlmgen/text/chat.h"

namespace vlmgen::testing_text {

inline nlohmann::json text_part(const std::string& t) { return nlohmann::json{{"type", "text"}, {"text", t}}; }
inline nlohmann::json image_part() { return nlohmann::json{{"type", "image"}}; }

/// The JSON messages a Jinja template sees → vlmgen messages (images as placeholders).
inline std::vector<ChatMessage> to_messages(const nlohmann::json& messages) {
  std::vector<ChatMessage> out;
  for (const nlohmann::json& m : messages) {
    if (m["content"].is_string()) {
      out.emplace_back(m["role"].get<std::string>(), m["content"].get<std::string>());
      continue;
    }
    ChatMessage message(m["role"].get<std::string>());
    for (const nlohmann::json& part : m["content"]) {
      if (part["type"] == "image") {
        message.image_placeholder();
      } else {
        message.text(part["text"].get<std::string>());
      }
    }
    out.push_back(std::move(message));
  }
  return out;
}

}  // namespace vlmgen::testing_text
