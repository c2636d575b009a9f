#include "vlmgen/io/json.h"

#include <algorithm>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "json_parse.h"
#include "vlmgen/error.h"

namespace vlmgen {

void check_json_limits(std::string_view text, const JsonLimits& limits, const std::string& what) {
  VLMGEN_CHECK(static_cast<uint64_t>(text.size()) <= static_cast<uint64_t>(limits.max_bytes()),
               "{}: JSON text of {} bytes exceeds the limit of {} bytes", what, text.size(), limits.max_bytes());
  int64_t depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // an escaped quote does not end the string
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"': in_string = true; break;
      case '[':
      case '{':
        VLMGEN_CHECK(++depth <= limits.max_depth(),
                     "{}: JSON nests deeper than the limit of {} levels (depth {} reached at byte {})", what,
                     limits.max_depth(), depth, i);
        break;
      case ']':
      case '}':
        // Unbalanced closers are the parser's to report; never let them hide a deep prefix.
        if (depth > 0) --depth;
        break;
      default: break;
    }
  }
}

std::string quote_excerpt(std::string_view text, size_t max_chars) {
  std::string out;
  const size_t n = std::min(text.size(), max_chars);
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  if (text.size() > max_chars) out += fmt::format("... ({} bytes in all)", text.size());
  return out;
}

namespace detail {

nlohmann::json parse_json(std::string_view text, const std::string& what, const JsonLimits& limits) {
  check_json_limits(text, limits, what);
  try {
    if (!limits.unique_keys()) return nlohmann::json::parse(text.begin(), text.end());
    std::vector<std::unordered_set<std::string>> open_objects;  // the keys seen in each enclosing object
    auto callback = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      if (event == nlohmann::json::parse_event_t::object_start) {
        open_objects.emplace_back();
      } else if (event == nlohmann::json::parse_event_t::object_end) {
        open_objects.pop_back();
      } else if (event == nlohmann::json::parse_event_t::key) {
        const auto& key = parsed.get_ref<const std::string&>();
        VLMGEN_CHECK(open_objects.back().insert(key).second,
                     "{}: the key '{}' appears twice in one object; each name must be given once", what,
                     quote_excerpt(key, 120));
      }
      return true;
    };
    return nlohmann::json::parse(text.begin(), text.end(), callback);
  } catch (const nlohmann::json::exception& e) {
    VLMGEN_FAIL("{}: not valid JSON ({} bytes): {}", what, text.size(), quote_excerpt(e.what(), 160));
  }
}

std::string json_excerpt(const nlohmann::json& value, size_t max_chars) {
  std::string text;
  try {
    text = value.dump();
  } catch (const nlohmann::json::exception&) {
    return fmt::format("<JSON {} that cannot be printed>", value.type_name());  // invalid UTF-8 in a string
  }
  return quote_excerpt(text, max_chars);
}

}  // namespace detail
}  // namespace vlmgen
