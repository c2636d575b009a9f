#pragma once

// Text from tokens as they are generated. A token may end in the middle of a multi-byte
// character (byte-level BPE splits emoji and CJK characters between tokens); the detokenizer
// keeps such a tail until the character is complete, so every piece it returns is whole UTF-8
// and each character comes out once. A byte-fallback tokenizer's <0xXX> tokens are kept until
// their run ends (the next other token, or finish()). The pieces concatenated equal Tokenizer::decode of all the
// tokens, U+FFFD replacements included.
//
//   vlmgen::StreamingDetokenizer detok(tokenizer);
//   request.on_token = [&](const vlmgen::TokenEvent& e) {
//     std::fputs(detok.push(e.token).c_str(), stdout);
//     return true;
//   };
//   ... generate ...
//   std::fputs(detok.finish().c_str(), stdout);

#include <cstdint>
#include <string>

#include "vlmgen/text/tokenizer.h"

namespace vlmgen {

class StreamingDetokenizer {
 public:
  /// Keeps a reference to `tokenizer`, which must outlive this object.
  explicit StreamingDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens = false);

  /// Adds one token; returns the text that is complete now (possibly empty).
  std::string push(int64_t id);
  /// Ends the stream: returns what is left, an unfinished character as U+FFFD. The
  /// detokenizer is then empty and can start a new stream.
  std::string finish();
  /// Bytes held back: the start of a character waiting for its rest (at most 3), or a run of
  /// byte-fallback tokens (Tokenizer::is_fallback_byte) waiting for its end, which decides
  /// whether the run reads as its characters or as U+FFFD per token.
  size_t pending_bytes() const { return pending_.size() + run_.size(); }

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;
  std::string run_;
};

}  // namespace vlmgen
