#pragma once

// Limits every JSON text vlmgen reads is held to (safetensors headers, checkpoint indexes,
// config.json, preprocessor_config.json). Size and depth are checked on the raw text before a
// parser sees it: a header nested thousands of levels deep otherwise overflows the stack in any
// recursive walk over the parsed value (dump, comparison, copy) and costs memory for nothing.
//
//   vlmgen::check_json_limits(text, vlmgen::JsonLimits().max_bytes(1 << 20), "config.json");

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace vlmgen {

/// Deepest nesting of arrays and objects vlmgen accepts by default. Real files need at most 4
/// (config.json: root, rope_scaling, mrope_section).
inline constexpr int64_t kMaxJsonDepth = 64;

/// Limits on one JSON text.
class JsonLimits {
 public:
  /// Deepest nesting of arrays and objects (the root container is depth 1). Default kMaxJsonDepth.
  JsonLimits& max_depth(int64_t value) {
    max_depth_ = value;
    return *this;
  }
  int64_t max_depth() const { return max_depth_; }

  /// Largest text in bytes. Default 16 MiB.
  JsonLimits& max_bytes(int64_t value) {
    max_bytes_ = value;
    return *this;
  }
  int64_t max_bytes() const { return max_bytes_; }

  /// Refuse any object in the text that holds a key twice (checked by the parser in a pass of
  /// its own, not by check_json_limits). Default false, as Python's json and nlohmann's parser
  /// take the last value (config files); true where a name must mean one thing (safetensors
  /// headers: tensor names, each entry's fields, __metadata__; a checkpoint index).
  JsonLimits& unique_keys(bool value) {
    unique_keys_ = value;
    return *this;
  }
  bool unique_keys() const { return unique_keys_; }

 private:
  int64_t max_depth_ = kMaxJsonDepth;
  int64_t max_bytes_ = int64_t{16} << 20;
  bool unique_keys_ = false;
};

/// Throws vlmgen::Error naming `what`, the limit and what came when `text` is longer than
/// limits.max_bytes() or nests deeper than limits.max_depth(). The depth is counted over the
/// brackets outside strings in one pass, without parsing; text that is not JSON at all passes
/// here and is refused by the parser.
void check_json_limits(std::string_view text, const JsonLimits& limits, const std::string& what);

/// At most `max_chars` bytes of `text` for an error message, with control and non-ASCII bytes
/// written as \xNN and "..." (plus the total length) when cut: untrusted text never goes into a
/// message whole.
std::string quote_excerpt(std::string_view text, size_t max_chars = 64);

}  // namespace vlmgen
