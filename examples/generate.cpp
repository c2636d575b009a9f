// Runs generation from a Qwen-VL, Gemma-3 or LLaVA-NeXT checkpoint directory, token ids and image files, printing the
// tokens as they stream.
//
//   vlmgen-generate --checkpoint DIR --prompt "5 6 <image> 7" --image cat.png
//   vlmgen-generate --checkpoint DIR --text "Hello <image> what is this?" --image cat.png
//                   [--max-new-tokens 16] [--no-kv-cache] [--replay span-aware|always|step-zero]
//                   [--nproc N [--sequence-parallel]]
//
// Each "<image>" in the prompt becomes vision_start, the image's placeholder tokens and
// vision_end, for the next --image file in order. --text is tokenized with the checkpoint's
// tokenizer.json (no chat template: see vlmgen-chat for that).
//
// Tensor parallelism: --nproc N starts N local ranks on 127.0.0.1 (this program again, with the
// torchrun variables set); started by torchrun or another launcher that sets RANK, WORLD_SIZE,
// MASTER_ADDR and MASTER_PORT, it joins that world instead. Either way every rank loads its
// slices of the checkpoint and the whole world is one tensor-parallel group; rank 0 prints.

#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/distributed/launch.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/image/gemma3_image_processor.h"
#include "vlmgen/image/llava_next_image_processor.h"
#include "vlmgen/image/preprocessor_config.h"
#include "vlmgen/image/qwen_image_processor.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/models/llava_next.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/models/qwen_vl.h"
#include "vlmgen/text/tokenizer.h"

namespace {

std::vector<int64_t> build_prompt(const std::string& text, const vlmgen::ModelTraits& config,
                                  const std::vector<int64_t>& image_tokens) {
  std::vector<int64_t> ids;
  std::istringstream words(text);
  std::string word;
  size_t image = 0;
  while (words >> word) {
    if (word == "<image>") {
      VLMGEN_CHECK(image < image_tokens.size(), "the prompt has more <image> markers than the {} --image files",
                   image_tokens.size());
      if (config.vision_start_token_id) ids.push_back(*config.vision_start_token_id);
      ids.insert(ids.end(), static_cast<size_t>(image_tokens[image++]), *config.image_token_id);
      if (config.vision_end_token_id) ids.push_back(*config.vision_end_token_id);
      continue;
    }
    size_t used = 0;
    int64_t id = 0;
    try {
      id = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    VLMGEN_CHECK(used == word.size(), "prompt word '{}' is neither a token id nor <image>", word);
    ids.push_back(id);
  }
  VLMGEN_CHECK(image == image_tokens.size(), "{} --image files but {} <image> markers in the prompt",
               image_tokens.size(), image);
  return ids;
}

// --text: the text between "<image>" markers through the tokenizer, images as in --prompt.
std::vector<int64_t> tokenize_prompt(const std::string& text, const std::string& checkpoint,
                                     const vlmgen::ModelTraits& config, const std::vector<int64_t>& image_tokens) {
  const auto tokenizer = vlmgen::Tokenizer::from_pretrained(checkpoint);
  static constexpr std::string_view kMarker = "<image>";
  std::vector<int64_t> ids;
  size_t image = 0, from = 0;
  while (true) {
    const size_t at = text.find(kMarker, from);
    const std::vector<int64_t> piece = tokenizer.encode(std::string_view(text).substr(from, at - from));
    ids.insert(ids.end(), piece.begin(), piece.end());
    if (at == std::string::npos) break;
    VLMGEN_CHECK(image < image_tokens.size(), "the text has more <image> markers than the {} --image files",
                 image_tokens.size());
    if (config.vision_start_token_id) ids.push_back(*config.vision_start_token_id);
    ids.insert(ids.end(), static_cast<size_t>(image_tokens[image++]), *config.image_token_id);
    if (config.vision_end_token_id) ids.push_back(*config.vision_end_token_id);
    from = at + kMarker.size();
  }
  VLMGEN_CHECK(image == image_tokens.size(), "{} --image files but {} <image> markers in the text", image_tokens.size(),
               image);
  return ids;
}

// Whether the model's vision tower is split across the tensor-parallel ranks (every family decides
// at load; see vision_tower_sharded()).
bool vision_tower_sharded(vlmgen::CausalVlm& model) {
  if (auto* qwen = dynamic_cast<vlmgen::QwenVl*>(&model)) return qwen->vision_tower_sharded();
  if (auto* gemma = dynamic_cast<vlmgen::Gemma3*>(&model)) return gemma->vision_tower_sharded();
  if (auto* llava = dynamic_cast<vlmgen::LlavaNext*>(&model)) return llava->vision_tower_sharded();
  return false;
}

// The images as the checkpoint's family and folder preprocess them (HF's settings, so the model
// sees what it would under HF); --max-pixels/--min-pixels override a Qwen-VL folder's and say so.
vlmgen::VisionInputs preprocess_for(vlmgen::CausalVlm& model, const std::string& checkpoint,
                                    const std::vector<vlmgen::Image>& images, int64_t max_pixels, int64_t min_pixels,
                                    bool lead) {
  auto* qwen = dynamic_cast<vlmgen::QwenVl*>(&model);
  auto* gemma = dynamic_cast<vlmgen::Gemma3*>(&model);
  auto* llava = dynamic_cast<vlmgen::LlavaNext*>(&model);
  VLMGEN_CHECK(qwen != nullptr || (max_pixels == 0 && min_pixels == 0),
               "--max-pixels/--min-pixels apply to the Qwen-VL families only (this model resizes to its own tiles)");
  if (llava != nullptr) {
    if (images.empty()) return {};
    return vlmgen::preprocess_llava_next(images, vlmgen::llava_next_image_processor(checkpoint, llava->config()));
  }
  if (gemma != nullptr) {
    const auto options = vlmgen::gemma3_image_processor(checkpoint, gemma->config().image_size);
    return images.empty() ? vlmgen::VisionInputs() : vlmgen::preprocess_gemma3(images, options);
  }
  VLMGEN_CHECK(qwen != nullptr, "vlmgen-generate has no image preprocessing for this model");
  std::string source;
  auto options = vlmgen::checkpoint_image_processor(checkpoint, qwen->config(), &source);
  if (lead && !images.empty()) fmt::print(stderr, "images preprocessed with {}\n", source);
  if (max_pixels > 0) {
    if (lead) fmt::print(stderr, "--max-pixels {} overrides max_pixels {}\n", max_pixels, options.max_pixels());
    options.max_pixels(max_pixels);
  }
  if (min_pixels > 0) {
    if (lead) fmt::print(stderr, "--min-pixels {} overrides min_pixels {}\n", min_pixels, options.min_pixels());
    options.min_pixels(min_pixels);
  }
  return images.empty() ? vlmgen::VisionInputs() : vlmgen::preprocess(images, options);
}

}  // namespace

int main(int argc, char** argv) {
  vlmgen::detail::prefer_passive_openmp_wait(argv);
  CLI::App app("Generate with a Qwen-VL, Gemma-3 or LLaVA-NeXT checkpoint, streaming tokens");
  std::string checkpoint, prompt_text, replay = "span-aware";
  std::vector<std::string> image_paths;
  std::vector<int64_t> end_ids;
  int64_t max_new_tokens = 16, max_pixels = 0, min_pixels = 0;
  bool no_kv_cache = false;
  double temperature = 0.0;
  uint64_t seed = 0;
  app.add_option("--checkpoint", checkpoint, "directory with config.json and *.safetensors")->required();
  std::string text;
  auto* prompt_option =
      app.add_option("--prompt", prompt_text, "token ids separated by spaces; <image> marks an image");
  auto* text_option =
      app.add_option("--text", text, "text for the checkpoint's tokenizer.json; <image> marks an image");
  prompt_option->excludes(text_option);
  app.add_option("--end-id", end_ids, "token id that ends generation (repeatable)");
  app.add_option("--image", image_paths, "PNG/JPEG file for each <image>, in order");
  app.add_option("--max-new-tokens", max_new_tokens, "new tokens at most")->capture_default_str();
  app.add_option("--max-pixels", max_pixels,
                 "resize images to at most this many pixels (default: the checkpoint's preprocessor_config.json)");
  app.add_option("--min-pixels", min_pixels,
                 "resize images to at least this many pixels (default: the checkpoint's preprocessor_config.json)");
  app.add_flag("--no-kv-cache", no_kv_cache, "recompute the whole prefix at every step");
  app.add_option("--replay", replay, "which calls get the images")
      ->check(CLI::IsMember({"span-aware", "always", "step-zero"}))
      ->capture_default_str();
  app.add_option("--temperature", temperature, "0 = greedy")->capture_default_str();
  app.add_option("--seed", seed, "sampling seed")->capture_default_str();
  int nproc = 1;
  int64_t batch = 1;
  std::string dtype = "f32", device = "cpu", kv_dtype = "f32";
  bool sequence_parallel = false;
  int64_t timeout_s = 60;
  app.add_option("--dtype", dtype, "the language model's weights: f32, bf16, f16, or fp8 (an FP8 checkpoint, CPU)")
      ->capture_default_str();
  app.add_option("--kv-dtype", kv_dtype, vlmgen::kKvCacheDtypeHelp)
      ->check(CLI::IsMember({"f32", "bf16", "fp8"}))
      ->capture_default_str();
  app.add_option("--device", device,
                 "cpu, cuda or cuda:N (with --nproc, 'cuda' gives each rank the device of its local rank; use "
                 "--dtype bf16 there)")
      ->capture_default_str();
  app.add_option("--batch", batch, "run the prompt (with its images) as this many rows, for throughput")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--nproc", nproc, "tensor-parallel ranks to start on this machine (this program, N times)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--sequence-parallel", sequence_parallel, "split the prefill's sequence across the ranks");
  app.add_option("--timeout", timeout_s, "seconds a rank waits for its peers before giving up")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (prompt_option->count() + text_option->count() != 1) {
    fmt::print(stderr, "error: give the prompt as --prompt (token ids) or --text (text)\n");
    return 2;
  }

  // Started by hand with --nproc N: become the launcher of N ranks running these same arguments.
  const bool in_a_launch = std::getenv("RANK") != nullptr || std::getenv("WORLD_SIZE") != nullptr;
  if (nproc > 1 && !in_a_launch) {
    std::vector<std::string> args = {vlmgen::self_executable(argv[0])};
    args.insert(args.end(), argv + 1, argv + argc);
    vlmgen::LaunchOptions launch;
    launch.timeout = std::chrono::hours(24);
    try {
      return vlmgen::launch_local_ranks(nproc, args, launch);
    } catch (const vlmgen::Error& e) {
      fmt::print(stderr, "error: {}\n", e.what());
      return 1;
    }
  }

  int64_t rank = 0;
  try {
    vlmgen::ParallelContext parallel = vlmgen::init_parallel_from_env(
        /*tp_size=*/0, vlmgen::DistributedOptions().timeout(std::chrono::seconds(timeout_s)));
    rank = parallel.rank();
    VLMGEN_CHECK(nproc == 1 || nproc == parallel.world_size(), "--nproc {} but the launcher started WORLD_SIZE={}",
                 nproc, parallel.world_size());
    parallel.sequence_parallel(sequence_parallel);
    const bool lead = rank == 0;
    auto model = vlmgen::load_model(checkpoint, parallel, vlmgen::load_options_for(dtype, device, kv_dtype));
    const vlmgen::ModelTraits& config = model->traits();
    std::vector<vlmgen::Image> images;
    for (int64_t row = 0; row < batch; ++row) {
      for (const auto& path : image_paths) images.push_back(vlmgen::load_image(path));
    }
    const vlmgen::VisionInputs vision = preprocess_for(*model, checkpoint, images, max_pixels, min_pixels, lead);
    std::vector<int64_t> counts = model->placeholder_counts(vision);
    counts.resize(image_paths.size());  // the first row's; every row has the same images
    std::vector<int64_t> prompt = text_option->count() > 0 ? tokenize_prompt(text, checkpoint, config, counts)
                                                           : build_prompt(prompt_text, config, counts);

    const std::map<std::string, vlmgen::ReplayMode> modes = {{"span-aware", vlmgen::ReplayMode::kSpanAware},
                                                             {"always", vlmgen::ReplayMode::kAlways},
                                                             {"step-zero", vlmgen::ReplayMode::kStepZero}};
    auto gen_config = vlmgen::GenerationConfig()
                          .max_new_tokens(max_new_tokens)
                          .enable_kv_cache(!no_kv_cache)
                          .replay_mode(modes.at(replay))
                          .temperature(temperature)
                          .seed(seed)
                          .end_token_ids(end_ids);
    if (lead) {
      if (parallel.tp_size() > 1) {
        fmt::print("tensor parallel: {} ranks, vision tower {}, sequence parallel {}\n", parallel.tp_size(),
                   vision_tower_sharded(*model) ? "sharded" : "replicated", sequence_parallel ? "on" : "off");
      }
      fmt::print("prompt: {} tokens, {} images, KV cache {}, replay {}; {} row{}, {} weights on {}\n", prompt.size(),
                 image_paths.size(), no_kv_cache ? "off" : "on", replay, batch, batch == 1 ? "" : "s", dtype,
                 model->device().str());
      fmt::print("tokens:");
      std::fflush(stdout);
    }
    vlmgen::GenerateRequest request(std::vector<std::vector<int64_t>>(static_cast<size_t>(batch), prompt), vision);
    // Every rank chooses the same tokens; only rank 0 prints them. All return true, so the
    // ranks stay in step.
    request.on_token = [lead](const vlmgen::TokenEvent& e) {
      if (lead && e.row == 0) {
        fmt::print(" {}", e.token);
        std::fflush(stdout);
      }
      return true;
    };
    auto result = vlmgen::Generator(*model, parallel).generate(request, gen_config);
    if (lead) {
      fmt::print("\nfinish: {}; time to first token {:.3f} s; decode {:.1f} tokens/s; {} forward calls\n",
                 vlmgen::to_string(result.sequences[0].finish_reason), result.stats.time_to_first_token_s,
                 result.stats.decode_tokens_per_s, result.stats.forward_calls);
    }
  } catch (const vlmgen::Error& e) {
    fmt::print(stderr, "\nerror (rank {}): {}\n", rank, e.what());
    return 1;
  }
  return 0;
}
