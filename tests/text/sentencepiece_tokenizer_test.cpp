// SentencePiece-style BPE (Gemma's tokenizer.json: a Replace normalizer, a literal Split,
// byte fallback, a Replace/ByteFallback/Fuse decoder): its rules on a hand-made tokenizer.json
// (expected ids worked out by hand), the real Gemma-3 tokenizer against the JavaScript
// implementation of HF tokenizers, and what it refuses.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "node_reference.h"
#include "text_corpus.h"
#include "tiny_tokenizer.h"
#include "vlmgen/error.h"
#include "vlmgen/text/detokenizer.h"
#include "vlmgen/text/tokenizer.h"

namespace {

using nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using vlmgen::testing_text::load_error;

const std::string kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// ids 0..255 are the <0xXX> byte tokens; then "<unk>" = 256 and `pieces` from 257 in order;
// merges name pieces. Normalizer: " " → "▁"; no pre-tokenizer unless `split` is given.
json tiny_spm(const std::vector<std::string>& pieces, const std::vector<std::pair<std::string, std::string>>& merges,
              const json& split = nullptr, bool replace_spaces = true) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[fmt::format("<0x{:02X}>", b)] = b;
  vocab["<unk>"] = 256;
  int next = 257;
  for (const std::string& p : pieces) vocab[p] = next++;
  json merge_list = json::array();
  for (const auto& [a, b] : merges) merge_list.push_back(json::array({a, b}));
  json normalizer = nullptr;
  if (replace_spaces) normalizer = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kSpace}};
  return json{
      {"version", "1.0"},
      {"added_tokens",
       json::array({json{{"id", 900}, {"content", "<turn>"}, {"special", true}, {"normalized", false}}})},
      {"normalizer", normalizer},
      {"pre_tokenizer", split},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", json::array({json{{"SpecialToken", {{"id", "<turn>"}, {"type_id", 0}}}},
                                json{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders", json::array({json{{"type", "Replace"}, {"pattern", {{"String", kSpace}}}, {"content", " "}},
                                  json{{"type", "ByteFallback"}}, json{{"type", "Fuse"}}})}}},
      {"model",
       {{"type", "BPE"},
        {"unk_token", "<unk>"},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"vocab", vocab},
        {"merges", merge_list}}}};
}

vlmgen::Tokenizer load(const json& j) { return vlmgen::Tokenizer::from_json(j.dump()); }

TEST(SentencePieceTokenizer, SpacesBecomeTheMetaSymbolAndMergesApplyLowestRankFirst) {
  // pieces: ▁=257 a=258 b=259 ▁a=260 ab=261 ▁ab=262
  const auto tok = load(
      tiny_spm({kSpace, "a", "b", kSpace + "a", "ab", kSpace + "ab"}, {{"a", "b"}, {kSpace, "ab"}, {kSpace, "a"}}));
  // " ab": ▁ a b → (a b) first (rank 0) → ▁ ab → ▁ab.
  EXPECT_THAT(tok.encode(" ab"), ElementsAre(262));
  // " a a": ▁ a ▁ a → ▁a ▁a (no pre-tokenizer: one piece, merges by rank).
  EXPECT_THAT(tok.encode(" a a"), ElementsAre(260, 260));
  EXPECT_EQ(tok.decode({262, 260}), " ab a");
  // An added token splits the text; the post-processor's BOS is not added (add_special_tokens=False).
  EXPECT_THAT(tok.encode("a<turn>b"), ElementsAre(258, 900, 259));
}

TEST(SentencePieceTokenizer, ACharacterMissingFromTheVocabularyBecomesItsBytes) {
  const auto tok = load(tiny_spm({kSpace, "a", "\xC3\xA9"}, {}));  // é is a piece (259), ü is not
  // "aüé": a, then ü = C3 BC as two byte tokens, then é whole.
  EXPECT_THAT(tok.encode("a\xC3\xBC\xC3\xA9"), ElementsAre(258, 0xC3, 0xBC, 259));
  // A four-byte character (U+1F600) falls back to four byte tokens, never <unk>.
  EXPECT_THAT(tok.encode("\xF0\x9F\x98\x80"), ElementsAre(0xF0, 0x9F, 0x98, 0x80));
  // Decoding joins byte tokens back into the character; a byte token alone is one byte.
  EXPECT_EQ(tok.decode({258, 0xC3, 0xBC}), "a\xC3\xBC");
  EXPECT_EQ(tok.token_bytes(0x41), "A");
  // Streaming holds ü's byte tokens until their run ends (the next other token).
  vlmgen::StreamingDetokenizer detok(tok);
  EXPECT_EQ(detok.push(258), "a");
  EXPECT_EQ(detok.push(0xC3), "");
  EXPECT_EQ(detok.push(0xBC), "");
  EXPECT_EQ(detok.pending_bytes(), 2u);
  EXPECT_EQ(detok.push(258),
            "\xC3\xBC"
            "a");
}

TEST(SentencePieceTokenizer, ARunOfByteTokensThatIsNotUtf8DecodesToOneReplacementPerTokenAsHfDoes) {
  // HF's ByteFallback decoder: a run of <0xXX> tokens is its text when the whole run is valid
  // UTF-8, else one U+FFFD per token (the valid part of a spoiled run included). Expected strings
  // from that rule, written out by hand.
  const auto tok = load(tiny_spm({kSpace, "a"}, {}));  // a = 258; 中 = E4 B8 AD
  const std::string r = "\xEF\xBF\xBD";
  const std::vector<std::pair<std::vector<int64_t>, std::string>> cases = {
      {{0xE4, 0xB8}, r + r},                      // a cut character: one per token
      {{0xE4, 0xB8, 0xAD}, "\xE4\xB8\xAD"},       // whole: the character
      {{0xE4, 0xB8, 0xAD, 0xFF}, r + r + r + r},  // a stray byte spoils the whole run
      {{0xE4, 0xB8, 0x41}, r + r + r},            // 0x41 is a byte token too: same run
      {{0xE4, 0xB8, 258, 0x41}, r + r + "aA"},    // another token ends the run
      {{0xE4, 0xB8, 0xAD, 258, 0xFF},
       "\xE4\xB8\xAD"
       "a" +
           r},
      {{0xE4, 900, 0xB8, 0xAD}, "\xE4\xB8\xAD"},  // a skipped special token does not end it
      {{258, 0xC3}, "a" + r},
  };
  for (const auto& [ids, expected] : cases) {
    EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/true), expected) << json(ids).dump();
    vlmgen::StreamingDetokenizer detok(tok, /*skip_special_tokens=*/true);
    std::string streamed;
    for (int64_t id : ids) streamed += detok.push(id);
    streamed += detok.finish();
    EXPECT_EQ(streamed, expected) << "streamed " << json(ids).dump();
  }
  EXPECT_TRUE(tok.is_fallback_byte(0x41));
  EXPECT_FALSE(tok.is_fallback_byte(258));
  EXPECT_FALSE(tok.is_fallback_byte(100000));
}

TEST(SentencePieceTokenizer, ANormalizedAddedTokenIsFoundAsItsNormalizedContent) {
  json j = tiny_spm({kSpace, "a", "b"}, {});
  j["added_tokens"].push_back(json{{"id", 901}, {"content", "a b"}, {"special", false}, {"normalized", true}});
  const auto tok = load(j);
  // "a b" normalizes to "a▁b", where the token (its content normalized the same way) is found.
  EXPECT_THAT(tok.encode("ba b"), ElementsAre(259, 901));
  // A byte token's look-alike that is not one ("<0xZZ>") decodes as its text.
  const auto odd = load(tiny_spm({kSpace, "<0xZZ>"}, {}));
  EXPECT_EQ(odd.token_bytes(258), "<0xZZ>");
}

TEST(SentencePieceTokenizer, ALiteralSplitKeepsMergesInsideItsPieces) {
  // No normalizer: the space is " ". Merges: " b" (rank 0), "a " (rank 1).
  const std::vector<std::string> pieces = {" ", "a", "b", "a ", " b"};
  const std::vector<std::pair<std::string, std::string>> merges = {{" ", "b"}, {"a", " "}};
  const auto split = [](const char* behavior) {
    return json{{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", behavior}, {"invert", false}};
  };
  // One piece: " b" merges first → a, " b".
  EXPECT_THAT(load(tiny_spm(pieces, merges, nullptr, false)).encode("a b"), ElementsAre(258, 261));
  // MergedWithPrevious: "a ", "b" → "a " can merge, " b" cannot.
  EXPECT_THAT(load(tiny_spm(pieces, merges, split("MergedWithPrevious"), false)).encode("a b"), ElementsAre(260, 259));
  // Two spaces: "a ", " ", "b" (a match after a match stands alone).
  EXPECT_THAT(load(tiny_spm(pieces, merges, split("MergedWithPrevious"), false)).encode("a  b"),
              ElementsAre(260, 257, 259));
  // Isolated: "a", " ", "b".
  EXPECT_THAT(load(tiny_spm(pieces, merges, split("Isolated"), false)).encode("a b"), ElementsAre(258, 257, 259));
}

TEST(SentencePieceTokenizer, RefusesWhatItDoesNotImplementNamingIt) {
  json j = tiny_spm({kSpace}, {});
  j["normalizer"] = json{{"type", "Prepend"}, {"prepend", kSpace}};
  EXPECT_THAT(load_error(j), HasSubstr("normalizer Prepend is not supported"));
  j = tiny_spm({kSpace}, {});
  j["normalizer"]["pattern"] = json{{"Regex", " +"}};
  EXPECT_THAT(load_error(j), HasSubstr("Replace normalizer with pattern"));
  j = tiny_spm({kSpace}, {});
  j["model"]["byte_fallback"] = false;
  EXPECT_THAT(load_error(j), HasSubstr("needs byte_fallback"));
  j = tiny_spm({kSpace}, {});
  j["model"]["vocab"].erase("<0x41>");
  EXPECT_THAT(load_error(j), HasSubstr("no token for byte 0x41"));
  j = tiny_spm({kSpace}, {});
  j["decoder"]["decoders"].push_back(json{{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
  EXPECT_THAT(load_error(j), HasSubstr("decoder step Strip after Fuse"));
  j = tiny_spm({kSpace}, {});
  j["decoder"]["decoders"][0] = json{{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}};
  EXPECT_THAT(load_error(j), HasSubstr("decoder step Strip is not supported"));
  j = tiny_spm({kSpace}, {});
  j["decoder"] = json{{"type", "ByteLevel"}};
  EXPECT_THAT(load_error(j), HasSubstr("decoder ByteLevel is not supported without a ByteLevel pre-tokenizer"));
  j = tiny_spm({kSpace}, {}, json{{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Contiguous"}});
  EXPECT_THAT(load_error(j), HasSubstr("behavior \"Contiguous\" is not supported"));
  j = tiny_spm({kSpace}, {});
  j["normalizer"]["pattern"]["String"] = "";
  EXPECT_THAT(load_error(j), HasSubstr("(non-empty)"));
  j = tiny_spm({kSpace}, {}, json{{"type", "Split"}, {"pattern", {{"String", ""}}}, {"behavior", "Isolated"}});
  EXPECT_THAT(load_error(j), HasSubstr("Split pre-tokenizer with pattern"));
  j = tiny_spm({kSpace}, {}, json{{"type", "Metaspace"}, {"replacement", kSpace}});
  EXPECT_THAT(load_error(j), HasSubstr("pre-tokenizer Metaspace is not supported"));
}

// ---- the real Gemma-3 tokenizer against the JavaScript implementation ----

class GemmaTokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (vlmgen::testing_text::reference_unavailable()) return;
    const auto start = std::chrono::steady_clock::now();
    tokenizer_ =
        new vlmgen::Tokenizer(vlmgen::Tokenizer::from_pretrained(vlmgen::testing_text::gemma3_tokenizer_dir()));
    std::printf("[ measured ] Gemma-3 tokenizer.json (262,144 tokens + 514,906 merges) loaded in %.3f s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  static vlmgen::Tokenizer* tokenizer_;
};
vlmgen::Tokenizer* GemmaTokenizer::tokenizer_ = nullptr;

// The test corpus plus what Gemma's prompts hold: turn markers, image markers, runs of spaces
// and newlines, characters only byte fallback can write, and the meta symbol itself.
std::vector<std::string> gemma_strings() {
  std::vector<std::string> out = vlmgen::testing_text::tokenizer_test_strings(20261202, 2000);
  for (const char* s : {"<start_of_turn>user\nDescribe <start_of_image> in  two   words.<end_of_turn>\n",
                        "<bos><start_of_turn>model\n", "  leading and trailing  ", "\n\n\n\t\t x",
                        "\xF0\x93\x80\x80 \xF0\x90\x8C\xB0\xF0\x90\x8C\xB1 \xF4\x8F\xBF\xBD",
                        "a\xE2\x96\x81"
                        "b",
                        "<start_of_turn", "<0x41> is text, not a byte"}) {
    out.emplace_back(s);
  }
  return out;
}

TEST_F(GemmaTokenizer, IdsAndTextEqualTheJavaScriptImplementation) {
  VLMGEN_REQUIRE_NODE_REFERENCE();
  const std::vector<std::string> strings = gemma_strings();
  const auto expected = vlmgen::testing_text::run_reference("encode", {strings.begin(), strings.end()}, "gemma3");
  ASSERT_EQ(expected.size(), strings.size());
  std::vector<std::vector<int64_t>> all_ids;
  int64_t tokens = 0, mismatches = 0, byte_tokens = 0;
  const int64_t byte_0 = *tokenizer_->token_id("<0x00>"), byte_ff = *tokenizer_->token_id("<0xFF>");
  for (size_t i = 0; i < strings.size(); ++i) {
    std::vector<int64_t> ids = tokenizer_->encode(strings[i]);
    tokens += static_cast<int64_t>(ids.size());
    for (int64_t id : ids) byte_tokens += id >= byte_0 && id <= byte_ff;
    if (ids != expected[i].get<std::vector<int64_t>>() && ++mismatches <= 5) {
      ADD_FAILURE() << "string " << i << " " << json(strings[i]).dump() << "\n vlmgen: " << json(ids).dump()
                    << "\n js:     " << expected[i].dump();
    }
    if (!ids.empty()) all_ids.push_back(std::move(ids));
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(byte_tokens, 10);  // byte fallback did run
  std::vector<json> id_lines(all_ids.begin(), all_ids.end());
  const auto texts = vlmgen::testing_text::run_reference("decode", id_lines, "gemma3");
  ASSERT_EQ(texts.size(), all_ids.size());
  for (size_t i = 0; i < all_ids.size(); ++i) {
    EXPECT_EQ(tokenizer_->decode(all_ids[i]), texts[i].get<std::string>()) << json(all_ids[i]).dump();
  }
  std::printf("[ measured ] %zu strings, %lld tokens (%lld byte-fallback tokens), %lld differ from the JS tokenizer\n",
              strings.size(), static_cast<long long>(tokens), static_cast<long long>(byte_tokens),
              static_cast<long long>(mismatches));
}

TEST_F(GemmaTokenizer, KnowsGemmasSpecialTokensAndStreamsAsItDecodes) {
  VLMGEN_REQUIRE_NODE_REFERENCE();
  EXPECT_EQ(tokenizer_->token_id("<start_of_image>"), 255999);
  EXPECT_EQ(tokenizer_->token_id("<image_soft_token>"), 262144);
  EXPECT_EQ(tokenizer_->token_id("<end_of_turn>"), 106);
  EXPECT_EQ(tokenizer_->bos_token(), "<bos>");
  EXPECT_EQ(tokenizer_->eos_token(), "<end_of_turn>");
  int64_t held_back = 0;
  for (const std::string& s : gemma_strings()) {
    const std::vector<int64_t> ids = tokenizer_->encode(s);
    vlmgen::StreamingDetokenizer detok(*tokenizer_);
    std::string streamed;
    for (int64_t id : ids) {
      streamed += detok.push(id);
      if (detok.pending_bytes() > 0) ++held_back;
    }
    streamed += detok.finish();
    EXPECT_EQ(streamed, tokenizer_->decode(ids)) << json(s).dump();
  }
  EXPECT_GT(held_back, 10);  // byte tokens of one character arrive one at a time
}

}  // namespace
