// The shapes data, the word tokenizer and the shipped shapes captioner (models/shapes-vlm).

#include <ATen/core/grad_mode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "shapes/shapes_data.h"
#include "shapes/shapes_model.h"
#include "shapes/word_tokenizer.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/models/qwen2_vl.h"

namespace vlmgen::shapes {
namespace {

using ::testing::HasSubstr;

// FNV-1a over the pixels: pins the generator's output so that a change that would silently
// stop `vlmgen-train-shapes` from reproducing the shipped checkpoint fails here first.
uint64_t pixel_hash(const Image& image) {
  uint64_t h = 1469598103934665603ULL;
  for (uint8_t v : image.rgb) h = (h ^ v) * 1099511628211ULL;
  return h;
}

std::string temp_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("vlmgen_shapes_test_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::array<int, 3> pixel(const Image& image, int64_t y, int64_t x) {
  const uint8_t* p = &image.rgb[static_cast<size_t>((y * image.width + x) * 3)];
  return {p[0], p[1], p[2]};
}

TEST(ShapesData, SameSeedSplitAndIndexGiveTheSameScene) {
  const Scene a = make_scene(1, Split::kTrain, 17);
  const Scene b = make_scene(1, Split::kTrain, 17);
  EXPECT_EQ(a.image.rgb, b.image.rgb);
  EXPECT_EQ(a.caption, b.caption);
  // A range is the same scenes as one at a time, whatever its start.
  const std::vector<Scene> range = make_scenes(1, Split::kTrain, 15, 4);
  ASSERT_EQ(range.size(), 4u);
  EXPECT_EQ(range[2].image.rgb, a.image.rgb);
}

TEST(ShapesData, SeedsSplitsAndIndicesGiveDifferentScenes) {
  const Image base = make_scene(1, Split::kTrain, 0).image;
  EXPECT_NE(make_scene(2, Split::kTrain, 0).image.rgb, base.rgb);
  EXPECT_NE(make_scene(1, Split::kEval, 0).image.rgb, base.rgb);
  EXPECT_NE(make_scene(1, Split::kTrain, 1).image.rgb, base.rgb);
}

TEST(ShapesData, OutputIsPinned) {
  // Measured once on this build; pure integer and IEEE double arithmetic, so every platform
  // must agree.
  const Scene scene = make_scene(1, Split::kTrain, 0);
  EXPECT_EQ(scene.caption, "a yellow circle center and a green square bottom right");
  EXPECT_EQ(pixel_hash(scene.image), 0x44027B2E96E28B61ULL);
}

TEST(ShapesData, CaptionsNameEveryShapeInReadingOrder) {
  std::set<std::string> seen_words;
  std::set<int64_t> shape_counts;
  std::set<std::tuple<int64_t, int64_t, int64_t>> seen_items;  // colour, kind, cell
  for (int64_t i = 0; i < 3000; ++i) {
    const Scene scene = make_scene(5, Split::kEval, i);
    ASSERT_EQ(scene.image.height, 96);
    ASSERT_EQ(scene.image.width, 96);
    ASSERT_EQ(scene.image.rgb.size(), 96u * 96u * 3u);
    ASSERT_GE(scene.items.size(), 1u);
    ASSERT_LE(scene.items.size(), 2u);
    shape_counts.insert(static_cast<int64_t>(scene.items.size()));
    for (size_t k = 1; k < scene.items.size(); ++k) {
      const auto cell = [](const ShapeItem& s) { return s.row * kGridSize + s.col; };
      ASSERT_LT(cell(scene.items[k - 1]), cell(scene.items[k])) << "cells distinct and in reading order";
    }
    EXPECT_EQ(scene.caption, caption_of(scene.items));
    for (const ShapeItem& item : scene.items) {
      seen_items.insert(
          {static_cast<int64_t>(item.colour), static_cast<int64_t>(item.kind), item.row * kGridSize + item.col});
      // The shape's centre pixel shows its colour's dominant channel, not the grey background.
      const auto rgb = pixel(scene.image, static_cast<int64_t>(item.center_y), static_cast<int64_t>(item.center_x));
      const int spread = std::max({rgb[0], rgb[1], rgb[2]}) - std::min({rgb[0], rgb[1], rgb[2]});
      EXPECT_GT(spread, 60) << scene.caption;
    }
    std::istringstream words(scene.caption);
    std::string w;
    while (words >> w) seen_words.insert(w);
  }
  EXPECT_EQ(shape_counts, (std::set<int64_t>{1, 2}));
  const std::vector<std::string> vocabulary = caption_words();
  EXPECT_EQ(seen_words, std::set<std::string>(vocabulary.begin(), vocabulary.end()));
  // 6 colours x 4 kinds x 9 cells: every combination turns up in a few thousand scenes.
  EXPECT_EQ(seen_items.size(), static_cast<size_t>(kNumColours * kNumShapeKinds * kGridSize * kGridSize));
}

TEST(ShapesData, RenderDrawsTheShapeInItsCell) {
  ShapeItem item;
  item.colour = Colour::kBlue;
  item.kind = ShapeKind::kSquare;
  item.row = 2;
  item.col = 0;
  item.center_x = 16;
  item.center_y = 80;
  item.radius = 10;
  const Image image = render_scene({item}, 96, 40);
  EXPECT_EQ(pixel(image, 80, 16), (std::array<int, 3>{45, 85, 225}));
  EXPECT_EQ(pixel(image, 16, 80), (std::array<int, 3>{40, 40, 40}));
  EXPECT_EQ(caption_of({item}), "a blue square bottom left");
  item.row = 3;
  EXPECT_THROW(render_scene({item}, 96), Error);
}

TEST(ShapesData, PositionPhrases) {
  EXPECT_EQ(position_phrase(0, 0), "top left");
  EXPECT_EQ(position_phrase(0, 1), "top center");
  EXPECT_EQ(position_phrase(1, 1), "center");
  EXPECT_EQ(position_phrase(1, 2), "middle right");
  EXPECT_EQ(position_phrase(2, 2), "bottom right");
  EXPECT_THROW(position_phrase(-1, 0), Error);
}

TEST(ShapesData, BadOptionsAreErrors) {
  EXPECT_THROW(make_scene(1, Split::kTrain, 0, SceneOptions().image_size(16)), Error);
  EXPECT_THROW(make_scene(1, Split::kTrain, 0, SceneOptions().max_shapes(0)), Error);
  EXPECT_THROW(make_scene(1, Split::kTrain, 0, SceneOptions().max_shapes(10)), Error);
  EXPECT_THROW(make_scene(1, Split::kTrain, -1), Error);
  // Up to a full grid works, each shape in its own cell.
  const Scene full = make_scene(3, Split::kTrain, 0, SceneOptions().max_shapes(9).image_size(64));
  EXPECT_EQ(full.image.height, 64);
  EXPECT_FALSE(full.caption.empty());
}

TEST(WordTokenizer, EncodeDecodeRoundTrip) {
  const WordTokenizer tokenizer = WordTokenizer::with_specials(caption_words());
  EXPECT_EQ(tokenizer.size(), 7 + static_cast<int64_t>(caption_words().size()));
  EXPECT_EQ(tokenizer.pad_id(), 0);
  for (int64_t i = 0; i < 200; ++i) {
    const std::string caption = make_scene(9, Split::kTrain, i).caption;
    const std::vector<int64_t> ids = tokenizer.encode(caption);
    EXPECT_EQ(tokenizer.decode(ids), caption);
    for (int64_t id : ids) EXPECT_FALSE(tokenizer.is_special(id));
  }
  // Extra whitespace is only a separator; specials are words too and decode keeps them on request.
  const std::vector<int64_t> ids = tokenizer.encode("  a red\tcircle <eos> ");
  EXPECT_EQ(ids.back(), tokenizer.eos_id());
  EXPECT_EQ(tokenizer.decode(ids), "a red circle");
  EXPECT_EQ(tokenizer.decode(ids, /*skip_special=*/false), "a red circle <eos>");
}

TEST(WordTokenizer, ImagePromptLayout) {
  const WordTokenizer tokenizer = WordTokenizer::with_specials(caption_words());
  const std::vector<int64_t> prompt = tokenizer.image_prompt(3);
  const int64_t pad = tokenizer.image_pad_id();
  EXPECT_EQ(prompt, (std::vector<int64_t>{tokenizer.bos_id(), tokenizer.vision_start_id(), pad, pad, pad,
                                          tokenizer.vision_end_id()}));
  EXPECT_THROW(tokenizer.image_prompt(0), Error);
}

TEST(WordTokenizer, SaveLoadRoundTrip) {
  const WordTokenizer tokenizer = WordTokenizer::with_specials(caption_words());
  const std::string path = temp_dir("vocab") + "/vocab.txt";
  tokenizer.save(path);
  const WordTokenizer loaded = WordTokenizer::load(path);
  EXPECT_EQ(loaded.tokens(), tokenizer.tokens());
  EXPECT_EQ(loaded.encode("a green cross middle left"), tokenizer.encode("a green cross middle left"));
}

TEST(WordTokenizer, ErrorsNameTheProblem) {
  const WordTokenizer tokenizer = WordTokenizer::with_specials(caption_words());
  try {
    tokenizer.encode("a red hexagon");
    FAIL() << "an unknown word must be an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("\"hexagon\""));
  }
  EXPECT_THROW(tokenizer.decode({tokenizer.size()}), Error);
  EXPECT_THROW(tokenizer.id("hexagon"), Error);
  EXPECT_THROW(WordTokenizer::with_specials({"a", "a"}), Error);
  EXPECT_THROW(WordTokenizer::with_specials({"two words"}), Error);
  EXPECT_THROW(WordTokenizer({"<pad>", "a"}), Error);  // no <eos>, no image tokens
  EXPECT_THROW(WordTokenizer::load(temp_dir("missing") + "/vocab.txt"), Error);
  const std::string bad = temp_dir("bad") + "/vocab.txt";
  std::ofstream(bad) << "<pad>\n\n<eos>\n";
  try {
    WordTokenizer::load(bad);
    FAIL() << "an empty line must be an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(bad));
  }
}

TEST(ShapesTraining, BatchPredictsCaptionWordsAndEos) {
  const WordTokenizer tokenizer = WordTokenizer::with_specials(caption_words());
  const QwenVlConfig config = model_config(tokenizer);
  const QwenImageProcessorOptions processor = processor_options(config, 96);
  const std::vector<Scene> scenes = make_scenes(1, Split::kTrain, 0, 8);
  const TrainingBatch batch = make_training_batch(scenes, tokenizer, processor, 9);
  const int64_t prompt_len = 12;  // <bos> <|vision_start|> 9 x <|image_pad|> <|vision_end|>
  EXPECT_EQ(batch.vision.num_images(), 8);
  int64_t targets = 0;
  for (int64_t r = 0; r < 8; ++r) {
    const std::vector<int64_t> words = tokenizer.encode(scenes[r].caption);
    const int64_t n = prompt_len + static_cast<int64_t>(words.size()) + 1;
    EXPECT_EQ(batch.attention_mask[r].sum().item<int64_t>(), n);
    EXPECT_EQ(batch.labels[r][prompt_len - 2].item<int64_t>(), -100);
    EXPECT_EQ(batch.labels[r][prompt_len - 1].item<int64_t>(), words[0]);
    EXPECT_EQ(batch.labels[r][n - 2].item<int64_t>(), tokenizer.eos_id());
    if (n - 1 < batch.labels.size(1)) {
      EXPECT_EQ(batch.labels[r][n - 1].item<int64_t>(), -100);
    }
    targets += static_cast<int64_t>(words.size()) + 1;
  }
  EXPECT_EQ(batch.target_tokens, targets);
  EXPECT_EQ(batch.labels.ne(-100).sum().item<int64_t>(), targets);
  EXPECT_THROW(make_training_batch(scenes, tokenizer, processor, 4), Error);
}

// ---- the shipped checkpoint ----

std::string shipped_dir() { return default_checkpoint_dir(VLMGEN_SOURCE_DIR); }

TEST(ShippedShapesModel, LoadsThroughTheCheckpointLoaderUsersUse) {
  const std::string dir = shipped_dir();
  std::unique_ptr<Qwen2Vl> model = Qwen2Vl::from_checkpoint(dir);
  const WordTokenizer tokenizer = WordTokenizer::load(dir + "/" + kVocabFile);
  EXPECT_EQ(model->config().vocab_size, tokenizer.size());
  EXPECT_EQ(model->traits().image_token_id, tokenizer.image_pad_id());
  EXPECT_TRUE(model->tied_embeddings());
  int64_t parameters = 0;
  for (const auto& [name, w] : model->named_weights()) parameters += w->numel();
  EXPECT_LT(parameters, 1'000'000);
  // Small enough to ship in the repository.
  EXPECT_LT(std::filesystem::file_size(dir + "/model.safetensors"), 4u << 20);
  const QwenImageProcessorOptions processor = load_processor_options(dir);
  EXPECT_EQ(processor.patch_size(), model->config().vision.patch_size);
  const ShapesCaptioner captioner = ShapesCaptioner::load(dir);
  EXPECT_EQ(captioner.image_size(), 96);
  EXPECT_EQ(captioner.placeholders_per_image(), 9);
}

TEST(ShippedShapesModel, MismatchedFilesAreErrors) {
  const std::string dir = shipped_dir();
  EXPECT_THROW(ShapesCaptioner(Qwen2Vl::from_checkpoint(dir), WordTokenizer::with_specials({"a", "b"}),
                               load_processor_options(dir)),
               Error);
  const std::string empty = temp_dir("no_preprocessor");
  EXPECT_THROW(load_processor_options(empty), Error);
  // A folder whose patches the vision tower could not take.
  std::ofstream(empty + "/" + kPreprocessorFile) << R"({"patch_size": 14, "merge_size": 2})";
  try {
    checkpoint_image_processor(empty, Qwen2Vl::from_checkpoint(dir)->config());
    FAIL() << "a patch geometry other than the model's must be an error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("patch_size 14"));
  }
}

TEST(ShippedShapesModel, PicturesOfOtherSizesAreResizedToTheModelsSquare) {
  at::NoGradGuard no_grad;
  ShapesCaptioner captioner = ShapesCaptioner::load(shipped_dir());
  std::vector<Image> images;
  std::vector<std::string> truth;
  for (int64_t i = 0; i < 40; ++i) {
    const Scene scene = make_scene(77, Split::kEval, i);
    images.push_back(resize_bicubic(scene.image, 150, 200));
    truth.push_back(scene.caption);
  }
  const VisionInputs vision = captioner.vision_inputs(images);
  EXPECT_EQ(vision.image_grid_thw[0][1].item<int64_t>(), 6);
  EXPECT_EQ(vision.image_grid_thw[0][2].item<int64_t>(), 6);
  const CaptionRun run = captioner.caption(images);
  int64_t right = 0;
  for (size_t i = 0; i < truth.size(); ++i) right += run.captions[i] == truth[i] ? 1 : 0;
  EXPECT_GE(right, 36) << "of 40 pictures enlarged to 150x200";
}

// 200 pictures the model never saw (eval split, a seed other than the training seed 1).
constexpr uint64_t kEvalSeed = 20240607;
constexpr int64_t kEvalImages = 200;

struct Accuracy {
  std::vector<std::string> captions;
  double fraction = 0.0;
};

Accuracy caption_eval_set(ShapesCaptioner& captioner, const GenerationConfig& config) {
  at::NoGradGuard no_grad;
  const std::vector<Scene> scenes = make_scenes(kEvalSeed, Split::kEval, 0, kEvalImages);
  std::vector<Image> images;
  for (const Scene& s : scenes) images.push_back(s.image);
  Accuracy out;
  out.captions = captioner.caption(images, config, /*batch_size=*/100).captions;
  int64_t right = 0;
  for (size_t i = 0; i < scenes.size(); ++i) right += out.captions[i] == scenes[i].caption ? 1 : 0;
  out.fraction = static_cast<double>(right) / kEvalImages;
  return out;
}

TEST(ShippedShapesModel, CaptionsFreshPicturesWithAndWithoutKvCacheIdentically) {
  ShapesCaptioner captioner = ShapesCaptioner::load(shipped_dir());
  const Accuracy kv = caption_eval_set(captioner, GenerationConfig().enable_kv_cache(true));
  const Accuracy replay =
      caption_eval_set(captioner, GenerationConfig().enable_kv_cache(false).replay_mode(ReplayMode::kSpanAware));
  std::printf("exact captions on %lld fresh pictures: KV cache %.1f%%, no KV cache (span-aware) %.1f%%\n",
              static_cast<long long>(kEvalImages), 100 * kv.fraction, 100 * replay.fraction);
  EXPECT_GE(kv.fraction, 0.95);
  EXPECT_GE(replay.fraction, 0.95);
  EXPECT_EQ(kv.captions, replay.captions);
}

TEST(ShippedShapesModel, LegacyStepZeroWithoutKvCacheDescribesTheWrongPicture) {
  ShapesCaptioner captioner = ShapesCaptioner::load(shipped_dir());
  const Accuracy legacy =
      caption_eval_set(captioner, GenerationConfig().enable_kv_cache(false).replay_mode(ReplayMode::kStepZero));
  std::printf("exact captions on %lld fresh pictures: no KV cache, legacy kStepZero %.1f%%\n",
              static_cast<long long>(kEvalImages), 100 * legacy.fraction);
  EXPECT_LE(legacy.fraction, 0.5);
}

}  // namespace
}  // namespace vlmgen::shapes
