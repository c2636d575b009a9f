// Writes a random tiny Qwen-VL, Gemma-3 or LLaVA-NeXT checkpoint directory (config.json + model.safetensors) that
// vlmgen-generate and the tests can load like a real one.
//
//   vlmgen-make-tiny-checkpoint --out /tmp/tiny-qwen2vl [--family qwen2_vl|qwen2_5_vl|qwen3_vl|gemma3|llava_next]
//                               [--seed 7] [--tied] [--real-vocab]
//
// --real-vocab gives it the real vocabulary size and image token ids of Qwen2-VL or Gemma-3, so
// the real tokenizer.json (and chat template) placed beside it makes a complete chat folder.

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <string>

#include "vlmgen/error.h"
#include "vlmgen/image/preprocessor_config.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/models/llava_next.h"
#include "vlmgen/models/qwen_vl.h"

int main(int argc, char** argv) {
  CLI::App app(
      "Write a random tiny Qwen-VL or Gemma-3 checkpoint (config.json, model.safetensors, preprocessor_config.json)");
  std::string out;
  std::string family_name = "qwen2_vl";
  uint64_t seed = 0;
  bool tied = false, real_vocab = false;
  app.add_option("--out", out, "checkpoint directory to write (created when missing)")->required();
  app.add_option("--family", family_name, "model family: qwen2_vl, qwen2_5_vl, qwen3_vl, gemma3 or llava_next")
      ->capture_default_str()
      ->check(CLI::IsMember({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3", "llava_next"}));
  app.add_option("--seed", seed, "seed of the random weights")->capture_default_str();
  app.add_flag("--tied", tied, "tie lm_head to the token embedding (no lm_head.weight stored)");
  app.add_flag("--real-vocab", real_vocab,
               "the family's real vocabulary size and image token ids (Qwen2-VL: 151936; Gemma-3: 262208), so its "
               "real tokenizer.json fits");
  CLI11_PARSE(app, argc, argv);
  try {
    if (family_name == "gemma3") {
      // Gemma3Config::tiny(): 16x16 images (the preprocessing resizes to image_size), 4 tokens each.
      vlmgen::Gemma3Config config = vlmgen::Gemma3Config::tiny();  // tied, as Gemma-3 ships
      if (real_vocab) {  // gemma-3-*-it: <start_of_image>, <end_of_image>, <image_soft_token>
        config.vocab_size = 262208;
        config.boi_token_id = 255999;
        config.eoi_token_id = 256000;
        config.image_token_id = 262144;
      }
      vlmgen::Gemma3 model(config, seed);
      model.save_checkpoint(out);
      fmt::print("wrote {} (gemma3, {} parameters, hidden {}, {} layers, vocab {}, image token {})\n", out,
                 config.parameter_count(), config.hidden_size, config.num_hidden_layers, config.vocab_size,
                 config.image_token_id);
      return 0;
    }
    if (family_name == "llava_next") {
      // LlavaNextConfig::tiny(): 8x8 tiles, placeholders per image from its size (llava_next_placeholder_count).
      VLMGEN_CHECK(!real_vocab, "--real-vocab is for the Qwen-VL and Gemma-3 families");
      vlmgen::LlavaNextConfig config = vlmgen::LlavaNextConfig::tiny();
      config.tie_word_embeddings = tied;
      vlmgen::LlavaNext model(config, seed);
      model.save_checkpoint(out);
      fmt::print("wrote {} (llava_next, {} parameters, hidden {}, {} layers, vocab {}, image token {})\n", out,
                 config.parameter_count(), config.hidden_size, config.num_hidden_layers, config.vocab_size,
                 config.image_token_id);
      return 0;
    }
    vlmgen::QwenVlConfig config = vlmgen::QwenVlConfig::tiny(*vlmgen::family_from_name(family_name));
    config.tie_word_embeddings = tied;
    if (real_vocab) {
      config.vocab_size = 151936;
      config.vision_start_token_id = 151652;
      config.vision_end_token_id = 151653;
      config.image_token_id = 151655;
      config.video_token_id = 151656;
    }
    vlmgen::QwenVl model(config, seed);
    model.save_checkpoint(out);
    // A complete HF-style folder: the image preprocessing travels with the weights. Up to 64
    // merged tokens per image keeps the tiny model fast.
    const auto& v = config.vision;
    const int64_t factor = v.patch_size * v.spatial_merge_size;
    vlmgen::save_preprocessor_config(out, vlmgen::QwenImageProcessorOptions()
                                              .patch_size(v.patch_size)
                                              .temporal_patch_size(v.temporal_patch_size)
                                              .merge_size(v.spatial_merge_size)
                                              .min_pixels(factor * factor)
                                              .max_pixels(64 * factor * factor));
    int64_t params = 0;
    for (const auto& [name, tensor] : model.named_weights()) params += tensor->numel();
    fmt::print("wrote {} ({}, {} parameters, hidden {}, {} layers, vocab {}, image token {})\n", out, family_name,
               params, config.hidden_size, config.num_hidden_layers, config.vocab_size, config.image_token_id);
  } catch (const vlmgen::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
