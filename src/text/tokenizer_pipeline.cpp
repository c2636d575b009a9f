// The normalizer, pre-tokenizer and decoder sections of tokenizer.json: what vlmgen implements of
// them, and a vlmgen::Error naming anything else.

#include <string_view>

#include "tokenizer_impl.h"
#include "tokenizer_json.h"

namespace vlmgen::detail {

namespace {

using nlohmann::json;

// The pre-tokenizer regex of ByteLevel with use_regex (GPT-2's).
constexpr std::string_view kByteLevelRegex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Byte-level BPE writes byte b as one printable character: printable Latin-1 bytes as
// themselves, the others as U+0100 onwards in byte order.
struct ByteLevelAlphabet {
  std::array<uint32_t, 256> char_of_byte{};
  std::vector<int16_t> byte_of_char;  // code point → byte, -1 when not in the alphabet

  ByteLevelAlphabet() : byte_of_char(512, -1) {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      char_of_byte[b] = printable ? b : next++;
      byte_of_char[char_of_byte[b]] = static_cast<int16_t>(b);
    }
  }

  // The raw bytes `text` (UTF-8 from the JSON parser) stands for, or false when a character is
  // outside the alphabet.
  bool to_bytes(std::string_view text, std::string* out) const {
    out->clear();
    size_t i = 0;
    while (i < text.size()) {
      const auto lead = static_cast<uint8_t>(text[i]);
      uint32_t cp = 0;
      size_t n = 1;
      if (lead < 0x80) {
        cp = lead;
      } else if ((lead >> 5) == 0x6 && i + 1 < text.size()) {
        cp = ((lead & 0x1Fu) << 6) | (static_cast<uint8_t>(text[i + 1]) & 0x3Fu);
        n = 2;
      } else {
        return false;  // three- and four-byte characters are all beyond U+01FF
      }
      if (cp >= byte_of_char.size() || byte_of_char[cp] < 0) return false;
      out->push_back(static_cast<char>(byte_of_char[cp]));
      i += n;
    }
    return true;
  }
};

const ByteLevelAlphabet& alphabet() {
  static const ByteLevelAlphabet instance;
  return instance;
}

// The literal of a {"String": "..."} pattern (Replace, Split), refusing a regex pattern by name.
std::string string_pattern(const json& node, const char* step, const std::string& what) {
  const json& pattern = node.value("pattern", json());
  VLMGEN_CHECK(pattern.is_object() && pattern.contains("String") && pattern["String"].is_string() &&
                   !pattern["String"].get<std::string>().empty(),
               "{}: {} with pattern {} is not supported; expected {{\"String\": \"...\"}} (non-empty)", what, step,
               json_excerpt(pattern));
  return pattern["String"].get<std::string>();
}

std::string string_member(const json& node, const char* key, const char* step, const std::string& what) {
  const auto it = node.find(key);
  VLMGEN_CHECK(it != node.end() && it->is_string(), "{}: {} needs a string \"{}\", got {}", what, step, key,
               it == node.end() ? std::string("nothing") : json_excerpt(*it));
  return it->get<std::string>();
}

}  // namespace

bool byte_level_bytes(std::string_view text, std::string* out) { return alphabet().to_bytes(text, out); }

int byte_fallback_value(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return -1;
  int value = 0;
  for (char c : token.substr(3, 2)) {
    value *= 16;
    if (c >= '0' && c <= '9') {
      value += c - '0';
    } else if (c >= 'A' && c <= 'F') {
      value += c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      value += c - 'a' + 10;
    } else {
      return -1;
    }
  }
  return value;
}

void load_normalizer(Tokenizer::Impl& impl, const json& node, const std::string& what) {
  if (node.is_null()) return;
  const std::string type = type_of(node);
  if (type == "NFC") {
    impl.normalizers.push_back(NormalizeStep{true, {}, {}});
    return;
  }
  if (type == "Replace") {
    impl.normalizers.push_back(NormalizeStep{false, string_pattern(node, "Replace normalizer", what),
                                             string_member(node, "content", "Replace normalizer", what)});
    return;
  }
  if (type == "Sequence" && node.contains("normalizers") && node["normalizers"].is_array()) {
    for (const json& inner : node["normalizers"]) load_normalizer(impl, inner, what);
    return;
  }
  VLMGEN_FAIL(
      "{}: normalizer {} is not supported (vlmgen's tokenizer implements NFC, as the Qwen families use, and a "
      "literal Replace, as Gemma's uses)",
      what, type);
}

void load_pre_tokenizer(Tokenizer::Impl& impl, const json& node, const std::string& what, bool* byte_level) {
  if (node.is_null()) return;
  const std::string type = type_of(node);
  VLMGEN_CHECK(!*byte_level, "{}: pre-tokenizer {} comes after ByteLevel; expected ByteLevel last", what, type);
  if (type == "Sequence" && node.contains("pretokenizers") && node["pretokenizers"].is_array()) {
    for (const json& inner : node["pretokenizers"]) load_pre_tokenizer(impl, inner, what, byte_level);
    return;
  }
  if (type == "Split") {
    VLMGEN_CHECK(!flag(node, "invert", false), "{}: an inverted Split pre-tokenizer is not supported", what);
    const json& pattern = node.value("pattern", json());
    const json& behavior_node = node.value("behavior", json());
    VLMGEN_CHECK(behavior_node.is_null() || behavior_node.is_string(),
                 "{}: Split pre-tokenizer behavior is {}; expected a name such as \"Isolated\"", what,
                 json_excerpt(behavior_node));
    const std::string behavior = behavior_node.is_string() ? behavior_node.get<std::string>() : std::string();
    SplitStep step;
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      VLMGEN_CHECK(behavior == "Isolated",
                   "{}: Split pre-tokenizer behavior \"{}\" with a regex is not supported; expected Isolated", what,
                   behavior);
      step.regex =
          std::make_unique<RegexSplitter>(pattern["Regex"].get<std::string>(), what + " (Split pre-tokenizer)");
    } else {
      VLMGEN_CHECK(pattern.is_object() && pattern.contains("String"),
                   "{}: Split pre-tokenizer with pattern {} is not supported; expected {{\"Regex\": \"...\"}} or "
                   "{{\"String\": \"...\"}}",
                   what, json_excerpt(pattern));
      step.literal = string_pattern(node, "Split pre-tokenizer", what);
      VLMGEN_CHECK(behavior == "Isolated" || behavior == "MergedWithPrevious",
                   "{}: Split pre-tokenizer behavior \"{}\" is not supported; expected Isolated or "
                   "MergedWithPrevious",
                   what, behavior);
      step.merged_with_previous = behavior == "MergedWithPrevious";
    }
    impl.splitters.push_back(std::move(step));
    return;
  }
  if (type == "ByteLevel") {
    VLMGEN_CHECK(!flag(node, "add_prefix_space", false),
                 "{}: ByteLevel with add_prefix_space is not supported (the Qwen families do not use it)", what);
    if (flag(node, "use_regex", true)) {
      SplitStep step;
      step.regex = std::make_unique<RegexSplitter>(kByteLevelRegex, what + " (ByteLevel regex)");
      impl.splitters.push_back(std::move(step));
    }
    *byte_level = true;
    return;
  }
  VLMGEN_FAIL(
      "{}: pre-tokenizer {} is not supported (vlmgen's tokenizer implements Split with a regex or a string, and "
      "ByteLevel)",
      what, type);
}

std::string TokenDecoder::bytes_of(const std::string& token, bool* fallback_byte) const {
  if (fallback_byte != nullptr) *fallback_byte = false;
  std::string bytes;
  if (byte_level) {
    // Byte-level: the bytes the characters stand for when they all belong to the alphabet (as
    // HF's ByteLevel decoder does), else the text itself (added tokens).
    if (!byte_level_bytes(token, &bytes)) bytes = token;
    return bytes;
  }
  bytes = token;
  for (const auto& [pattern, content] : replacements) {
    std::string replaced;
    size_t from = 0;
    for (size_t at = bytes.find(pattern); at != std::string::npos; at = bytes.find(pattern, from)) {
      replaced.append(bytes, from, at - from).append(content);
      from = at + pattern.size();
    }
    bytes = replaced.append(bytes, from, std::string::npos);
  }
  if (byte_fallback) {
    const int value = byte_fallback_value(bytes);
    if (value >= 0) {
      if (fallback_byte != nullptr) *fallback_byte = true;
      return std::string(1, static_cast<char>(value));
    }
  }
  return bytes;
}

TokenDecoder load_decoder(const json& node, bool byte_level, const std::string& what) {
  TokenDecoder decoder;
  decoder.byte_level = byte_level;
  const std::string type = type_of(node);
  if (byte_level) {
    VLMGEN_CHECK(type == "ByteLevel",
                 "{}: decoder {} is not supported with a ByteLevel pre-tokenizer; expected "
                 "ByteLevel",
                 what, type);
    return decoder;
  }
  // SentencePiece-style: Replace("▁" → " "), ByteFallback, Fuse, applied per token in that
  // order (Fuse only joins the tokens, which decoding does anyway).
  VLMGEN_CHECK(type == "Sequence" && node.contains("decoders") && node["decoders"].is_array(),
               "{}: decoder {} is not supported without a ByteLevel pre-tokenizer; expected a Sequence of Replace, "
               "ByteFallback and Fuse",
               what, type);
  bool fused = false;
  for (const json& step : node["decoders"]) {
    const std::string kind = type_of(step);
    VLMGEN_CHECK(!fused, "{}: decoder step {} after Fuse is not supported", what, kind);
    VLMGEN_CHECK(!decoder.byte_fallback || kind == "Fuse",
                 "{}: decoder step {} after ByteFallback is not supported; expected Fuse", what, kind);
    if (kind == "Replace") {
      decoder.replacements.emplace_back(string_pattern(step, "Replace decoder", what),
                                        string_member(step, "content", "Replace decoder", what));
    } else if (kind == "ByteFallback") {
      decoder.byte_fallback = true;
    } else if (kind == "Fuse") {
      fused = true;
    } else {
      VLMGEN_FAIL(
          "{}: decoder step {} is not supported (vlmgen implements Replace, ByteFallback and Fuse, as Gemma's "
          "tokenizer uses)",
          what, kind);
    }
  }
  VLMGEN_CHECK(decoder.byte_fallback, "{}: the decoder has no ByteFallback step, which a byte-fallback BPE needs",
               what);
  return decoder;
}

}  // namespace vlmgen::detail
