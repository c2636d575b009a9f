// Runs generation from a Qwen2-VL checkpoint directory, token ids and image files, printing the
// tokens as they stream.
//
//   vlmgen-generate --checkpoint DIR --prompt "5 6 <image> 7" --image cat.png
//                   [--max-new-tokens 16] [--no-kv-cache] [--replay span-aware|always|step-zero]
//
// Each "<image>" in the prompt becomes vision_start, the image's placeholder tokens and
// vision_end, for the next --image file in order.

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/image/qwen_image_processor.h"
#include "vlmgen/models/qwen2_vl.h"

namespace {

std::vector<int64_t> build_prompt(const std::string& text, const vlmgen::QwenVlConfig& config,
                                  const std::vector<int64_t>& image_tokens) {
  std::vector<int64_t> ids;
  std::istringstream words(text);
  std::string word;
  size_t image = 0;
  while (words >> word) {
    if (word == "<image>") {
      VLMGEN_CHECK(image < image_tokens.size(), "the prompt has more <image> markers than the {} --image files",
                   image_tokens.size());
      ids.push_back(config.vision_start_token_id);
      ids.insert(ids.end(), static_cast<size_t>(image_tokens[image++]), config.image_token_id);
      ids.push_back(config.vision_end_token_id);
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Generate with a Qwen2-VL checkpoint, streaming tokens");
  std::string checkpoint, prompt_text, replay = "span-aware";
  std::vector<std::string> image_paths;
  int64_t max_new_tokens = 16, max_pixels = 128 * 128;
  bool no_kv_cache = false;
  double temperature = 0.0;
  uint64_t seed = 0;
  app.add_option("--checkpoint", checkpoint, "directory with config.json and *.safetensors")->required();
  app.add_option("--prompt", prompt_text, "token ids separated by spaces; <image> marks an image")->required();
  app.add_option("--image", image_paths, "PNG/JPEG file for each <image>, in order");
  app.add_option("--max-new-tokens", max_new_tokens, "new tokens at most")->capture_default_str();
  app.add_option("--max-pixels", max_pixels, "resize images to at most this many pixels")->capture_default_str();
  app.add_flag("--no-kv-cache", no_kv_cache, "recompute the whole prefix at every step");
  app.add_option("--replay", replay, "which calls get the images")
      ->check(CLI::IsMember({"span-aware", "always", "step-zero"}))
      ->capture_default_str();
  app.add_option("--temperature", temperature, "0 = greedy")->capture_default_str();
  app.add_option("--seed", seed, "sampling seed")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    auto model = vlmgen::Qwen2Vl::from_checkpoint(checkpoint);
    const auto& config = model->config();
    std::vector<vlmgen::Image> images;
    for (const auto& path : image_paths) images.push_back(vlmgen::load_image(path));
    auto options = vlmgen::QwenImageProcessorOptions()
                       .patch_size(config.vision.patch_size)
                       .temporal_patch_size(config.vision.temporal_patch_size)
                       .merge_size(config.vision.spatial_merge_size)
                       .min_pixels(std::min<int64_t>(max_pixels, 56 * 56))
                       .max_pixels(max_pixels);
    vlmgen::VisionInputs vision = images.empty() ? vlmgen::VisionInputs() : vlmgen::preprocess(images, options);
    std::vector<int64_t> counts = model->placeholder_counts(vision);
    std::vector<int64_t> prompt = build_prompt(prompt_text, config, counts);

    const std::map<std::string, vlmgen::ReplayMode> modes = {{"span-aware", vlmgen::ReplayMode::kSpanAware},
                                                             {"always", vlmgen::ReplayMode::kAlways},
                                                             {"step-zero", vlmgen::ReplayMode::kStepZero}};
    auto gen_config = vlmgen::GenerationConfig()
                          .max_new_tokens(max_new_tokens)
                          .enable_kv_cache(!no_kv_cache)
                          .replay_mode(modes.at(replay))
                          .temperature(temperature)
                          .seed(seed);
    fmt::print("prompt: {} tokens, {} images, KV cache {}, replay {}\n", prompt.size(), images.size(),
               no_kv_cache ? "off" : "on", replay);
    fmt::print("tokens:");
    std::fflush(stdout);
    vlmgen::GenerateRequest request({prompt}, vision);
    request.on_token = [](const vlmgen::TokenEvent& e) {
      fmt::print(" {}", e.token);
      std::fflush(stdout);
      return true;
    };
    auto result = vlmgen::Generator(*model).generate(request, gen_config);
    fmt::print("\nfinish: {}; time to first token {:.3f} s; decode {:.1f} tokens/s; {} forward calls\n",
               vlmgen::to_string(result.sequences[0].finish_reason), result.stats.time_to_first_token_s,
               result.stats.decode_tokens_per_s, result.stats.forward_calls);
  } catch (const vlmgen::Error& e) {
    fmt::print(stderr, "\nerror: {}\n", e.what());
    return 1;
  }
  return 0;
}
