// Chat with a Qwen-VL or Gemma-3 checkpoint folder (config, weights, tokenizer, chat template),
// streaming the answer as text.
//
//   vlmgen-chat --model DIR --image beach.jpg "Describe this image."   # one question
//   vlmgen-chat --model DIR                                            # interactive
//
// Interactive: each line is a user turn; "/image PATH" attaches an image to the next turn,
// "/reset" starts a new conversation, "/quit" (or end of input) leaves. The conversation keeps
// one KV cache (InferenceContext), so each turn computes only its own new columns and sends
// only its own new images. Under --nproc N, rank 0 reads the input and sends it to the others.

#include "vlmgen/text/chat.h"

#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/distributed/launch.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/image/preprocessor_config.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/models/qwen_vl.h"
#include "vlmgen/text/detokenizer.h"

namespace {

struct Options {
  std::string model, prompt, system;
  std::string dtype = "f32";  // weights dtype of the language model
  std::string kv_dtype = "f32";
  std::string device = "cpu";
  std::vector<std::string> images;
  int64_t max_new_tokens = 512, context = 4096, max_pixels = 0, min_pixels = 0;
  bool no_kv_cache = false, add_vision_id = false, quiet = false, print_ids = false;
  double temperature = 0.0, top_p = 1.0;
  uint64_t seed = 0;
  int nproc = 1;
  int64_t timeout_s = 600;
};

// Rank 0's line on every rank (false at the end of input).
bool read_line(const vlmgen::ParallelContext& parallel, std::string* line) {
  bool ok = true;
  if (parallel.rank() == 0) {
    fmt::print("> ");
    std::fflush(stdout);
    ok = static_cast<bool>(std::getline(std::cin, *line));
  }
  if (parallel.tp_size() == 1) return ok;
  // A line travels with '\n' appended, so an empty message means the end of input.
  std::string message = ok ? *line + '\n' : std::string();
  vlmgen::broadcast_bytes(*parallel.tp_group(), message, 0);
  if (message.empty()) return false;
  line->assign(message, 0, message.size() - 1);
  return true;
}

class ChatRunner {
 public:
  ChatRunner(const Options& options, vlmgen::ParallelContext parallel)
      : options_(options), parallel_(std::move(parallel)), lead_(parallel_.rank() == 0) {
    // The tokenizer and the template first: a folder vlmgen cannot chat with fails before its
    // weights are read.
    tokenizer_ = std::make_unique<vlmgen::Tokenizer>(vlmgen::Tokenizer::from_pretrained(options.model));
    const vlmgen::ChatTemplate chat_template = vlmgen::ChatTemplate::from_pretrained(options.model);
    VLMGEN_CHECK(!options.add_vision_id || chat_template.name() == "qwen2-vl",
                 "--add-vision-id is an option of the Qwen2-VL template; this folder's template is {}",
                 chat_template.name());
    model_ = vlmgen::load_model(options.model, parallel_,
                                vlmgen::load_options_for(options.dtype, options.device, options.kv_dtype));
    std::string source;
    processor_ = std::make_unique<vlmgen::ChatProcessor>(*tokenizer_, chat_template, image_format(&source));
    end_ids_ = vlmgen::end_token_ids_from_pretrained(options.model, *tokenizer_);
    if (lead_ && !options.quiet) {
      fmt::print(stderr, "model {}: vocab {}; chat template {}; images preprocessed with {}; end tokens {}\n",
                 options.model, tokenizer_->vocab_size(), processor_->chat_template().name(), source,
                 fmt::join(end_ids_, ","));
    }
    reset();
  }

  // How this checkpoint's family writes and preprocesses images.
  vlmgen::ChatImageFormat image_format(std::string* source) const {
    if (const auto* qwen = dynamic_cast<const vlmgen::QwenVl*>(model_.get())) {
      auto image_options = vlmgen::checkpoint_image_processor(options_.model, qwen->config(), source);
      if (options_.max_pixels > 0) image_options.max_pixels(options_.max_pixels);
      if (options_.min_pixels > 0) image_options.min_pixels(options_.min_pixels);
      return vlmgen::ChatImageFormat::qwen_vl(*tokenizer_, image_options);
    }
    VLMGEN_CHECK(options_.max_pixels == 0 && options_.min_pixels == 0,
                 "--max-pixels/--min-pixels apply to the Qwen-VL families only (this model resizes to its own size)");
    return vlmgen::ChatImageFormat::from_pretrained(options_.model, *tokenizer_, source);
  }

  void reset() {
    vlmgen::ChatOptions chat_options;
    chat_options.add_vision_id = options_.add_vision_id;
    session_ = std::make_unique<vlmgen::ChatSession>(*processor_, chat_options);
    context_.reset();
    if (!options_.no_kv_cache) {
      context_ = vlmgen::InferenceContext::allocate(model_->traits().kv_cache, 1, options_.context, model_->device());
    }
    first_turn_ = true;
  }

  // One user turn: streams the answer; returns false when it failed (the session, the context
  // and the attached images are then as they were before the turn).
  bool turn(const std::string& text, std::vector<std::string>& images) {
    const vlmgen::ChatSession saved_session = *session_;
    const std::vector<std::string> saved_images = images;
    const int64_t saved_length = context_ ? context_->length() : 0;
    const bool saved_first_turn = first_turn_;
    const auto restore = [&] {
      session_ = std::make_unique<vlmgen::ChatSession>(saved_session);
      images = saved_images;
      if (context_ && context_->length() > saved_length) context_->truncate(saved_length);
      first_turn_ = saved_first_turn;
    };
    std::vector<vlmgen::ChatMessage> messages;
    if (first_turn_ && !options_.system.empty()) messages.emplace_back("system", options_.system);
    vlmgen::ChatMessage user("user");
    for (const auto& path : images) user.image_file(path);
    user.text(text);
    messages.push_back(std::move(user));
    try {
      const auto t = session_->add(std::move(messages));
      images.clear();
      first_turn_ = false;
      auto config = vlmgen::GenerationConfig()
                        .max_new_tokens(options_.max_new_tokens)
                        .enable_kv_cache(!options_.no_kv_cache)
                        .temperature(options_.temperature)
                        .top_p(options_.top_p)
                        .seed(options_.seed)
                        .end_token_ids(end_ids_);
      vlmgen::StreamingDetokenizer detok(*tokenizer_, /*skip_special_tokens=*/true);
      vlmgen::GenerateRequest request({t.ids}, t.vision, context_.get());
      request.on_token = [&](const vlmgen::TokenEvent& e) {
        if (lead_) {
          fmt::print("{}", detok.push(e.token));
          std::fflush(stdout);
        }
        return true;
      };
      const auto result = vlmgen::Generator(*model_, parallel_).generate(request, config);
      const auto& out = result.sequences[0];
      try {
        session_->add_reply(out.tokens);
      } catch (const vlmgen::Error& e) {
        reset();  // the reply cannot be continued from; start over rather than mis-cache
        if (lead_) fmt::print(stderr, "\nerror: {} (starting a new conversation)\n", e.what());
        return false;
      }
      if (lead_) {
        fmt::print("{}\n", detok.finish());
        if (options_.print_ids) {
          fmt::print(stderr, "prompt ids: {}\nanswer ids: {}\n", fmt::join(t.ids, " "), fmt::join(out.tokens, " "));
        }
        if (!options_.quiet) {
          fmt::print(stderr,
                     "[{} new prompt tokens ({} in all, {} images), {} tokens, {}; first token {:.2f} s, {:.1f} "
                     "tokens/s]\n",
                     t.new_ids, t.ids.size(), session_->num_images(), out.tokens.size(),
                     vlmgen::to_string(out.finish_reason), result.stats.time_to_first_token_s,
                     result.stats.decode_tokens_per_s);
        }
      }
      return true;
    } catch (const std::exception& e) {  // vlmgen::Error, or an error of LibTorch's
      restore();
      if (lead_) fmt::print(stderr, "\nerror: {}\n", e.what());
      return false;
    }
  }

 private:
  const Options& options_;
  vlmgen::ParallelContext parallel_;
  bool lead_;
  std::unique_ptr<vlmgen::CausalVlm> model_;
  std::unique_ptr<vlmgen::Tokenizer> tokenizer_;
  std::unique_ptr<vlmgen::ChatProcessor> processor_;
  std::unique_ptr<vlmgen::ChatSession> session_;
  std::unique_ptr<vlmgen::InferenceContext> context_;
  std::vector<int64_t> end_ids_;
  bool first_turn_ = true;
};

int run_interactive(ChatRunner& runner, const vlmgen::ParallelContext& parallel, std::vector<std::string> images) {
  const bool lead = parallel.rank() == 0;
  if (lead) fmt::print(stderr, "interactive chat: /image PATH attaches an image, /reset, /quit\n");
  std::string line;
  while (read_line(parallel, &line)) {
    if (line == "/quit" || line == "/exit") break;
    if (line.empty()) continue;
    if (line == "/reset") {
      runner.reset();
      images.clear();
      if (lead) fmt::print(stderr, "(new conversation)\n");
      continue;
    }
    if (line.rfind("/image ", 0) == 0) {
      images.push_back(line.substr(7));
      if (lead) fmt::print(stderr, "(image {} attached to the next turn)\n", images.back());
      continue;
    }
    runner.turn(line, images);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  vlmgen::detail::prefer_passive_openmp_wait(argv);
  CLI::App app("Chat with a Qwen-VL or Gemma-3 checkpoint folder, streaming text");
  Options o;
  app.add_option("--model", o.model, "HF checkpoint folder: config.json, *.safetensors, tokenizer.json, chat template")
      ->required();
  app.add_option("prompt", o.prompt, "the question (without it: an interactive chat on standard input)");
  app.add_option("--image", o.images, "PNG/JPEG file for the (first) turn, before its text (repeatable)")
      ->allow_extra_args(false);
  app.add_option("--system", o.system, "system message (default: the template's own)");
  app.add_option("--dtype", o.dtype,
                 "weights of the language model: f32, bf16 (half the bytes a decode step reads), f16, or fp8 (an FP8 "
                 "checkpoint's linears kept as bytes, the rest bf16; CPU)")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "fp8"}))
      ->capture_default_str();
  app.add_option("--kv-dtype", o.kv_dtype, vlmgen::kKvCacheDtypeHelp)
      ->check(CLI::IsMember({"f32", "bf16", "fp8"}))
      ->capture_default_str();
  app.add_option("--device", o.device,
                 "cpu, cuda or cuda:N (with --nproc, 'cuda' gives each rank the device of its local rank; use "
                 "--dtype bf16 there)")
      ->capture_default_str();
  app.add_option("--max-new-tokens", o.max_new_tokens, "new tokens per answer at most")->capture_default_str();
  app.add_option("--context", o.context, "KV-cache columns for the whole conversation")->capture_default_str();
  app.add_flag("--no-kv-cache", o.no_kv_cache, "recompute the whole conversation at every step");
  app.add_option("--temperature", o.temperature, "0 = greedy")->capture_default_str();
  app.add_option("--top-p", o.top_p, "nucleus sampling mass")->capture_default_str();
  app.add_option("--seed", o.seed, "sampling seed")->capture_default_str();
  app.add_option("--max-pixels", o.max_pixels, "resize images to at most this many pixels");
  app.add_option("--min-pixels", o.min_pixels, "resize images to at least this many pixels");
  app.add_flag("--add-vision-id", o.add_vision_id, "write \"Picture N: \" before each image");
  app.add_flag("--quiet", o.quiet, "print only the answers");
  app.add_flag("--print-ids", o.print_ids, "after each answer, print the prompt's and the answer's token ids");
  app.add_option("--nproc", o.nproc, "tensor-parallel ranks to start on this machine")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--timeout", o.timeout_s, "seconds a rank waits for its peers")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    vlmgen::LaunchOptions launch;
    launch.timeout = std::chrono::hours(24 * 365);
    if (auto status = vlmgen::relaunch_as_local_ranks(o.nproc, argc, argv, launch)) return *status;
  } catch (const vlmgen::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  try {
    vlmgen::ParallelContext parallel =
        vlmgen::init_parallel_from_env(0, vlmgen::DistributedOptions().timeout(std::chrono::seconds(o.timeout_s)));
    ChatRunner runner(o, parallel);
    if (o.prompt.empty()) return run_interactive(runner, parallel, o.images);
    std::vector<std::string> images = o.images;
    return runner.turn(o.prompt, images) ? 0 : 1;
  } catch (const vlmgen::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
