#pragma once

// The BPE tokenizer of a checkpoint folder's tokenizer.json, in the two forms VLM checkpoints
// ship, exactly as HF tokenizers runs them:
//
//   byte-level (Qwen2/2.5/3 and their -VL models): added tokens matched first (leftmost-longest,
//   on the raw text) → NFC → the Split pre-tokenizers' regexes (PCRE2, Unicode classes) →
//   byte-level mapping → BPE merges by rank;
//   SentencePiece-style with byte fallback (Gemma-3): added tokens → a literal Replace
//   normalizer (" " → "▁") → literal Splits → one symbol per character, a character missing from
//   the vocabulary as its bytes' <0xXX> tokens → BPE merges by rank; decoding through Replace,
//   ByteFallback and Fuse.
//
// A post-processor's tokens (TemplateProcessing's BOS) are never added: encode is HF's
// add_special_tokens=False. Anything else a tokenizer.json may ask for (another model type or
// normalizer, Metaspace, Strip, added tokens that strip spaces) is refused when loading with a
// vlmgen::Error naming it: never a silently different tokenization.
//
//   auto tok = vlmgen::Tokenizer::from_pretrained("/models/Qwen2-VL-2B-Instruct");
//   std::vector<int64_t> ids = tok.encode("<|im_start|>user\nHello<|im_end|>");
//   std::string text = tok.decode(ids);

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vlmgen {

/// Options of Tokenizer::encode.
struct EncodeOptions {
  /// Match special added tokens (`<|im_start|>`, `<|image_pad|>`, ...) written in the text, as HF
  /// does by default. Off: their text is tokenized as ordinary characters (use it for text from
  /// users that must not be able to write control tokens). Non-special added tokens are matched
  /// either way. Default true.
  bool parse_special_tokens = true;
};

/// One added token of tokenizer.json.
struct AddedToken {
  int64_t id = 0;
  std::string content;
  bool special = false;
  bool normalized = false;  ///< matched on the normalized text instead of the raw text
};

/// A loaded tokenizer. Immutable after loading: encode and decode are safe to call from several
/// threads at once. Move-only.
class Tokenizer {
 public:
  /// Loads `dir`/tokenizer.json and, when present, `dir`/tokenizer_config.json (special-token
  /// names). Throws vlmgen::Error naming the file and what it does not support.
  static Tokenizer from_pretrained(const std::string& dir);
  /// Loads one tokenizer.json file.
  static Tokenizer from_file(const std::string& tokenizer_json_path);
  /// Parses the text of a tokenizer.json; `what` names it in errors.
  static Tokenizer from_json(std::string_view tokenizer_json, const std::string& what = "tokenizer.json");

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  /// Token ids of `text`, which must be valid UTF-8 (otherwise vlmgen::Error naming the byte
  /// offset: invalid input is refused, not replaced). No BOS/EOS is added.
  std::vector<int64_t> encode(std::string_view text, const EncodeOptions& options = EncodeOptions()) const;

  /// The text of `ids`. Bytes that do not form UTF-8 (a character cut between tokens, say) come
  /// out as U+FFFD per maximal invalid subsequence, as HF's lossy decode does; an id outside the
  /// vocabulary comes out as U+FFFD too. With skip_special_tokens, special added tokens are
  /// left out.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;

  /// The raw bytes token `id` stands for (the content of an added token), which need not be
  /// valid UTF-8 on its own. Empty when `id` has no token.
  std::string_view token_bytes(int64_t id) const;
  /// Whether `id` is a token of this tokenizer (vocabulary or added).
  bool has_token(int64_t id) const;
  /// Whether `id` is a special added token.
  bool is_special(int64_t id) const;
  /// Whether `id` is a "<0xXX>" token of a byte-fallback (SentencePiece-style) tokenizer. As in
  /// HF's ByteFallback decoder, a run of them decodes to its bytes when they are valid UTF-8, and
  /// otherwise to one U+FFFD per token of the run.
  bool is_fallback_byte(int64_t id) const;
  /// The id of the token whose text is exactly `content` (an added token's content, or a
  /// vocabulary entry's bytes), if there is one.
  std::optional<int64_t> token_id(std::string_view content) const;
  /// One more than the largest id (vocabulary and added tokens).
  int64_t vocab_size() const;
  const std::vector<AddedToken>& added_tokens() const;

  /// Names from tokenizer_config.json, when it was loaded and sets them.
  const std::optional<std::string>& eos_token() const;
  const std::optional<std::string>& pad_token() const;
  const std::optional<std::string>& bos_token() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend class StreamingDetokenizer;
};

}  // namespace vlmgen
