#pragma once

// The one JSON parser of the compiled library (private: nlohmann_json is not a public
// dependency). Every JSON text in src/ goes through parse_json.

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "vlmgen/io/json.h"

namespace vlmgen::detail {

/// Checks `text` against `limits` (check_json_limits), then parses it. Throws vlmgen::Error
/// naming `what` when a limit is exceeded or the text is not JSON; the parser's message is cut
/// short, as it quotes the offending token and a token can be megabytes long.
nlohmann::json parse_json(std::string_view text, const std::string& what, const JsonLimits& limits = JsonLimits());

/// A parsed value for an error message: its JSON text cut to `max_chars` (see quote_excerpt).
/// Safe on any value parse_json returned, as its depth is bounded.
std::string json_excerpt(const nlohmann::json& value, size_t max_chars = 64);

}  // namespace vlmgen::detail
