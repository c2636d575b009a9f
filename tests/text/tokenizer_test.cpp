// The tokenizer: BPE rules on a hand-made tokenizer.json (expected ids worked out by hand), the
// real Qwen tokenizer against the JavaScript implementation of HF tokenizers, the streaming
// detokenizer, and what it refuses.

#include "vlmgen/text/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "node_reference.h"
#include "text_corpus.h"
#include "tiny_tokenizer.h"
#include "vlmgen/error.h"
#include "vlmgen/text/detokenizer.h"

namespace {

using nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using vlmgen::testing_text::byte_char;
using vlmgen::testing_text::tiny_tokenizer;

vlmgen::Tokenizer load(const json& j) { return vlmgen::Tokenizer::from_json(j.dump()); }

std::vector<int64_t> bytes_of(const std::string& s) {
  std::vector<int64_t> ids;
  for (unsigned char c : s) ids.push_back(c);
  return ids;
}

TEST(Tokenizer, MergesApplyLowestRankFirst) {
  // "b c" outranks "a b": abc → a + bc, and a + bc has no merge.
  auto tok = load(tiny_tokenizer({{"b", "c"}, {"a", "b"}, {"ab", "c"}}));
  EXPECT_THAT(tok.encode("abc"), ElementsAre('a', 256));
  // "a b" first: abc → ab + c → abc.
  auto tok2 = load(tiny_tokenizer({{"a", "b"}, {"ab", "c"}, {"b", "c"}}));
  EXPECT_THAT(tok2.encode("abc"), ElementsAre(257));
}

TEST(Tokenizer, AMergeListedTwiceTakesItsLaterRankAsHfDoes) {
  // HF tokenizers (and transformers.js) collect the merges into a map: the last listing wins.
  // "a b" at ranks 0 and 2, "b c" at 1: (b, c) now outranks (a, b), so abc → a + bc.
  auto tok = load(tiny_tokenizer({{"a", "b"}, {"b", "c"}, {"a", "b"}}));
  EXPECT_THAT(tok.encode("abc"), ElementsAre('a', 257));
  EXPECT_THAT(tok.encode("ab"), ElementsAre(256));  // still a merge
}

TEST(Tokenizer, EqualRanksMergeLeftmostFirstInShortAndLongPieces) {
  auto tok = load(tiny_tokenizer({{"a", "a"}, {"aa", "aa"}}));
  EXPECT_THAT(tok.encode("aaa"), ElementsAre(256, 'a'));
  // 100 and 101 bytes take the long-piece (heap) path: 50 "aa" → 25 "aaaa" (+ "a").
  EXPECT_EQ(tok.encode(std::string(100, 'a')), std::vector<int64_t>(25, 257));
  std::vector<int64_t> odd(25, 257);
  odd.push_back('a');
  EXPECT_EQ(tok.encode(std::string(101, 'a')), odd);
  // Both paths agree on every length around the switch.
  for (size_t n = 1; n < 120; ++n) {
    std::vector<int64_t> expected(n / 4, 257);
    if (n % 4 >= 2) expected.push_back(256);
    if (n % 2 == 1) expected.push_back('a');
    EXPECT_EQ(tok.encode(std::string(n, 'a')), expected) << n << " bytes";
  }
}

TEST(Tokenizer, MergesNeverCrossPreTokenizerPieces) {
  auto tok = load(tiny_tokenizer({{"a", " "}, {"a", "b"}}));
  EXPECT_THAT(tok.encode("a b"), ElementsAre('a', ' ', 'b'));  // \s+|\S+ cuts before the space
  EXPECT_THAT(tok.encode("ab"), ElementsAre(257));
}

TEST(Tokenizer, WhitespaceInTheRegexIsUnicodeWhiteSpace) {
  // \s is Unicode White_Space, as HF's regex engine has it: U+00A0 and U+3000 are spaces,
  // U+180E (Mongolian vowel separator, White_Space until Unicode 6.3) is not. A merge of "a"
  // with the first byte of each shows whether it landed in the same piece.
  auto tok = load(tiny_tokenizer({{"a", "\xC2"}, {"a", "\xE3"}, {"a", "\xE1"}}));
  EXPECT_THAT(tok.encode("a\u00A0"), ElementsAre('a', 0xC2, 0xA0));
  EXPECT_THAT(tok.encode("a\u3000"), ElementsAre('a', 0xE3, 0x80, 0x80));
  EXPECT_THAT(tok.encode("a\u180E"), ElementsAre(258, 0xA0, 0x8E));
}

TEST(Tokenizer, AddedTokensAreMatchedBeforeSplittingAndSpecialOnesCanBeTurnedOff) {
  auto tok = load(tiny_tokenizer({}));
  EXPECT_THAT(tok.encode("a<|x|>b<y>"), ElementsAre('a', 1000, 'b', 1001));
  vlmgen::EncodeOptions plain;
  plain.parse_special_tokens = false;
  std::vector<int64_t> expected = bytes_of("a<|x|>b");
  expected.push_back(1001);  // non-special added tokens are matched either way
  EXPECT_EQ(tok.encode("a<|x|>b<y>", plain), expected);
  EXPECT_EQ(tok.decode({'a', 1000, 'b'}), "a<|x|>b");
  EXPECT_EQ(tok.decode({'a', 1000, 'b'}, /*skip_special_tokens=*/true), "ab");
  EXPECT_TRUE(tok.is_special(1000));
  EXPECT_FALSE(tok.is_special(1001));
  EXPECT_EQ(tok.token_id("<|x|>"), 1000);
  EXPECT_EQ(tok.vocab_size(), 1002);
}

TEST(Tokenizer, NormalizesToNfcBeforeSplitting) {
  auto tok = load(tiny_tokenizer({}));
  EXPECT_EQ(tok.encode("e\u0301"), bytes_of("\u00E9"));  // e + combining acute → é
  EXPECT_EQ(tok.decode(tok.encode("Cafe\u0301")), "Caf\u00E9");
}

TEST(Tokenizer, RefusesInvalidUtf8NamingTheOffset) {
  auto tok = load(tiny_tokenizer({}));
  for (const std::string& bad :
       {std::string("ab\xFF"), std::string("ab\xC3"), std::string("\xED\xA0\x80"), std::string("x\xC0\xAF")}) {
    try {
      tok.encode(bad);
      FAIL() << "accepted invalid UTF-8";
    } catch (const vlmgen::Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("not valid UTF-8"));
      EXPECT_THAT(e.what(), HasSubstr("at offset"));
    }
  }
  EXPECT_THAT(tok.encode("ok"), ElementsAre('o', 'k'));  // still usable
}

TEST(Tokenizer, DecodeReplacesBrokenUtf8AndUnknownIdsWithReplacementCharacters) {
  auto tok = load(tiny_tokenizer({}));
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(tok.decode({0xE2, 0x82}), fffd);                    // a cut-short sequence: one U+FFFD
  EXPECT_EQ(tok.decode({0xE2, 0x82, 0xAC}), "\u20AC");          // whole: the euro sign
  EXPECT_EQ(tok.decode({0xFF, 'a', 0x80}), fffd + "a" + fffd);  // stray bytes: one each
  EXPECT_EQ(tok.decode({'a', 5000, 'b'}), "a" + fffd + "b");    // no such id
}

TEST(StreamingDetokenizer, HoldsACharacterUntilItIsWholeAndEmitsItOnce) {
  auto tok = load(tiny_tokenizer({}));
  vlmgen::StreamingDetokenizer detok(tok);
  EXPECT_EQ(detok.push('a'), "a");
  EXPECT_EQ(detok.push(0xF0), "");  // 😀 is F0 9F 98 80
  EXPECT_EQ(detok.push(0x9F), "");
  EXPECT_EQ(detok.push(0x98), "");
  EXPECT_EQ(detok.pending_bytes(), 3u);
  EXPECT_EQ(detok.push(0x80), "\U0001F600");
  EXPECT_EQ(detok.push(0xE2), "");
  EXPECT_EQ(detok.finish(), "\xEF\xBF\xBD");    // the stream ended inside a character
  EXPECT_EQ(detok.push('b'), "b");              // and a new stream starts clean
  EXPECT_EQ(detok.push(0xFF), "\xEF\xBF\xBD");  // never valid: replaced at once
}

// ---- what it refuses ----

using vlmgen::testing_text::load_error;

TEST(TokenizerRefuses, WhatItDoesNotImplementNamingIt) {
  json j = tiny_tokenizer({});
  j["model"]["type"] = "WordPiece";
  EXPECT_THAT(load_error(j), HasSubstr("model type WordPiece is not supported"));
  j = tiny_tokenizer({});
  j["normalizer"] = json{{"type", "NFKC"}};
  EXPECT_THAT(load_error(j), HasSubstr("normalizer NFKC is not supported"));
  j = tiny_tokenizer({});
  j["pre_tokenizer"] = json{{"type", "Metaspace"}};
  EXPECT_THAT(load_error(j), HasSubstr("pre-tokenizer Metaspace is not supported"));
  j = tiny_tokenizer({});
  j["model"]["byte_fallback"] = true;
  EXPECT_THAT(load_error(j), HasSubstr("byte_fallback"));
  j = tiny_tokenizer({});
  j["post_processor"] = json{{"type", "BertProcessing"}};
  EXPECT_THAT(load_error(j), HasSubstr("post-processor BertProcessing"));
  j = tiny_tokenizer({});
  j["added_tokens"][0]["lstrip"] = true;
  EXPECT_THAT(load_error(j), HasSubstr("lstrip"));
  j = tiny_tokenizer({});
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = json{{"Glob", " "}};
  EXPECT_THAT(load_error(j), HasSubstr("Split pre-tokenizer with pattern"));
  j = tiny_tokenizer({{"a", "b"}});
  j["model"]["merges"].push_back("q zz");
  EXPECT_THAT(load_error(j), HasSubstr("merge 1"));
  j = tiny_tokenizer({});
  j["model"]["vocab"].erase(byte_char('z'));
  EXPECT_THAT(load_error(j), HasSubstr("no token for byte 0x7A"));
  // A value of the wrong type where a name belongs (was an uncaught nlohmann::type_error: abort).
  j = tiny_tokenizer({});
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = 5;
  EXPECT_THAT(load_error(j), HasSubstr("behavior is 5"));
  // One id far past the entries (was a table of 16M strings, 530 MB, from a 4 KB file).
  j = tiny_tokenizer({});
  j["added_tokens"][0]["id"] = 16777215;
  EXPECT_THAT(load_error(j), HasSubstr("id 16777215 is far past"));
}

TEST(TokenizerRefuses, MissingAndCorruptFilesNamingThem) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("vlmgen-tok-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  try {
    vlmgen::Tokenizer::from_pretrained(dir.string());
    ADD_FAILURE() << "loaded a folder without tokenizer.json";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("has no tokenizer.json"));
    EXPECT_THAT(e.what(), HasSubstr(dir.string()));
  }
  const std::string text = tiny_tokenizer({{"a", "b"}}).dump();
  std::ofstream(dir / "tokenizer.json") << text.substr(0, text.size() / 2);  // cut in the middle
  try {
    vlmgen::Tokenizer::from_pretrained(dir.string());
    ADD_FAILURE() << "loaded a truncated tokenizer.json";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr((dir / "tokenizer.json").string()));
    EXPECT_THAT(e.what(), HasSubstr("not valid JSON"));
  }
  // A link that points at itself: an Error naming the file (was an uncaught filesystem_error).
  fs::remove(dir / "tokenizer.json");
  fs::create_symlink(dir / "tokenizer.json", dir / "tokenizer.json");
  try {
    vlmgen::Tokenizer::from_pretrained(dir.string());
    ADD_FAILURE() << "loaded a tokenizer.json that links to itself";
  } catch (const vlmgen::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("cannot tell whether it exists"));
    EXPECT_THAT(e.what(), HasSubstr((dir / "tokenizer.json").string()));
  }
  fs::remove(dir / "tokenizer.json");
  std::ofstream(dir / "tokenizer.json") << text;
  std::ofstream(dir / "tokenizer_config.json") << R"({"eos_token": {"content": "<|x|>"}, "pad_token": "<y>"})";
  const auto tok = vlmgen::Tokenizer::from_pretrained(dir.string());
  EXPECT_EQ(tok.eos_token(), "<|x|>");
  EXPECT_EQ(tok.pad_token(), "<y>");
  fs::remove_all(dir);
}

// ---- the real Qwen tokenizer against the JavaScript implementation ----

class QwenTokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (vlmgen::testing_text::reference_unavailable()) return;
    tokenizer_ = new vlmgen::Tokenizer(vlmgen::Tokenizer::from_pretrained(vlmgen::testing_text::qwen_tokenizer_dir()));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    tokenizer_ = nullptr;
  }
  static vlmgen::Tokenizer* tokenizer_;
};
vlmgen::Tokenizer* QwenTokenizer::tokenizer_ = nullptr;

TEST_F(QwenTokenizer, IdsEqualTheJavaScriptImplementationOn2000Strings) {
  VLMGEN_REQUIRE_NODE_REFERENCE();
  const auto strings = vlmgen::testing_text::tokenizer_test_strings(20261201, 2000);
  std::vector<json> inputs(strings.begin(), strings.end());
  const auto expected = vlmgen::testing_text::run_reference("encode", inputs);
  const auto nfc = vlmgen::testing_text::run_reference("nfc", inputs);
  ASSERT_EQ(expected.size(), strings.size());
  ASSERT_EQ(nfc.size(), strings.size());
  int64_t tokens = 0, mismatches = 0;
  for (size_t i = 0; i < strings.size(); ++i) {
    const std::vector<int64_t> ids = tokenizer_->encode(strings[i]);
    tokens += static_cast<int64_t>(ids.size());
    if (ids != expected[i].get<std::vector<int64_t>>() && ++mismatches <= 5) {
      ADD_FAILURE() << "string " << i << " " << json(strings[i]).dump() << "\n vlmgen: " << json(ids).dump()
                    << "\n js:     " << expected[i].dump();
    }
    EXPECT_EQ(tokenizer_->decode(ids), nfc[i].get<std::string>()) << "string " << i;
  }
  EXPECT_EQ(mismatches, 0);
  std::printf("[ measured ] %zu strings, %lld tokens, %lld differ from the JS tokenizer\n", strings.size(),
              static_cast<long long>(tokens), static_cast<long long>(mismatches));
}

TEST_F(QwenTokenizer, KnowsTheQwenVlSpecialTokens) {
  VLMGEN_REQUIRE_NODE_REFERENCE();
  EXPECT_EQ(tokenizer_->token_id("<|vision_start|>"), 151652);
  EXPECT_EQ(tokenizer_->token_id("<|image_pad|>"), 151655);
  EXPECT_EQ(tokenizer_->token_id("<|im_end|>"), 151645);
  EXPECT_THAT(tokenizer_->encode("<|im_start|>user\n"), ElementsAre(151644, 872, 198));
}

TEST_F(QwenTokenizer, StreamingDetokenizerEqualsOneShotDecodeTokenByToken) {
  VLMGEN_REQUIRE_NODE_REFERENCE();
  int64_t held_back = 0;
  for (const std::string& s : vlmgen::testing_text::tokenizer_test_strings(20261201, 2000)) {
    const std::vector<int64_t> ids = tokenizer_->encode(s);
    vlmgen::StreamingDetokenizer detok(*tokenizer_);
    std::string streamed;
    for (int64_t id : ids) {
      const std::string piece = detok.push(id);
      // Every piece is whole UTF-8: encoding it again (which refuses broken UTF-8) works.
      EXPECT_NO_THROW(tokenizer_->encode(piece, vlmgen::EncodeOptions{false})) << json(s).dump();
      if (detok.pending_bytes() > 0) ++held_back;
      streamed += piece;
    }
    streamed += detok.finish();
    EXPECT_EQ(streamed, tokenizer_->decode(ids)) << json(s).dump();
  }
  EXPECT_GT(held_back, 100);  // the corpus does split characters between tokens
}

TEST_F(QwenTokenizer, LoadsTheRealFileAndSaysHowLongItTook) {
  VLMGEN_REQUIRE_NODE_REFERENCE();
  const auto start = std::chrono::steady_clock::now();
  const auto tok = vlmgen::Tokenizer::from_pretrained(vlmgen::testing_text::qwen_tokenizer_dir());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("[ measured ] tokenizer.json (151,643 tokens + 151,387 merges) loaded in %.3f s\n", seconds);
  EXPECT_EQ(tok.vocab_size(), 151669);
}

}  // namespace
