#pragma once

// The Split pre-tokenizer of tokenizer.json ("behavior": "Isolated"): every regex match is a
// piece, and so is every stretch of text between matches. PCRE2 with Unicode classes and JIT.

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace vlmgen::detail {

/// `pattern` with `\s` and `\S` spelled out as Unicode's White_Space set, which is what the
/// regex engine of HF tokenizers (Oniguruma) means by them. PCRE2's own `\s` also takes U+180E.
/// Throws vlmgen::Error for `\S` inside a character class, which has no such spelling.
std::string with_unicode_whitespace(std::string_view pattern);

class RegexSplitter {
 public:
  /// Compiles `pattern` (the Regex of a Split pre-tokenizer); `what` names it in errors.
  RegexSplitter(std::string_view pattern, const std::string& what);
  ~RegexSplitter();
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;

  /// Appends the pieces of `text` (valid UTF-8) to `out`, in order; together they are `text`.
  void split(std::string_view text, std::vector<std::string_view>& out) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace vlmgen::detail
