// The per-image families' preprocessing: Gemma-3 (one resized square per image) and LLaVA-NeXT
// (a base tile and the tiles of the anyres resolution), against Pillow and transformers' rules.

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "image_test_util.h"
#include "vlmgen/error.h"
#include "vlmgen/image/gemma3_image_processor.h"
#include "vlmgen/image/llava_next_image_processor.h"
#include "vlmgen/image/preprocessor_config.h"
#include "vlmgen/image/qwen_image_processor.h"
#include "vlmgen/models/llava_next.h"

namespace vlmgen {
namespace {

using image_test::make_image;
using image_test::pillow_input_value;

TEST(Gemma3ImageProcessor, ResizesRescalesAndNormalizesEachImageToOneSquare) {
  const Image a = make_image(6, 8, pillow_input_value);
  const Image b = make_image(16, 16, pillow_input_value);
  Gemma3ImageProcessorOptions options;
  options.size = 4;
  const VisionInputs v = preprocess_gemma3({a, b}, options);
  EXPECT_EQ(v.layout, VisionLayout::kPerImage);
  EXPECT_EQ(v.pixel_values.sizes(), (std::vector<int64_t>{2, 3, 4, 4}));
  EXPECT_EQ(detail::to_int64_vector(v.image_sizes), (std::vector<int64_t>{6, 8, 16, 16}));
  // (byte / 255 - 0.5) / 0.5 of the bilinear 4x4 resize, channel 1 at row 2, column 3.
  const Image resized = resize_bilinear(a, 4, 4);
  const double expected = (resized.rgb[(2 * 4 + 3) * 3 + 1] / 255.0 - 0.5) / 0.5;
  EXPECT_NEAR(v.pixel_values[0][1][2][3].item<double>(), expected, 1e-6);

  const std::string released = R"({"do_normalize": true, "do_pan_and_scan": null, "do_rescale": true,
    "do_resize": true, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
    "image_std": [0.5, 0.5, 0.5], "resample": 2, "rescale_factor": 0.00392156862745098,
    "size": {"height": 896, "width": 896}})";
  EXPECT_EQ(parse_gemma3_preprocessor_config(released, "released").size, 896);
  for (const auto& [json, needle] :
       {std::pair<std::string, std::string>{R"({"do_pan_and_scan": true})", "pan-and-scan"},
        {R"({"resample": 3})", "expected 2 (bilinear)"},
        {R"({"size": {"height": 896, "width": 448}})", "not square"},
        // Read strictly (these were 16, an undefined cast, 3 entries, a pass as double):
        {R"({"size": {"height": 16.9, "width": 16.2}})", "size.height is 16.9; expected an integer"},
        {R"({"size": {"height": 1e300, "width": 1e300}})", "size.height is 1e+300"},
        {R"({"image_std": [0.5, 0.5, 0.5, 0.5]})", "expected a list of 3 numbers"},
        {R"({"rescale_factor": 1e300})", "rescale factor 1e+300"},
        {R"({"rescale_factor": "x"})", "rescale_factor is \"x\"; expected a finite number"}}) {
    try {
      parse_gemma3_preprocessor_config(json, "test");
      ADD_FAILURE() << json;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr(needle));
    }
  }
}

// Pillow 9.4 + numpy, following LlavaNextImageProcessor: the base tile `resize((8, 8), BICUBIC)`,
// then the picture resized to fit its best pinpoint (aspect kept, sides ceil'ed), centred on zeros
// (divmod padding), cut into 8x8 tiles row by row; summarized per image by the uint8 sum and the
// FNV-1a 64 hash of all tiles' HWC bytes.
TEST(LlavaNextImageProcessor, TilesMatchPillowAndThePaddingOfTransformers) {
  LlavaNextImageProcessorOptions options = LlavaNextImageProcessorOptions::for_model(LlavaNextConfig::tiny());
  const VisionInputs v =
      preprocess_llava_next({make_image(10, 30, pillow_input_value), make_image(20, 12, pillow_input_value)}, options);
  ASSERT_EQ(v.pixel_values.sizes(), (std::vector<int64_t>{2, 5, 3, 8, 8}));
  EXPECT_EQ(detail::to_int64_vector(v.image_sizes), (std::vector<int64_t>{10, 30, 20, 12}));
  const at::Tensor mean = at::tensor(std::vector<double>(options.image_mean.begin(), options.image_mean.end()));
  const at::Tensor std = at::tensor(std::vector<double>(options.image_std.begin(), options.image_std.end()));
  struct Expected {
    int64_t tiles;
    uint64_t sum, hash;
  };
  const Expected expected[] = {{4, 97914u, 7519837087043123435ull}, {5, 84769u, 4158195214309118736ull}};
  for (int64_t i = 0; i < 2; ++i) {
    // Back to bytes: x * std + mean, times 255, rounded; tiles, rows, columns, channels.
    const at::Tensor tiles = v.pixel_values[i].narrow(0, 0, expected[i].tiles).to(at::kDouble);
    const at::Tensor bytes =
        (tiles * std.view({1, 3, 1, 1}) + mean.view({1, 3, 1, 1})).mul(255).round().permute({0, 2, 3, 1}).contiguous();
    uint64_t hash = 14695981039346656037ull, sum = 0;
    for (double b : std::vector<double>(bytes.data_ptr<double>(), bytes.data_ptr<double>() + bytes.numel())) {
      hash = (hash ^ static_cast<uint64_t>(b)) * 1099511628211ull;
      sum += static_cast<uint64_t>(b);
    }
    EXPECT_EQ(sum, expected[i].sum) << "image " << i;
    EXPECT_EQ(hash, expected[i].hash) << "image " << i;
  }
  // The 4-tile image is padded with a zero tile.
  EXPECT_EQ(v.pixel_values[0][4].abs().max().item<double>(), 0.0);
  EXPECT_THROW(preprocess_llava_next({}, options), Error);
}

// A folder's preprocessor_config.json as llava-v1.6 ships it gives the released settings; a
// fine-tune's own statistics are taken; what vlmgen would not do as the file says is refused by name.
TEST(LlavaNextImageProcessor, ReadsTheFoldersPreprocessorConfigAndRefusesWhatItCannotHonour) {
  namespace fs = std::filesystem;
  const LlavaNextConfig config = LlavaNextConfig::tiny();
  const fs::path dir = fs::path(::testing::TempDir()) / "vlmgen_llava_preprocessor";
  fs::create_directories(dir);
  fs::remove(dir / kPreprocessorConfigFile);
  const LlavaNextImageProcessorOptions released = LlavaNextImageProcessorOptions::for_model(config);
  EXPECT_EQ(llava_next_image_processor(dir.string(), config).image_mean, released.image_mean);  // no file
  const auto with = [&](const std::string& fields) {
    std::ofstream(dir / kPreprocessorConfigFile)
        << R"({"image_processor_type": "LlavaNextImageProcessor", "resample": 3, "do_pad": true,
        "crop_size": {"height": )"
        << config.image_size << R"(, "width": )" << config.image_size << R"(}, "size": {"shortest_edge": )"
        << config.image_size << "}" << fields << "}";
    return llava_next_image_processor(dir.string(), config);
  };
  const LlavaNextImageProcessorOptions own = with(R"(, "image_mean": [0.5, 0.25, 0.125], "rescale_factor": 0.5)");
  EXPECT_EQ(own.image_mean, (std::array<double, 3>{0.5, 0.25, 0.125}));
  EXPECT_EQ(own.rescale_factor, 0.5);
  EXPECT_EQ(own.image_std, released.image_std);
  EXPECT_EQ(own.tile_size, config.image_size);
  for (const auto& [fields, needle] : std::vector<std::pair<std::string, std::string>>{
           {R"(, "resample": 2)", "resample 2 is not supported"},
           {R"(, "crop_size": 224)", "crop_size 224 differs"},
           {R"(, "do_pad": false)", "do_pad is false"},
           {R"(, "image_grid_pinpoints": [[1, 2]])", "image_grid_pinpoints [[1,2]] differ"},
           {R"(, "image_std": [0.2, 0.2, 0.2, 0.2])", "expected a list of 3 numbers"},
           {R"(, "image_std": [1e-40, 0.2, 0.2])", "normalizes pixels"},
           {R"(, "image_processor_type": "CLIPImageProcessor")", "CLIPImageProcessor is not supported"}}) {
    try {
      with(fields);
      ADD_FAILURE() << fields;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr(needle)) << fields;
      EXPECT_THAT(e.what(), ::testing::HasSubstr(kPreprocessorConfigFile));
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace vlmgen
