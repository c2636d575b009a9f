#pragma once

// What a loaded Tokenizer holds (private to the library).

#include <array>
#include <memory>
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

}  // namespace detail

struct Tokenizer::Impl {
  enum class Kind : uint8_t { kNone, kVocab, kAdded, kSpecial };

  std::vector<std::string> id_bytes;               // [vocab_size]: the raw bytes each id stands for
  std::vector<Kind> kinds;                         // [vocab_size]
  std::unordered_map<std::string, int32_t> vocab;  // raw bytes → id, the BPE vocabulary
  std::array<int32_t, 256> byte_ids{};             // the token of each single byte
  detail::BpeMerges merges;
  bool ignore_merges = false;  // a piece that is a vocabulary entry is taken whole
  bool nfc = false;
  std::vector<std::unique_ptr<detail::RegexSplitter>> splitters;
  std::vector<AddedToken> added;
  // [parse special tokens?]: matchers of the added tokens on the raw / on the normalized text
  detail::AddedTokenMatcher raw_matcher[2], normalized_matcher[2];
  std::optional<std::string> eos_token, pad_token, bos_token;

  void encode_normalized(std::string_view text, std::vector<int64_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int64_t>& out) const;
};

/// Builds the Impl from the parsed text of a tokenizer.json (tokenizer_load.cpp).
std::unique_ptr<Tokenizer::Impl> load_tokenizer_json(std::string_view text, const std::string& what);
/// Reads names of special tokens from the text of a tokenizer_config.json.
void load_tokenizer_config(Tokenizer::Impl& impl, std::string_view text, const std::string& what);

}  // namespace vlmgen
