#include "shapes/word_tokenizer.h"

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>
#include <utility>

#include "vlmgen/error.h"
#include "vlmgen/io/files.h"

namespace vlmgen::shapes {
namespace {

bool has_space(const std::string& s) {
  return std::any_of(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c) != 0; });
}

}  // namespace

std::vector<std::string> WordTokenizer::special_tokens() {
  return {kPad, kBos, kEos, kVisionStart, kImagePad, kVisionEnd, kVideoPad};
}

WordTokenizer::WordTokenizer(std::vector<std::string> tokens) : tokens_(std::move(tokens)) {
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const std::string& t = tokens_[i];
    // A token with a space could never come out of encode(), and one file line per token must
    // stay one token.
    VLMGEN_CHECK(!t.empty() && !has_space(t), "token {} is \"{}\"; tokens must be non-empty words without whitespace",
                 i, t);
    const auto [it, inserted] = ids_.emplace(t, static_cast<int64_t>(i));
    VLMGEN_CHECK(inserted, "token \"{}\" appears twice, at ids {} and {}", t, it->second, i);
  }
  for (const std::string& special : special_tokens()) {
    VLMGEN_CHECK(contains(special), "the vocabulary ({} tokens) lacks the special token {}", tokens_.size(), special);
  }
}

WordTokenizer WordTokenizer::with_specials(const std::vector<std::string>& words) {
  std::vector<std::string> tokens = special_tokens();
  tokens.insert(tokens.end(), words.begin(), words.end());
  return WordTokenizer(std::move(tokens));
}

WordTokenizer WordTokenizer::load(const std::string& path) {
  // A regular file only (a FIFO would block), and bounded: a word vocabulary is a few KB.
  std::istringstream in(read_regular_file(path, "vocabulary file", int64_t{16} << 20));
  std::vector<std::string> tokens;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    tokens.push_back(line);
  }
  try {
    return WordTokenizer(std::move(tokens));
  } catch (const Error& e) {
    VLMGEN_FAIL("vocabulary file {} (one token per line, line n = id n - 1): {}", path, e.what());
  }
}

void WordTokenizer::save(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  VLMGEN_CHECK(out.good(), "cannot open {} for writing", path);
  for (const std::string& t : tokens_) out << t << '\n';
  out.close();
  VLMGEN_CHECK(!out.fail(), "writing vocabulary file {} failed", path);
}

std::vector<int64_t> WordTokenizer::encode(const std::string& text) const {
  std::vector<int64_t> ids;
  std::istringstream words(text);
  std::string word;
  while (words >> word) {
    const auto it = ids_.find(word);
    VLMGEN_CHECK(it != ids_.end(), "word {} \"{}\" of \"{}\" is not in the vocabulary of {} tokens", ids.size(), word,
                 text, tokens_.size());
    ids.push_back(it->second);
  }
  return ids;
}

std::string WordTokenizer::decode(const std::vector<int64_t>& ids, bool skip_special) const {
  std::string text;
  for (int64_t id : ids) {
    const std::string& t = token(id);
    if (skip_special && is_special(id)) continue;
    if (!text.empty()) text += ' ';
    text += t;
  }
  return text;
}

int64_t WordTokenizer::id(const std::string& token) const {
  const auto it = ids_.find(token);
  VLMGEN_CHECK(it != ids_.end(), "token \"{}\" is not in the vocabulary of {} tokens", token, tokens_.size());
  return it->second;
}

const std::string& WordTokenizer::token(int64_t id) const {
  VLMGEN_CHECK(id >= 0 && id < size(), "token id {} is outside the vocabulary [0, {})", id, size());
  return tokens_[static_cast<size_t>(id)];
}

bool WordTokenizer::is_special(int64_t id) const {
  const std::string& t = token(id);
  const std::vector<std::string> specials = special_tokens();
  return std::find(specials.begin(), specials.end(), t) != specials.end();
}

std::vector<int64_t> WordTokenizer::image_prompt(int64_t placeholders) const {
  VLMGEN_CHECK(placeholders >= 1, "an image prompt needs at least one placeholder, got {}", placeholders);
  std::vector<int64_t> ids = {bos_id(), vision_start_id()};
  ids.insert(ids.end(), static_cast<size_t>(placeholders), image_pad_id());
  ids.push_back(vision_end_id());
  return ids;
}

}  // namespace vlmgen::shapes
