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
namespace {

/// A pass over JSON text that throws at the first object holding a key twice. Its own pass in
/// linear time: nlohmann's DOM parser with a callback walks the enclosing container's members
/// each time an object closes, quadratic in a header's tensor entries.
class UniqueKeys : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit UniqueKeys(const std::string& what) : what_(what) {}
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    open_objects_.emplace_back();
    return true;
  }
  bool key(string_t& key) override {
    VLMGEN_CHECK(open_objects_.back().insert(key).second,
                 "{}: the key '{}' appears twice in one object; each name must be given once", what_,
                 quote_excerpt(key, 120));
    return true;
  }
  bool end_object() override {
    open_objects_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  const std::string& what_;
  std::vector<std::unordered_set<std::string>> open_objects_;  // the keys seen in each enclosing object
};

}  // namespace

nlohmann::json parse_json(std::string_view text, const std::string& what, const JsonLimits& limits) {
  check_json_limits(text, limits, what);
  try {
    if (limits.unique_keys()) {
      UniqueKeys check(what);
      nlohmann::json::sax_parse(text.begin(), text.end(), &check);  // text that is not JSON: refused below
    }
    return nlohmann::json::parse(text.begin(), text.end());
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
