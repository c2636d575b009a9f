// libFuzzer target: the tokenizer. The first byte picks what the rest is:
//   0: text for a fixed tokenizer (Qwen's pre-tokenizer regex, NFC, a few merges and added
//      tokens): encode must refuse invalid UTF-8 with vlmgen::Error, and for valid text
//      encode(decode(encode(s))) == encode(s), and the streaming detokenizer equals decode;
//   1: a tokenizer.json from a stranger: loading refuses it with vlmgen::Error or gives a
//      tokenizer whose encode/decode of a short text work;
//   2: token ids (2 bytes each) to decode and stream, unknown ids included.

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "vlmgen/error.h"
#include "vlmgen/text/detokenizer.h"
#include "vlmgen/text/tokenizer.h"

namespace {

std::string byte_char(int b) {
  int next = 256, cp = 0;
  for (int i = 0; i <= b; ++i) {
    const bool printable = (i >= 33 && i <= 126) || (i >= 161 && i <= 172) || (i >= 174 && i <= 255);
    cp = printable ? i : next++;
  }
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

std::string escape(const std::string& s) {  // JSON string body
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

const vlmgen::Tokenizer& fixed_tokenizer() {
  static const vlmgen::Tokenizer tokenizer = [] {
    std::string vocab;
    for (int b = 0; b < 256; ++b) vocab += "\"" + escape(byte_char(b)) + "\":" + std::to_string(b) + ",";
    const std::vector<std::pair<std::string, std::string>> merges = {
        {"t", "h"}, {"th", "e"}, {" ", "t"}, {"\xC3", "\xA9"}, {"\xE2", "\x80"}, {" ", " "}, {"  ", "  "}};
    std::string merge_list;
    int next = 256;
    for (const auto& [a, b] : merges) {
      std::string merged;
      for (char c : a + b) merged += byte_char(static_cast<uint8_t>(c));
      vocab += "\"" + escape(merged) + "\":" + std::to_string(next++) + ",";
      std::string left, right;
      for (char c : a) left += byte_char(static_cast<uint8_t>(c));
      for (char c : b) right += byte_char(static_cast<uint8_t>(c));
      merge_list += (merge_list.empty() ? "" : ",") + std::string("\"") + escape(left) + " " + escape(right) + "\"";
    }
    vocab.pop_back();
    const std::string json =
        R"({"added_tokens":[{"id":300,"content":"<|im_start|>","special":true},{"id":301,"content":"<x>"}],)"
        R"("normalizer":{"type":"NFC"},"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Split",)"
        R"("pattern":{"Regex":"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},)"
        R"("behavior":"Isolated","invert":false},{"type":"ByteLevel","add_prefix_space":false,"use_regex":false}]},)"
        R"("decoder":{"type":"ByteLevel"},"model":{"type":"BPE","vocab":{)" +
        vocab + R"(},"merges":[)" + merge_list + "]}}";
    return vlmgen::Tokenizer::from_json(json, "fuzz tokenizer");
  }();
  return tokenizer;
}

void check_stream(const vlmgen::Tokenizer& tok, const std::vector<int64_t>& ids) {
  vlmgen::StreamingDetokenizer detok(tok);
  std::string streamed;
  for (int64_t id : ids) streamed += detok.push(id);
  streamed += detok.finish();
  if (streamed != tok.decode(ids)) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0: {
      const vlmgen::Tokenizer& tok = fixed_tokenizer();
      std::vector<int64_t> ids;
      try {
        ids = tok.encode(rest);
      } catch (const vlmgen::Error&) {
        return 0;  // invalid UTF-8
      }
      if (tok.encode(tok.decode(ids)) != ids) std::abort();
      check_stream(tok, ids);
      break;
    }
    case 1: {
      try {
        const vlmgen::Tokenizer tok = vlmgen::Tokenizer::from_json(rest, "fuzz input");
        const auto ids = tok.encode("The café <|im_start|> 12 \xF0\x9F\x98\x80\n");
        check_stream(tok, ids);
      } catch (const vlmgen::Error&) {
      }
      break;
    }
    default: {
      const vlmgen::Tokenizer& tok = fixed_tokenizer();
      std::vector<int64_t> ids;
      for (size_t i = 0; i + 1 < rest.size(); i += 2) {
        ids.push_back(static_cast<int64_t>(static_cast<uint8_t>(rest[i]) | (static_cast<uint8_t>(rest[i + 1]) << 8)) %
                      400);
      }
      check_stream(tok, ids);
      break;
    }
  }
  return 0;
}
