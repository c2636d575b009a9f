#pragma once

// A small byte-level BPE tokenizer.json written by hand for tests that need exact, hand-checked ids,
// and the error a tokenizer.json gets when loading.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "vlmgen/error.h"
#include "vlmgen/text/tokenizer.h"

namespace vlmgen::testing_text {

using nlohmann::json;

// GPT-2's byte alphabet (a fact of the format): printable Latin-1 bytes stand for themselves,
// the other 68 bytes for U+0100.. in byte order.
inline std::string byte_char(int b) {
  static const std::vector<int> code_points = [] {
    std::vector<int> cp(256);
    int next = 256;
    for (int i = 0; i < 256; ++i) {
      const bool printable = (i >= 33 && i <= 126) || (i >= 161 && i <= 172) || (i >= 174 && i <= 255);
      cp[static_cast<size_t>(i)] = printable ? i : next++;
    }
    return cp;
  }();
  const int c = code_points[static_cast<size_t>(b)];
  std::string out;
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
  return out;
}

inline std::string chars(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) out += byte_char(b);
  return out;
}

// A small byte-level BPE: ids 0..255 are the bytes, then the merged tokens in `merges` order.
inline json tiny_tokenizer(const std::vector<std::pair<std::string, std::string>>& merges,
                           const std::string& pattern = R"(\s+|\S+)",
                           const std::vector<std::string>& more_special = {}) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  json merge_list = json::array();
  int next = 256;
  for (const auto& [a, b] : merges) {
    const std::string merged = chars(a + b);
    if (!vocab.contains(merged)) vocab[merged] = next++;
    merge_list.push_back(chars(a) + " " + chars(b));
  }
  json added = json::array({json{{"id", 1000}, {"content", "<|x|>"}, {"special", true}, {"normalized", false}},
                            json{{"id", 1001}, {"content", "<y>"}, {"special", false}, {"normalized", false}}});
  for (const std::string& content : more_special) {
    added.push_back(
        json{{"id", 1002 + added.size() - 2}, {"content", content}, {"special", true}, {"normalized", false}});
  }
  return json{
      {"version", "1.0"},
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array(
             {json{{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
              json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}}},
      {"post_processor", {{"type", "ByteLevel"}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}}}};
}

/// The message of the vlmgen::Error that loading `j` throws; a test failure (and "") when it loads.
inline std::string load_error(const json& j) {
  try {
    Tokenizer::from_json(j.dump());
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "loaded " << j.dump().substr(0, 200);
  return "";
}

}  // namespace vlmgen::testing_text
