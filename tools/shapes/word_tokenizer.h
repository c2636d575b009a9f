#pragma once

// A word-level tokenizer: one id per whitespace-separated word of a small closed vocabulary,
// plus the special tokens a Qwen-VL prompt needs.
//
//   auto tokenizer = vlmgen::shapes::WordTokenizer::with_specials(vlmgen::shapes::caption_words());
//   std::vector<int64_t> ids = tokenizer.encode("a red circle top left");
//   std::string text = tokenizer.decode(ids);   // "a red circle top left"
//   tokenizer.save("models/shapes-vlm/vocab.txt");

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace vlmgen::shapes {

class WordTokenizer {
 public:
  static constexpr const char* kPad = "<pad>";
  static constexpr const char* kBos = "<bos>";
  static constexpr const char* kEos = "<eos>";
  static constexpr const char* kVisionStart = "<|vision_start|>";
  static constexpr const char* kImagePad = "<|image_pad|>";
  static constexpr const char* kVisionEnd = "<|vision_end|>";
  static constexpr const char* kVideoPad = "<|video_pad|>";

  /// The special tokens in id order, as with_specials puts them first.
  static std::vector<std::string> special_tokens();

  /// Token `i` of `tokens` gets id i. Throws vlmgen::Error for an empty, duplicate or
  /// whitespace-holding token, or when a special token is missing.
  explicit WordTokenizer(std::vector<std::string> tokens);

  /// special_tokens() (ids 0..6, so <pad> is 0) followed by `words`.
  static WordTokenizer with_specials(const std::vector<std::string>& words);

  /// Reads a vocabulary file: one token per line, id = line number from 0 (a trailing "\r" is
  /// dropped). Throws vlmgen::Error naming `path` and the line on a bad file.
  static WordTokenizer load(const std::string& path);
  /// Writes the vocabulary file load() reads.
  void save(const std::string& path) const;

  /// Ids of the whitespace-separated words of `text` (special tokens may appear as words).
  /// Throws vlmgen::Error naming an unknown word and its position.
  std::vector<int64_t> encode(const std::string& text) const;
  /// The tokens of `ids` joined by single spaces; special tokens are left out when
  /// `skip_special` is true. Throws vlmgen::Error for an id outside the vocabulary.
  std::string decode(const std::vector<int64_t>& ids, bool skip_special = true) const;

  /// Id of `token`; throws vlmgen::Error when it is not in the vocabulary.
  int64_t id(const std::string& token) const;
  /// Token of `id`; throws vlmgen::Error when it is outside [0, size()).
  const std::string& token(int64_t id) const;
  bool contains(const std::string& token) const { return ids_.count(token) != 0; }
  bool is_special(int64_t id) const;
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  const std::vector<std::string>& tokens() const { return tokens_; }

  int64_t pad_id() const { return id(kPad); }
  int64_t bos_id() const { return id(kBos); }
  int64_t eos_id() const { return id(kEos); }
  int64_t vision_start_id() const { return id(kVisionStart); }
  int64_t image_pad_id() const { return id(kImagePad); }
  int64_t vision_end_id() const { return id(kVisionEnd); }
  int64_t video_pad_id() const { return id(kVideoPad); }

  /// A captioning prompt for one image of `placeholders` merged tokens:
  /// [<bos>, <|vision_start|>, <|image_pad|> x placeholders, <|vision_end|>]. The model
  /// continues it with the caption's words and <eos>.
  std::vector<int64_t> image_prompt(int64_t placeholders) const;

 private:
  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int64_t> ids_;
};

}  // namespace vlmgen::shapes
