#include "vlmgen/text/tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "tokenizer_impl.h"
#include "utf8.h"
#include "vlmgen/error.h"
#include "vlmgen/io/files.h"

namespace vlmgen {

namespace detail {

void AddedTokenMatcher::add(std::string content, int64_t id) {
  if (content.empty()) return;
  tokens_.push_back(Entry{std::move(content), id});
  auto& list = by_first_byte_[static_cast<uint8_t>(tokens_.back().content[0])];
  list.push_back(tokens_.size() - 1);
  std::stable_sort(list.begin(), list.end(),
                   [&](size_t a, size_t b) { return tokens_[a].content.size() > tokens_[b].content.size(); });
}

bool AddedTokenMatcher::find(std::string_view text, size_t from, size_t* offset, size_t* length, int64_t* id) const {
  if (tokens_.empty()) return false;
  for (size_t i = from; i < text.size(); ++i) {
    const auto& candidates = by_first_byte_[static_cast<uint8_t>(text[i])];
    for (size_t index : candidates) {
      const Entry& e = tokens_[index];
      if (text.compare(i, e.content.size(), e.content) == 0) {
        *offset = i;
        *length = e.content.size();
        *id = e.id;
        return true;
      }
    }
  }
  return false;
}

namespace {

std::string nfc(std::string_view text) {
  if (is_ascii(text)) return std::string(text);
  utf8proc_uint8_t* result = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &result, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  VLMGEN_CHECK(n >= 0, "NFC normalization failed: {}", utf8proc_errmsg(n));
  std::string out(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
  std::free(result);
  return out;
}

void replace_all(std::string& text, const std::string& pattern, const std::string& content) {
  if (pattern.empty() || text.find(pattern) == std::string::npos) return;
  std::string out;
  out.reserve(text.size() + text.size() / 4);
  size_t from = 0;
  for (size_t at = text.find(pattern); at != std::string::npos; at = text.find(pattern, from)) {
    out.append(text, from, at - from).append(content);
    from = at + pattern.size();
  }
  out.append(text, from, std::string::npos);
  text.swap(out);
}

}  // namespace

void SplitStep::split(std::string_view text, std::vector<std::string_view>& out) const {
  if (regex) {
    regex->split(text, out);
    return;
  }
  // A literal delimiter: Isolated makes each match a piece of its own; MergedWithPrevious
  // appends a match to the piece before it, unless that piece is a match too (or there is
  // none), as HF's Split does.
  const size_t first = out.size();
  bool previous_match = false;
  const auto emit = [&](size_t begin, size_t length, bool match) {
    if (merged_with_previous && match && !previous_match && out.size() > first) {
      out.back() = std::string_view(out.back().data(), out.back().size() + length);
    } else {
      out.push_back(text.substr(begin, length));
    }
    previous_match = match;
  };
  size_t from = 0;
  for (size_t at = text.find(literal); at != std::string::npos; at = text.find(literal, from)) {
    if (at > from) emit(from, at - from, false);
    emit(at, literal.size(), true);
    from = at + literal.size();
  }
  if (from < text.size()) emit(from, text.size() - from, false);
}

}  // namespace detail

std::string Tokenizer::Impl::normalize(std::string_view raw) const {
  std::string text(raw);
  for (const detail::NormalizeStep& step : normalizers) {
    if (step.nfc) {
      text = detail::nfc(text);
    } else {
      detail::replace_all(text, step.pattern, step.content);
    }
  }
  return text;
}

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<int64_t>& out) const {
  if (piece.empty()) return;
  if (ignore_merges) {
    const auto it = vocab.find(std::string(piece));
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (byte_level) {
    merges.encode(piece, byte_ids, out);
    return;
  }
  // One token per character; a character the vocabulary lacks becomes its bytes' tokens.
  std::vector<int32_t> ids;
  ids.reserve(piece.size());
  std::string character;
  for (size_t i = 0; i < piece.size();) {
    const size_t n = std::max<size_t>(1, detail::utf8_sequence_at(piece, i));
    character.assign(piece, i, n);
    const auto it = vocab.find(character);
    if (it != vocab.end()) {
      ids.push_back(it->second);
    } else {
      for (char b : character) ids.push_back(byte_ids[static_cast<uint8_t>(b)]);
    }
    i += n;
  }
  merges.encode_ids(ids, out);
}

void Tokenizer::Impl::encode_normalized(std::string_view text, std::vector<int64_t>& out) const {
  std::vector<std::string_view> pieces{text}, next;
  for (const auto& splitter : splitters) {
    next.clear();
    for (std::string_view piece : pieces) splitter.split(piece, next);
    pieces.swap(next);
  }
  for (std::string_view piece : pieces) encode_piece(piece, out);
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, const std::string& what) {
  return Tokenizer(load_tokenizer_json(tokenizer_json, what));
}

Tokenizer Tokenizer::from_file(const std::string& tokenizer_json_path) {
  // The largest tokenizer.json files on the hub (250k-token vocabularies) are around 35 MB.
  const std::string text = read_regular_file(tokenizer_json_path, "tokenizer file", int64_t{256} << 20);
  return from_json(text, tokenizer_json_path);
}

Tokenizer Tokenizer::from_pretrained(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path json = fs::path(dir) / "tokenizer.json";
  VLMGEN_CHECK(file_exists(json.string(), "tokenizer file"),
               "{} has no tokenizer.json: expected the tokenizer of the checkpoint there "
               "(HF folders ship it beside config.json)",
               dir);
  Tokenizer tokenizer = from_file(json.string());
  const fs::path config = fs::path(dir) / "tokenizer_config.json";
  if (file_exists(config.string(), "tokenizer config")) {
    load_tokenizer_config(*tokenizer.impl_, read_regular_file(config.string(), "tokenizer config", 64 << 20),
                          config.string());
  }
  return tokenizer;
}

std::vector<int64_t> Tokenizer::encode(std::string_view text, const EncodeOptions& options) const {
  if (const auto bad = detail::find_invalid_utf8(text)) {
    VLMGEN_FAIL(
        "the text to encode is not valid UTF-8: byte 0x{:02X} at offset {} of {} does not start or continue "
        "a character",
        static_cast<uint8_t>(text[*bad]), *bad, text.size());
  }
  const Impl& impl = *impl_;
  const int special = options.parse_special_tokens ? 1 : 0;
  std::vector<int64_t> out;
  out.reserve(text.size() / 3 + 4);
  // Added tokens on the raw text first; between them, the normalized text (where the
  // added tokens marked "normalized" are looked for), then the pre-tokenizers and BPE.
  const auto encode_text = [&](std::string_view raw) {
    if (raw.empty()) return;
    const std::string normalized = impl.normalize(raw);
    std::string_view rest = normalized;
    size_t offset = 0, length = 0;
    int64_t id = 0;
    while (impl.normalized_matcher[special].find(rest, 0, &offset, &length, &id)) {
      impl.encode_normalized(rest.substr(0, offset), out);
      out.push_back(id);
      rest.remove_prefix(offset + length);
    }
    impl.encode_normalized(rest, out);
  };
  size_t from = 0, offset = 0, length = 0;
  int64_t id = 0;
  while (impl.raw_matcher[special].find(text, from, &offset, &length, &id)) {
    encode_text(text.substr(from, offset - from));
    out.push_back(id);
    from = offset + length;
  }
  encode_text(text.substr(from));
  return out;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  std::string bytes;  // other tokens' bytes: one lossy pass over them (a character may span tokens)
  std::string run;    // a run of byte-fallback tokens: decoded whole when it ends
  std::string out;
  for (int64_t id : ids) {
    if (!has_token(id)) {
      detail::flush_fallback_run(out, run);
      detail::append_utf8_lossy(out, bytes, true);
      bytes.clear();
      out.append("\xEF\xBF\xBD");
      continue;
    }
    if (skip_special_tokens && is_special(id)) continue;
    if (is_fallback_byte(id)) {
      detail::append_utf8_lossy(out, bytes, true);
      bytes.clear();
      run.append(impl_->id_bytes[static_cast<size_t>(id)]);
      continue;
    }
    detail::flush_fallback_run(out, run);
    bytes.append(impl_->id_bytes[static_cast<size_t>(id)]);
  }
  detail::flush_fallback_run(out, run);
  detail::append_utf8_lossy(out, bytes, true);
  return out;
}

bool Tokenizer::is_fallback_byte(int64_t id) const {
  return has_token(id) && impl_->fallback_bytes[static_cast<size_t>(id)] != 0;
}

std::string_view Tokenizer::token_bytes(int64_t id) const {
  return has_token(id) ? std::string_view(impl_->id_bytes[static_cast<size_t>(id)]) : std::string_view();
}

bool Tokenizer::has_token(int64_t id) const {
  return id >= 0 && id < vocab_size() && impl_->kinds[static_cast<size_t>(id)] != Impl::Kind::kNone;
}

bool Tokenizer::is_special(int64_t id) const {
  return id >= 0 && id < vocab_size() && impl_->kinds[static_cast<size_t>(id)] == Impl::Kind::kSpecial;
}

std::optional<int64_t> Tokenizer::token_id(std::string_view content) const {
  for (const AddedToken& t : impl_->added) {
    if (t.content == content) return t.id;
  }
  const auto it = impl_->vocab.find(std::string(content));
  if (it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_bytes.size()); }
const std::vector<AddedToken>& Tokenizer::added_tokens() const { return impl_->added; }
const std::optional<std::string>& Tokenizer::eos_token() const { return impl_->eos_token; }
const std::optional<std::string>& Tokenizer::pad_token() const { return impl_->pad_token; }
const std::optional<std::string>& Tokenizer::bos_token() const { return impl_->bos_token; }

}  // namespace vlmgen
