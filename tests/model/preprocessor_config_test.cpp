// A checkpoint folder's own preprocessing (preprocessor_config.json) and parity with HF's
// Qwen2-VL image processor on the released settings, for image sizes from tiny to huge and
// extreme aspect ratios. The expected values come from an independent transcription of HF's
// current smart_resize and of its rescale / normalize / patch layout, not from vlmgen's code.

#include "vlmgen/image/preprocessor_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "vlmgen/error.h"
#include "vlmgen/image/qwen_image_processor.h"

namespace vlmgen {
namespace {

using ::testing::HasSubstr;

// preprocessor_config.json of the released Qwen2-VL-Instruct checkpoints, byte for byte.
std::string reference_dir() { return std::string(VLMGEN_SOURCE_DIR) + "/tests/model/reference/qwen2-vl-instruct"; }

// HF transformers' Qwen2-VL smart_resize as it stands today (Python's round is half to even;
// the shrink branch clamps each side to at least `factor`; tiny sides are no longer refused,
// since rounding them to 0 sends them through the enlarge branch).
std::pair<int64_t, int64_t> hf_smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels,
                                            int64_t max_pixels) {
  auto py_round = [](double x) { return static_cast<int64_t>(std::nearbyint(x)); };  // FE_TONEAREST: to even
  int64_t h_bar = py_round(static_cast<double>(height) / factor) * factor;
  int64_t w_bar = py_round(static_cast<double>(width) / factor) * factor;
  if (h_bar * w_bar > max_pixels) {
    const double beta = std::sqrt(static_cast<double>(height) * width / max_pixels);
    h_bar = std::max<int64_t>(factor, static_cast<int64_t>(std::floor(height / beta / factor)) * factor);
    w_bar = std::max<int64_t>(factor, static_cast<int64_t>(std::floor(width / beta / factor)) * factor);
  } else if (h_bar * w_bar < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / (static_cast<double>(height) * width));
    h_bar = static_cast<int64_t>(std::ceil(height * beta / factor)) * factor;
    w_bar = static_cast<int64_t>(std::ceil(width * beta / factor)) * factor;
  }
  return {h_bar, w_bar};
}

Image gradient_image(int64_t height, int64_t width) {
  Image image;
  image.height = height;
  image.width = width;
  image.rgb.resize(static_cast<size_t>(height * width * 3));
  for (int64_t y = 0; y < height; ++y) {
    for (int64_t x = 0; x < width; ++x) {
      uint8_t* p = &image.rgb[static_cast<size_t>((y * width + x) * 3)];
      p[0] = static_cast<uint8_t>((x * 255) / std::max<int64_t>(width - 1, 1));
      p[1] = static_cast<uint8_t>((y * 255) / std::max<int64_t>(height - 1, 1));
      p[2] = static_cast<uint8_t>((x * 7 + y * 13) % 256);
    }
  }
  return image;
}

// HF's pixel_values of one resized image: rescale, normalize (float32), repeat the frame
// temporal_patch_size times, then the processor's reshape and transpose (0,3,6,4,7,2,1,5,8).
at::Tensor hf_layout(const Image& resized, const QwenImageProcessorOptions& o) {
  at::Tensor hwc =
      at::from_blob(const_cast<uint8_t*>(resized.rgb.data()), {resized.height, resized.width, 3}, at::kByte)
          .to(at::kFloat);
  at::Tensor chw = hwc.permute({2, 0, 1}) * static_cast<float>(o.rescale());
  at::Tensor mean = at::tensor({o.image_mean()[0], o.image_mean()[1], o.image_mean()[2]}, at::kFloat).view({3, 1, 1});
  at::Tensor std = at::tensor({o.image_std()[0], o.image_std()[1], o.image_std()[2]}, at::kFloat).view({3, 1, 1});
  at::Tensor frames = ((chw - mean) / std).unsqueeze(0).repeat({o.temporal_patch_size(), 1, 1, 1});  // [T, C, H, W]
  const int64_t p = o.patch_size(), m = o.merge_size(), t = o.temporal_patch_size();
  const int64_t gh = resized.height / p, gw = resized.width / p;
  at::Tensor x = frames.reshape({1, t, 3, gh / m, m, p, gw / m, m, p});
  x = x.permute({0, 3, 6, 4, 7, 2, 1, 5, 8});
  return x.reshape({gh * gw, 3 * t * p * p});
}

TEST(PreprocessorConfig, TheReleasedQwen2VlSettingsAreRead) {
  const auto options = load_preprocessor_config(reference_dir());
  ASSERT_TRUE(options.has_value());
  EXPECT_EQ(options->min_pixels(), 3136);
  EXPECT_EQ(options->max_pixels(), 12845056);
  EXPECT_EQ(options->patch_size(), 14);
  EXPECT_EQ(options->temporal_patch_size(), 2);
  EXPECT_EQ(options->merge_size(), 2);
  EXPECT_DOUBLE_EQ(options->image_mean()[1], 0.4578275);
  EXPECT_DOUBLE_EQ(options->image_std()[2], 0.27577711);
  // A 448x448 picture: 32x32 patches, 256 placeholder tokens (shared/reference/README.md).
  const VisionInputs v = preprocess({gradient_image(448, 448)}, *options);
  EXPECT_TRUE(at::equal(v.image_grid_thw, at::tensor({int64_t{1}, int64_t{32}, int64_t{32}}).view({1, 3})));
  EXPECT_EQ(v.placeholder_counts(2)[0], 256);
}

TEST(PreprocessorConfig, NewerSizeLayoutAndOverrides) {
  auto o = parse_preprocessor_config(R"({"size": {"shortest_edge": 1000, "longest_edge": 200000},
                                         "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2})",
                                     "size layout");
  EXPECT_EQ(o.min_pixels(), 1000);
  EXPECT_EQ(o.max_pixels(), 200000);
  EXPECT_EQ(o.factor(), 32);
  o = parse_preprocessor_config(R"({"size": {"shortest_edge": 1000, "longest_edge": 200000}, "max_pixels": 90000})",
                                "both");
  EXPECT_EQ(o.max_pixels(), 90000) << "top-level max_pixels wins, as in HF";
  o = parse_preprocessor_config(R"({"do_normalize": false, "do_rescale": false})", "flags");
  EXPECT_DOUBLE_EQ(o.rescale(), 1.0);
  EXPECT_DOUBLE_EQ(o.image_std()[0], 1.0);
  EXPECT_EQ(load_preprocessor_config(::testing::TempDir() + "/no-such-folder"), std::nullopt);
}

TEST(PreprocessorConfig, WhatItCannotHonourIsRefusedByName) {
  auto expect_refused = [](const std::string& text, const std::string& part) {
    try {
      parse_preprocessor_config(text, "test config");
      ADD_FAILURE() << "expected vlmgen::Error for " << text;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(part));
    }
  };
  expect_refused(R"({"resample": 2})", "resample 2 (bilinear) is not supported");
  expect_refused(R"({"do_resize": false})", "do_resize is false");
  expect_refused(R"({"image_processor_type": "SiglipImageProcessor"})", "SiglipImageProcessor");
  expect_refused(R"({"min_pixels": 5000, "max_pixels": 100})", "test config");
  expect_refused(R"({"image_mean": [0.5, 0.5]})", "image_mean is [0.5,0.5]; expected a list of 3 numbers");
  expect_refused(R"({"patch_size": "fourteen"})", "patch_size is \"fourteen\"; expected an integer");
  // Nothing converted without a word: these were read as 3 entries, 4, 3, an undefined cast, -1.
  expect_refused(R"({"image_std": [0.2, 0.2, 0.2, 0.2]})", "image_std is [0.2,0.2,0.2,0.2]");
  expect_refused(R"({"patch_size": 4.9})", "patch_size is 4.9; expected an integer");
  EXPECT_EQ(parse_preprocessor_config(R"({"patch_size": 14.0})", "whole float").patch_size(), 14);
  expect_refused(R"({"resample": 3.7})", "resample is 3.7; expected an integer");
  expect_refused(R"({"min_pixels": 1e300})", "min_pixels is 1e+300; expected an integer");
  expect_refused(R"({"max_pixels": 18446744073709551615})", "within the int64 range");
  expect_refused(R"({"size": 5})", "size is 5; expected");
  // Values that pass as doubles but not as the float32 the pixels are computed in.
  expect_refused(R"({"image_std": [1e-50, 0.2, 0.2]})", "image_std[0] 1e-50");
  expect_refused(R"({"image_mean": [1e300, 0.5, 0.5]})", "image_mean[0] 1e+300");
  expect_refused(R"({"rescale_factor": 1e300})", "rescale factor 1e+300 is not a finite float32");
  expect_refused(R"({"image_std": [1e-40, 0.2, 0.2]})", "channel 0 normalizes pixels");
  expect_refused("[1, 2]", "expected a JSON object");
  expect_refused(std::string(5000, '[') + std::string(5000, ']'), "test config");
}

TEST(PreprocessorConfig, SaveThenLoadRoundTrips) {
  const std::string dir = ::testing::TempDir() + "/vlmgen_preproc_roundtrip";
  std::filesystem::create_directories(dir);
  const auto o =
      QwenImageProcessorOptions().max_pixels(123 * 28 * 28).min_pixels(4 * 28 * 28).image_mean({0.5, 0.4, 0.3});
  save_preprocessor_config(dir, o);
  const auto back = load_preprocessor_config(dir);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->max_pixels(), o.max_pixels());
  EXPECT_EQ(back->min_pixels(), o.min_pixels());
  EXPECT_EQ(back->image_mean(), o.image_mean());
  std::filesystem::remove_all(dir);
}

// Image sizes: tiny (below one patch), small, typical, huge, and aspect ratios up to 200.
const std::vector<std::pair<int64_t, int64_t>> kSizes = {
    {1, 1},       {5, 9},       {13, 27},     {27, 28},   {28, 28},    {30, 50},       {56, 56},     {100, 3},
    {224, 224},   {300, 199},   {448, 448},   {480, 640}, {719, 1281}, {1080, 1920},   {3000, 4000}, {4032, 3024},
    {6000, 9000}, {20000, 100}, {100, 20000}, {28, 5600}, {5600, 28},  {14000, 14000}, {2, 400}};

TEST(PreprocessorParity, GridEqualsHfSmartResizeOnTheReleasedSettings) {
  const auto o = *load_preprocessor_config(reference_dir());
  for (const auto& [h, w] : kSizes) {
    const auto expected = hf_smart_resize(h, w, o.factor(), o.min_pixels(), o.max_pixels());
    EXPECT_EQ(smart_resize(h, w, o.factor(), o.min_pixels(), o.max_pixels()), expected) << h << "x" << w;
  }
}

TEST(PreprocessorParity, PixelValuesEqualHfOnSmallAndShrunkImages) {
  const auto released = *load_preprocessor_config(reference_dir());
  // A tighter budget makes large inputs shrink while the test stays small in memory.
  const auto tight = QwenImageProcessorOptions(released).max_pixels(160 * 28 * 28);
  int checked = 0;
  for (const auto& options : {released, tight}) {
    for (const auto& [h, w] : kSizes) {
      const auto [rh, rw] = hf_smart_resize(h, w, options.factor(), options.min_pixels(), options.max_pixels());
      if (rh * rw > 600 * 1000 || h * w > 4000 * 4000) continue;  // the grid test covers these
      const Image image = gradient_image(h, w);
      const VisionInputs v = preprocess({image}, options);
      const std::string what = fmt::format("{}x{} max_pixels {}", h, w, options.max_pixels());
      ASSERT_TRUE(at::equal(v.image_grid_thw, at::tensor({int64_t{1}, rh / 14, rw / 14}).view({1, 3}))) << what;
      EXPECT_TRUE(at::equal(v.image_sizes, at::tensor({h, w}).view({1, 2}))) << what;
      const at::Tensor expected = hf_layout(resize_bicubic(image, rh, rw), options);
      ASSERT_EQ(v.pixel_values.sizes(), expected.sizes()) << what;
      EXPECT_LE((v.pixel_values - expected).abs().max().item<double>(), 1e-6) << what;
      ++checked;
    }
  }
  EXPECT_GE(checked, 20);
}

}  // namespace
}  // namespace vlmgen
