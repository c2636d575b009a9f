// Reading tokenizer.json and tokenizer_config.json into a Tokenizer, refusing what the
// tokenizer does not implement.

#include <limits>

#include "../io/json_parse.h"
#include "tokenizer_impl.h"
#include "tokenizer_json.h"
#include "vlmgen/error.h"

namespace vlmgen {

namespace {

using detail::empty_or_null;
using detail::flag;
using detail::json_excerpt;
using detail::type_of;
using nlohmann::json;

// Ids above this are refused: a vocabulary that large is a corrupt file, not a tokenizer.
constexpr int64_t kMaxTokenId = int64_t{1} << 24;
/// How far ids may run past the number of vocabulary and added entries (gaps in the numbering):
/// ids index a table, and a 4 KB file naming id 16777215 made 530 MB of it.
constexpr int64_t kIdSlack = 65536;

// tokenizer.json is mostly model.vocab (150k entries) and model.merges (150k pairs): building a
// JSON tree of them costs most of the loading time in allocations. This reader streams those two
// into flat lists and builds a tree of the rest only.
class TokenizerJsonReader : public nlohmann::json_sax<json> {
 public:
  explicit TokenizerJsonReader(std::string what) : what_(std::move(what)) {}

  json rest;                                           // the document without model.vocab and model.merges
  std::vector<std::pair<std::string, int64_t>> vocab;  // token text, id
  std::vector<std::pair<std::string, std::string>> merges;
  bool saw_vocab = false, saw_merges = false;

  bool null() override { return value(json()); }
  bool boolean(bool v) override { return value(json(v)); }
  bool number_integer(number_integer_t v) override { return value(json(v)); }
  bool number_unsigned(number_unsigned_t v) override { return value(json(v)); }
  bool number_float(number_float_t v, const string_t&) override { return value(json(v)); }
  bool string(string_t& v) override {
    if (mode_ == Mode::kMerges || mode_ == Mode::kMergePair) {
      merge_parts_.push_back(std::move(v));
      if (mode_ == Mode::kMerges) finish_merge();
      return true;
    }
    return value(json(std::move(v)));
  }
  bool binary(binary_t&) override { return fail("binary data"); }
  bool start_object(std::size_t) override {
    VLMGEN_CHECK(mode_ == Mode::kTree, "{}: model.{} holds an object where a token or merge was expected", what_,
                 mode_ == Mode::kVocab ? "vocab" : "merges");
    if (at_model_key("vocab")) {
      mode_ = Mode::kVocab;
      saw_vocab = true;
      return true;
    }
    return open(json::object());
  }
  bool key(string_t& k) override {
    if (mode_ == Mode::kVocab) {
      vocab_key_ = std::move(k);
      return true;
    }
    key_ = std::move(k);
    return true;
  }
  bool end_object() override {
    if (mode_ == Mode::kVocab) {
      mode_ = Mode::kTree;
      return true;
    }
    stack_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    if (mode_ == Mode::kMerges) {
      mode_ = Mode::kMergePair;
      return true;
    }
    VLMGEN_CHECK(mode_ == Mode::kTree, "{}: model.{} holds an array where a token or merge was expected", what_,
                 mode_ == Mode::kVocab ? "vocab" : "merges");
    if (at_model_key("merges")) {
      mode_ = Mode::kMerges;
      saw_merges = true;
      return true;
    }
    return open(json::array());
  }
  bool end_array() override {
    if (mode_ == Mode::kMergePair) {
      VLMGEN_CHECK(merge_parts_.size() == 2, "{}: merge {} has {} parts; expected [\"left\", \"right\"]", what_,
                   merges.size(), merge_parts_.size());
      merges.emplace_back(std::move(merge_parts_[0]), std::move(merge_parts_[1]));
      merge_parts_.clear();
      mode_ = Mode::kMerges;
      return true;
    }
    if (mode_ == Mode::kMerges) {
      mode_ = Mode::kTree;
      return true;
    }
    stack_.pop_back();
    return true;
  }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& e) override {
    VLMGEN_FAIL("{}: not valid JSON at byte {}: {}", what_, position, quote_excerpt(e.what(), 160));
  }

 private:
  enum class Mode { kTree, kVocab, kMerges, kMergePair };

  bool at_model_key(const char* name) const {
    return stack_.size() == 2 && key_ == name && (*stack_[0]).is_object() && stack_[1]->is_object() &&
           stack_[0]->contains("model") && &(*stack_[0])["model"] == stack_[1];
  }
  bool value(json v) {
    if (mode_ == Mode::kVocab) {
      VLMGEN_CHECK(v.is_number_integer(), "{}: vocabulary token {} has id {}; expected an integer", what_,
                   quote_excerpt(vocab_key_), detail::json_excerpt(v));
      vocab.emplace_back(std::move(vocab_key_), v.get<int64_t>());
      return true;
    }
    VLMGEN_CHECK(mode_ == Mode::kTree, "{}: merge {} holds {}; expected strings", what_, merges.size(),
                 detail::json_excerpt(v));
    place(std::move(v));
    return true;
  }
  json* place(json v) {
    if (stack_.empty()) {
      rest = std::move(v);
      return &rest;
    }
    json& parent = *stack_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    json& slot = parent[key_];
    slot = std::move(v);
    return &slot;
  }
  bool open(json container) {
    stack_.push_back(place(std::move(container)));
    return true;
  }
  void finish_merge() {  // "left right"
    std::string s = std::move(merge_parts_.back());
    merge_parts_.clear();
    const size_t space = s.find(' ');
    VLMGEN_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos,
                 "{}: merge {} is {}; expected two tokens separated by one space", what_, merges.size(),
                 quote_excerpt(s));
    merges.emplace_back(s.substr(0, space), s.substr(space + 1));
  }
  bool fail(const char* what) { VLMGEN_FAIL("{}: unexpected {}", what_, what); }

  std::string what_;
  Mode mode_ = Mode::kTree;
  std::vector<json*> stack_;
  std::string key_, vocab_key_;
  std::vector<std::string> merge_parts_;
};

int32_t checked_id(const json& value, const std::string& what, const std::string& token) {
  VLMGEN_CHECK(value.is_number_integer(), "{}: the id of token {} is {}; expected an integer", what,
               quote_excerpt(token), json_excerpt(value));
  const auto id = value.get<int64_t>();
  VLMGEN_CHECK(id >= 0 && id < kMaxTokenId, "{}: token {} has id {}; expected 0 <= id < {}", what, quote_excerpt(token),
               id, kMaxTokenId);
  return static_cast<int32_t>(id);
}

void set_token(Tokenizer::Impl& impl, int32_t id, std::string bytes, Tokenizer::Impl::Kind kind,
               const std::string& what, bool fallback_byte = false) {
  VLMGEN_CHECK(id < impl.id_limit,
               "{}: id {} is far past the {} vocabulary and added entries; expected ids below {} (entries plus {} "
               "for gaps)",
               what, id, impl.id_limit - kIdSlack, impl.id_limit, kIdSlack);
  const auto index = static_cast<size_t>(id);
  if (index >= impl.id_bytes.size()) {
    impl.id_bytes.resize(index + 1);
    impl.kinds.resize(index + 1, Tokenizer::Impl::Kind::kNone);
    impl.fallback_bytes.resize(index + 1, 0);
  }
  impl.id_bytes[index] = std::move(bytes);
  impl.kinds[index] = kind;
  impl.fallback_bytes[index] = fallback_byte ? 1 : 0;
}

// The bytes of a vocabulary entry or merge part as the BPE sees them: byte-level text mapped
// back to bytes, SentencePiece-style text as it is.
bool model_bytes(const Tokenizer::Impl& impl, const std::string& token, std::string* bytes) {
  if (impl.byte_level) return detail::byte_level_bytes(token, bytes);
  *bytes = token;
  return true;
}

void load_vocab(Tokenizer::Impl& impl, const TokenizerJsonReader& reader, const detail::TokenDecoder& decoder,
                const std::string& what) {
  VLMGEN_CHECK(reader.saw_vocab && !reader.vocab.empty(), "{}: model.vocab must be a non-empty object", what);
  impl.vocab.reserve(reader.vocab.size());
  std::string bytes;
  for (const auto& [token, value] : reader.vocab) {
    const int32_t id = checked_id(json(value), what, token);
    VLMGEN_CHECK(model_bytes(impl, token, &bytes),
                 "{}: vocabulary token {} (id {}) is not byte-level (a character outside the byte alphabet)", what,
                 quote_excerpt(token), id);
    VLMGEN_CHECK(static_cast<size_t>(id) >= impl.kinds.size() ||
                     impl.kinds[static_cast<size_t>(id)] == Tokenizer::Impl::Kind::kNone,
                 "{}: id {} is given to two vocabulary tokens", what, id);
    VLMGEN_CHECK(impl.vocab.emplace(bytes, id).second, "{}: token {} is in the vocabulary twice", what,
                 quote_excerpt(token));
    bool fallback_byte = false;
    std::string decoded = impl.byte_level ? bytes : decoder.bytes_of(token, &fallback_byte);
    set_token(impl, id, std::move(decoded), Tokenizer::Impl::Kind::kVocab, what, fallback_byte);
  }
  // The token of each byte: the byte itself (byte-level) or its "<0xXX>" fallback token.
  for (int b = 0; b < 256; ++b) {
    const std::string name = impl.byte_level ? std::string(1, static_cast<char>(b)) : fmt::format("<0x{:02X}>", b);
    const auto it = impl.vocab.find(name);
    VLMGEN_CHECK(it != impl.vocab.end(), "{}: the vocabulary has no token for byte 0x{:02X}; {} needs all 256", what, b,
                 impl.byte_level ? "byte-level BPE" : "BPE with byte_fallback");
    impl.byte_ids[static_cast<size_t>(b)] = it->second;
  }
}

void load_bpe(Tokenizer::Impl& impl, const json& model, const TokenizerJsonReader& reader,
              const detail::TokenDecoder& decoder, const std::string& what) {
  const std::string type = type_of(model);
  VLMGEN_CHECK(type == "BPE", "{}: model type {} is not supported (vlmgen's tokenizer implements BPE)", what, type);
  const bool byte_fallback = flag(model, "byte_fallback", false);
  VLMGEN_CHECK(!impl.byte_level || !byte_fallback,
               "{}: BPE with byte_fallback under a ByteLevel pre-tokenizer is not supported", what);
  VLMGEN_CHECK(impl.byte_level || byte_fallback,
               "{}: BPE without a ByteLevel pre-tokenizer needs byte_fallback (vlmgen implements byte-level BPE and "
               "SentencePiece-style BPE with byte fallback; unknown characters would be lost otherwise)",
               what);
  const auto dropout = model.find("dropout");
  VLMGEN_CHECK(dropout == model.end() || dropout->is_null() || (dropout->is_number() && dropout->get<double>() == 0.0),
               "{}: BPE dropout {} is not supported (it makes tokenization random)", what, json_excerpt(*dropout));
  VLMGEN_CHECK(empty_or_null(model, "continuing_subword_prefix") && empty_or_null(model, "end_of_word_suffix"),
               "{}: BPE with a continuing_subword_prefix or end_of_word_suffix is not supported", what);
  impl.ignore_merges = flag(model, "ignore_merges", false);
  load_vocab(impl, reader, decoder, what);

  VLMGEN_CHECK(reader.saw_merges, "{}: model.merges is missing; expected an array of merges", what);
  impl.merges.reserve(reader.merges.size());
  std::string left, right;
  int32_t rank = 0;
  for (const auto& [a, b] : reader.merges) {
    VLMGEN_CHECK(model_bytes(impl, a, &left) && model_bytes(impl, b, &right),
                 "{}: merge {} ({} + {}) is not byte-level", what, rank, quote_excerpt(a), quote_excerpt(b));
    const auto l = impl.vocab.find(left), r = impl.vocab.find(right), m = impl.vocab.find(left + right);
    VLMGEN_CHECK(l != impl.vocab.end() && r != impl.vocab.end() && m != impl.vocab.end(),
                 "{}: merge {} ({} + {}) names a token that is not in the vocabulary", what, rank, quote_excerpt(a),
                 quote_excerpt(b));
    impl.merges.add(l->second, r->second, rank, m->second);
    ++rank;
  }
}

void load_added_tokens(Tokenizer::Impl& impl, const json& list, const detail::TokenDecoder& decoder,
                       const std::string& what) {
  if (list.is_null()) return;
  VLMGEN_CHECK(list.is_array(), "{}: added_tokens must be an array, got {}", what, json_excerpt(list));
  for (const json& node : list) {
    VLMGEN_CHECK(node.is_object() && node.contains("content") && node["content"].is_string() && node.contains("id"),
                 "{}: an added token is {}; expected an object with \"id\" and \"content\"", what, json_excerpt(node));
    AddedToken token;
    token.content = node["content"].get<std::string>();
    token.id = checked_id(node["id"], what, token.content);
    token.special = flag(node, "special", false);
    token.normalized = flag(node, "normalized", !token.special);
    VLMGEN_CHECK(!token.content.empty(), "{}: added token {} has empty content", what, token.id);
    for (const char* key : {"lstrip", "rstrip", "single_word"}) {
      VLMGEN_CHECK(!flag(node, key, false), "{}: added token {} (id {}) sets {}, which is not supported", what,
                   quote_excerpt(token.content), token.id, key);
    }
    // Decoding runs added tokens through the decoder too, as HF does.
    bool fallback_byte = false;
    std::string decoded = decoder.bytes_of(token.content, &fallback_byte);
    set_token(impl, static_cast<int32_t>(token.id), std::move(decoded),
              token.special ? Tokenizer::Impl::Kind::kSpecial : Tokenizer::Impl::Kind::kAdded, what, fallback_byte);
    for (int parse_special = 0; parse_special < 2; ++parse_special) {
      if (token.special && !parse_special) continue;
      // A normalized token is looked for in the normalized text, as its normalized content.
      if (token.normalized) {
        impl.normalized_matcher[parse_special].add(impl.normalize(token.content), token.id);
      } else {
        impl.raw_matcher[parse_special].add(token.content, token.id);
      }
    }
    impl.added.push_back(std::move(token));
  }
}

std::optional<std::string> token_name(const json& config, const char* key, const std::string& what) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  VLMGEN_CHECK(it->is_object() && it->contains("content") && (*it)["content"].is_string(),
               "{}: \"{}\" is {}; expected a string or {{\"content\": \"...\"}}", what, key, json_excerpt(*it));
  return (*it)["content"].get<std::string>();
}

std::unique_ptr<Tokenizer::Impl> read_tokenizer_json(std::string_view text, const std::string& what) {
  check_json_limits(text, JsonLimits().max_bytes(int64_t{256} << 20), what);
  TokenizerJsonReader reader(what);
  json::sax_parse(text.begin(), text.end(), &reader);
  const json& root = reader.rest;
  VLMGEN_CHECK(root.is_object() && root.contains("model"),
               "{}: expected a tokenizer.json object with a \"model\", got {}", what, json_excerpt(root));
  auto impl = std::make_unique<Tokenizer::Impl>();
  const json& added = root.value("added_tokens", json());
  impl->id_limit = static_cast<int64_t>(reader.vocab.size() + (added.is_array() ? added.size() : 0)) + kIdSlack;
  detail::load_normalizer(*impl, root.value("normalizer", json()), what);
  bool byte_level = false;
  detail::load_pre_tokenizer(*impl, root.value("pre_tokenizer", json()), what, &byte_level);
  impl->byte_level = byte_level;
  const detail::TokenDecoder decoder = detail::load_decoder(root.value("decoder", json()), byte_level, what);
  // A post-processor's tokens (TemplateProcessing's BOS) are never added: encode() is HF's
  // add_special_tokens=False, and chat templates write the BOS themselves.
  const json& post = root.value("post_processor", json());
  VLMGEN_CHECK(post.is_null() || type_of(post) == "ByteLevel" || type_of(post) == "TemplateProcessing",
               "{}: post-processor {} is not supported (vlmgen adds no tokens when encoding); expected ByteLevel, "
               "TemplateProcessing or null",
               what, type_of(post));
  load_bpe(*impl, root["model"], reader, decoder, what);
  load_added_tokens(*impl, added, decoder, what);
  return impl;
}

void read_tokenizer_config(Tokenizer::Impl& impl, std::string_view text, const std::string& what) {
  const json config = detail::parse_json(text, what, JsonLimits().max_bytes(64 << 20));
  VLMGEN_CHECK(config.is_object(), "{}: expected a JSON object, got {}", what, json_excerpt(config));
  VLMGEN_CHECK(!flag(config, "clean_up_tokenization_spaces", false),
               "{}: clean_up_tokenization_spaces is true, which vlmgen's decoder does not implement", what);
  impl.eos_token = token_name(config, "eos_token", what);
  impl.pad_token = token_name(config, "pad_token", what);
  impl.bos_token = token_name(config, "bos_token", what);
}

}  // namespace

/// A JSON value of the wrong type where the readers above do not check one (nlohmann's
/// type_error) is a vlmgen::Error naming the file, not an exception of another kind.
std::unique_ptr<Tokenizer::Impl> load_tokenizer_json(std::string_view text, const std::string& what) {
  try {
    return read_tokenizer_json(text, what);
  } catch (const nlohmann::json::exception& e) {
    VLMGEN_FAIL("{}: a value of the wrong type: {}", what, quote_excerpt(e.what(), 160));
  }
}

void load_tokenizer_config(Tokenizer::Impl& impl, std::string_view text, const std::string& what) {
  try {
    read_tokenizer_config(impl, text, what);
  } catch (const nlohmann::json::exception& e) {
    VLMGEN_FAIL("{}: a value of the wrong type: {}", what, quote_excerpt(e.what(), 160));
  }
}

}  // namespace vlmgen
