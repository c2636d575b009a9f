// Tokenizes with a checkpoint folder's tokenizer.json: one JSON string per input line in, one
// JSON array of ids per line out (with --decode, the other way). A line that fails prints
// `null` (so output lines stay aligned with input lines) and an error naming the line on
// standard error; the exit status is then 1.
//
//   echo '"Hello <|image_pad|>"' | vlmgen-tokenize --model DIR
//   echo '[9707, 151655]' | vlmgen-tokenize --model DIR --decode

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "vlmgen/error.h"
#include "vlmgen/text/tokenizer.h"

int main(int argc, char** argv) {
  CLI::App app("Token ids of JSON strings (one per line), or text of JSON id arrays with --decode");
  std::string model;
  bool decode = false, no_special = false, skip_special = false;
  app.add_option("--model", model, "checkpoint folder with tokenizer.json")->required();
  app.add_flag("--decode", decode, "read JSON arrays of ids, print JSON strings");
  app.add_flag("--no-special", no_special, "encode special-token text as ordinary characters");
  app.add_flag("--skip-special", skip_special, "leave special tokens out when decoding");
  CLI11_PARSE(app, argc, argv);
  try {
    const auto tokenizer = vlmgen::Tokenizer::from_pretrained(model);
    vlmgen::EncodeOptions options;
    options.parse_special_tokens = !no_special;
    std::string line;
    int status = 0;
    for (int64_t number = 1; std::getline(std::cin, line); ++number) {
      try {
        nlohmann::json in;
        try {
          in = nlohmann::json::parse(line);
        } catch (const nlohmann::json::exception& e) {
          VLMGEN_FAIL("not JSON: {}", e.what());
        }
        nlohmann::json out;
        if (decode) {
          VLMGEN_CHECK(in.is_array(), "expected a JSON array of token ids");
          std::vector<int64_t> ids;
          for (const auto& v : in) {
            VLMGEN_CHECK(v.is_number_integer(), "expected token ids, got {}", v.dump());
            ids.push_back(v.get<int64_t>());
          }
          out = tokenizer.decode(ids, skip_special);
        } else {
          VLMGEN_CHECK(in.is_string(), "expected a JSON string");
          out = tokenizer.encode(in.get<std::string>(), options);
        }
        fmt::print("{}\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
      } catch (const vlmgen::Error& e) {
        fmt::print("null\n");
        fmt::print(stderr, "line {}: {}\n", number, e.what());
        status = 1;
      }
    }
    return status;
  } catch (const vlmgen::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
