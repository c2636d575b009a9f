#pragma once

// What a loaded Tokenizer holds (private to the library).

#include <array>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "bpe.h"
#include "regex_split.h"
#include "vlmgen/text/tokenizer.h"

namespace vlmgen {

namespace detail {

/// Finds added tokens in text, leftmost first and the longest at that position, as HF's added
/// vocabulary does.
class AddedTokenMatcher {
 public:
  void add(std::string content, int64_t id);
  bool empty() const { return tokens_.empty(); }
  /// The first match at or after `from`: its offset, length and id; false when there is none.
  bool find(std::string_view text, size_t from, size_t* offset, size_t* length, int64_t* id) const;

 private:
  struct Entry {
    std::string content;
    int64_t id;
  };
  std::vector<Entry> tokens_;
  std::array<std::vector<size_t>, 256> by_first_byte_;  // indices into tokens_, longest first
};

/// One step of the normalizer: NFC, or a literal Replace.
struct NormalizeStep {
  bool nfc = false;
  std::string pattern, content;  // Replace: every `pattern` becomes `content`
};

/// One Split pre-tokenizer: a regex (behavior Isolated), or a literal string (Isolated or
/// MergedWithPrevious).
struct SplitStep {
  std::unique_ptr<RegexSplitter> regex;
  std::string literal;
  bool merged_with_previous = false;

  void split(std::string_view text, std::vector<std::string_view>& out) const;
};

}  // namespace detail

struct Tokenizer::Impl {
  enum class Kind : uint8_t { kNone, kVocab, kAdded, kSpecial };

  // byte_level: GPT-2's byte alphabet (the Qwen families): every piece is BPE over its bytes.
  // Otherwise SentencePiece-style BPE with byte fallback (Gemma): the vocabulary holds UTF-8
  // text, a piece starts as one token per character, and a character missing from the
  // vocabulary becomes the <0xXX> tokens of its bytes (byte_ids).
  bool byte_level = true;

  std::vector<std::string> id_bytes;               // [vocab_size]: the raw bytes each id stands for
  int64_t id_limit = 0;                            // while loading: ids must be below this (the entries plus kIdSlack)
  std::vector<Kind> kinds;                         // [vocab_size]
  std::vector<uint8_t> fallback_bytes;             // [vocab_size]: 1 for the <0xXX> tokens of a ByteFallback decoder
  std::unordered_map<std::string, int32_t> vocab;  // raw bytes → id, the BPE vocabulary
  std::array<int32_t, 256> byte_ids{};             // the token of each single byte
  detail::BpeMerges merges;
  bool ignore_merges = false;  // a piece that is a vocabulary entry is taken whole
  std::vector<detail::NormalizeStep> normalizers;
  std::vector<detail::SplitStep> splitters;
  std::vector<AddedToken> added;
  // [parse special tokens?]: matchers of the added tokens on the raw / on the normalized text
  detail::AddedTokenMatcher raw_matcher[2], normalized_matcher[2];
  std::optional<std::string> eos_token, pad_token, bos_token;

  std::string normalize(std::string_view raw) const;
  void encode_normalized(std::string_view text, std::vector<int64_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int64_t>& out) const;
};

namespace detail {
// tokenizer_pipeline.cpp: the normalizer, pre-tokenizer and decoder sections of tokenizer.json.
void load_normalizer(Tokenizer::Impl& impl, const nlohmann::json& node, const std::string& what);
/// Sets *byte_level when the pre-tokenizer ends with ByteLevel.
void load_pre_tokenizer(Tokenizer::Impl& impl, const nlohmann::json& node, const std::string& what, bool* byte_level);
/// What decoding does to one token's text (ByteLevel's alphabet, or SentencePiece's Replace and
/// ByteFallback steps), checked against the model's kind.
struct TokenDecoder {
  bool byte_level = true;
  bool byte_fallback = false;  // "<0xXX>" stands for byte XX
  std::vector<std::pair<std::string, std::string>> replacements;

  /// The raw bytes `token` (its text in tokenizer.json) decodes to; *fallback_byte tells whether
  /// it is a "<0xXX>" token of the ByteFallback step (whose runs decode together).
  std::string bytes_of(const std::string& token, bool* fallback_byte = nullptr) const;
};
TokenDecoder load_decoder(const nlohmann::json& node, bool byte_level, const std::string& what);
/// The raw bytes of a byte-level token's text (GPT-2's alphabet), or false when a character is
/// outside the alphabet.
bool byte_level_bytes(std::string_view text, std::string* out);
/// The byte of a "<0xXX>" token, or -1.
int byte_fallback_value(std::string_view token);
}  // namespace detail

/// Builds the Impl from the parsed text of a tokenizer.json (tokenizer_load.cpp).
std::unique_ptr<Tokenizer::Impl> load_tokenizer_json(std::string_view text, const std::string& what);
/// Reads names of special tokens from the text of a tokenizer_config.json.
void load_tokenizer_config(Tokenizer::Impl& impl, std::string_view text, const std::string& what);

}  // namespace vlmgen
