#pragma once

// Small readers of tokenizer.json nodes shared by tokenizer_load.cpp and tokenizer_pipeline.cpp
// (private to the library).

#include <nlohmann/json.hpp>
#include <string>

#include "../io/json_parse.h"
#include "vlmgen/error.h"

namespace vlmgen::detail {

/// A node's "type", or an excerpt of the node when it has none.
inline std::string type_of(const nlohmann::json& node) {
  if (!node.is_object()) return node.is_null() ? "null" : json_excerpt(node);
  const auto it = node.find("type");
  return it != node.end() && it->is_string() ? it->get<std::string>() : json_excerpt(node);
}

/// A boolean member, `fallback` when absent or null.
inline bool flag(const nlohmann::json& node, const char* key, bool fallback) {
  const auto it = node.find(key);
  if (it == node.end() || it->is_null()) return fallback;
  VLMGEN_CHECK(it->is_boolean(), "\"{}\" must be true or false, got {}", key, json_excerpt(*it));
  return it->get<bool>();
}

inline bool empty_or_null(const nlohmann::json& node, const char* key) {
  const auto it = node.find(key);
  return it == node.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty());
}

}  // namespace vlmgen::detail
