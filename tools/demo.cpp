// The main-job demo: the shipped shapes captioner (a tiny Qwen2-VL trained in this repository)
// captions generated pictures and any PNG/JPEG given on the command line three ways:
//
//   KV cache                  prefill with the image once, then decode from the cache
//   no KV cache (span-aware)  recompute the whole prefix every step, image replayed every step
//   no KV cache (kStepZero)   the legacy loop: image sent at step 0 only, so from the second word
//                             on the model looks at placeholders with no picture behind them
//
//   vlmgen-demo                         # 6 generated pictures
//   vlmgen-demo --images 3 cat.png      # 3 generated pictures and cat.png
//   vlmgen-demo --save-images out/      # also write the generated pictures as PNG
//
// The first two agree word for word and describe the picture; the legacy one does not.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include "shapes/shapes_data.h"
#include "shapes/shapes_model.h"
#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/image/qwen_image_processor.h"

#ifndef VLMGEN_SOURCE_DIR
#define VLMGEN_SOURCE_DIR "."
#endif

namespace {

namespace shapes = vlmgen::shapes;

struct Picture {
  std::string name;
  vlmgen::Image image;
  std::string truth;  // empty for a file
};

struct Arm {
  const char* label;
  vlmgen::GenerationConfig config;
  int64_t right = 0;
};

double tokens_per_s(const vlmgen::GenerationStats& stats) {
  return stats.total_s > 0 ? static_cast<double>(stats.generated_tokens) / stats.total_s : 0.0;
}

int run(const std::string& checkpoint, int64_t generated, uint64_t seed, const std::vector<std::string>& files,
        const std::string& save_dir, int64_t threads) {
  at::set_num_threads(static_cast<int>(threads));
  at::NoGradGuard no_grad;
  shapes::ShapesCaptioner captioner = shapes::ShapesCaptioner::load(checkpoint);
  const auto& config = captioner.model().config();
  fmt::print(
      "model: {} (Qwen2-VL, LM hidden {} x {} layers, vision {} x {} blocks, vocabulary {}, {} image tokens "
      "per {}x{} picture)\n\n",
      checkpoint, config.hidden_size, config.num_hidden_layers, config.vision.embed_dim, config.vision.depth,
      config.vocab_size, captioner.placeholders_per_image(), captioner.image_size(), captioner.image_size());

  std::vector<Picture> pictures;
  const auto scene_options = shapes::SceneOptions().image_size(captioner.image_size());
  for (int64_t i = 0; i < generated; ++i) {
    shapes::Scene scene = shapes::make_scene(seed, shapes::Split::kEval, i, scene_options);
    Picture p{fmt::format("generated #{} (eval split, seed {})", i, seed), std::move(scene.image), scene.caption};
    if (!save_dir.empty()) {
      std::filesystem::create_directories(save_dir);
      const std::string path = (std::filesystem::path(save_dir) / fmt::format("shapes_{}_{}.png", seed, i)).string();
      vlmgen::save_png(path, p.image);
      p.name += " -> " + path;
    }
    pictures.push_back(std::move(p));
  }
  for (const std::string& file : files) pictures.push_back({file, vlmgen::load_image(file), ""});

  std::vector<Arm> arms = {
      {"KV cache                 ", vlmgen::GenerationConfig().enable_kv_cache(true)},
      {"no KV cache (span-aware) ", vlmgen::GenerationConfig().enable_kv_cache(false)},
      {"no KV cache (kStepZero)  ",
       vlmgen::GenerationConfig().enable_kv_cache(false).replay_mode(vlmgen::ReplayMode::kStepZero)},
  };
  // The first generate call pays for lazy allocations; keep that out of the tokens/s below.
  if (!pictures.empty()) captioner.caption({pictures[0].image}, arms[0].config);

  int64_t with_truth = 0;
  for (const Picture& p : pictures) {
    fmt::print("{}\n", p.name);
    if (!p.truth.empty()) {
      fmt::print("  truth                                        {}\n", p.truth);
      ++with_truth;
    }
    std::string replayed;
    for (size_t a = 0; a < arms.size(); ++a) {
      shapes::CaptionRun out = captioner.caption({p.image}, arms[a].config);
      const std::string& caption = out.captions[0];
      std::string verdict;
      if (!p.truth.empty()) {
        const bool right = caption == p.truth;
        arms[a].right += right ? 1 : 0;
        verdict = right ? "ok" : "WRONG";
      }
      if (a == 1) replayed = caption;
      if (a == 2) {
        verdict += verdict.empty() ? "" : ", ";
        verdict += caption == replayed ? "legacy: same as span-aware here" : "legacy: image dropped after step 0";
      }
      fmt::print("  {} {:7.1f} tokens/s   {}{}\n", arms[a].label, tokens_per_s(out.stats), caption,
                 verdict.empty() ? "" : "   [" + verdict + "]");
    }
    fmt::print("\n");
  }
  if (with_truth > 0) {
    fmt::print("exact captions on the {} generated pictures:\n", with_truth);
    for (const Arm& arm : arms) fmt::print("  {}  {} / {}\n", arm.label, arm.right, with_truth);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  vlmgen::detail::prefer_passive_openmp_wait(argv);
  CLI::App app(
      "Caption pictures with the shipped shapes VLM, with and without a KV cache, and under the legacy "
      "step-zero replay that drops the image after the first token");
  std::string checkpoint = vlmgen::shapes::default_checkpoint_dir(VLMGEN_SOURCE_DIR);
  std::string save_dir;
  int64_t generated = 6;
  // One thread: the model's operations are too small to gain from more, and on a busy machine
  // a second thread mostly waits at barriers.
  int64_t threads = 1;
  uint64_t seed = 7;
  std::vector<std::string> files;
  app.add_option("--checkpoint", checkpoint,
                 "checkpoint directory (config.json, model.safetensors, vocab.txt, "
                 "preprocessor_config.json)")
      ->capture_default_str();
  app.add_option("--images", generated, "generated pictures to caption")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seed", seed, "seed of the generated pictures (eval split)")->capture_default_str();
  app.add_option("--save-images", save_dir, "write the generated pictures as PNG into this directory");
  app.add_option("--threads", threads, "intra-op threads")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("files", files, "PNG/JPEG files to caption as well")->check(CLI::ExistingFile);
  CLI11_PARSE(app, argc, argv);
  try {
    return run(checkpoint, generated, seed, files, save_dir, threads);
  } catch (const std::exception& e) {
    // vlmgen::Error for bad input; c10::Error or std::filesystem errors would be bugs or I/O.
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
