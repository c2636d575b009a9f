#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "image_test_util.h"
#include "stb_write_for_tests.h"
#include "vlmgen/error.h"
#include "vlmgen/image/qwen_image_processor.h"

namespace vlmgen {
namespace {

using ::testing::HasSubstr;

namespace fs = std::filesystem;
using HeightWidth = std::pair<int64_t, int64_t>;
using image_test::make_image;
using image_test::pillow_input_value;

template <typename Fn>
std::string error_message(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected vlmgen::Error";
  return "";
}

uint8_t pixel(const Image& image, int64_t c, int64_t y, int64_t x) {
  return image.rgb[static_cast<size_t>((y * image.width + x) * 3 + c)];
}

// Options under which preprocess passes 8-bit values through unchanged, so they can be traced.
QwenImageProcessorOptions identity_values() {
  return QwenImageProcessorOptions().image_mean({0, 0, 0}).image_std({1, 1, 1}).rescale(1.0);
}

class ImageProcessorFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("vlmgen_image_test_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  void write_bytes(const std::string& file, const std::string& bytes) const {
    std::ofstream out(file, std::ios::binary);
    out << bytes;
  }

  fs::path dir_;
};

// ---- smart_resize: expected values worked out by hand from the rule, factor 28 ----

TEST(SmartResize, KeepsSidesThatAreAlreadyMultiples) {
  EXPECT_EQ(smart_resize(224, 224, 28, 56 * 56, 28 * 28 * 1280), (HeightWidth{224, 224}));
  EXPECT_EQ(smart_resize(56, 84), (HeightWidth{56, 84}));
}

TEST(SmartResize, RoundsEachSideToTheNearestMultiple) {
  // 100 / 28 = 3.57 -> 4 -> 112; 300 / 28 = 10.71 -> 11 -> 308; 112 * 308 is within bounds.
  EXPECT_EQ(smart_resize(100, 300), (HeightWidth{112, 308}));
}

TEST(SmartResize, RoundsHalvesToEvenLikePython) {
  // 42 / 28 = 1.5 -> 2 and 70 / 28 = 2.5 -> 2 (round half up would give 56 x 84).
  EXPECT_EQ(smart_resize(42, 70), (HeightWidth{56, 56}));
}

TEST(SmartResize, ScalesLargeImagesUnderMaxPixels) {
  // Rounded 4004 x 2996 is above 1003520; beta = sqrt(4000 * 3000 / 1003520) = 3.4580;
  // 4000 / beta / 28 = 41.31 -> 41 -> 1148; 3000 / beta / 28 = 30.98 -> 30 -> 840.
  const auto [h, w] = smart_resize(4000, 3000, 28, 56 * 56, 28 * 28 * 1280);
  EXPECT_EQ(h, 1148);
  EXPECT_EQ(w, 840);
  EXPECT_LE(h * w, 28 * 28 * 1280);
  // 1080 / beta / 28 = 26.2 -> 26 -> 728 and 1920 / beta / 28 = 47.03 -> 47 -> 1316,
  // beta = sqrt(1080 * 1920 / 1003520) = 1.4375.
  EXPECT_EQ(smart_resize(1080, 1920), (HeightWidth{728, 1316}));
}

TEST(SmartResize, ScalesSmallImagesAboveMinPixels) {
  // Both round to 28 (784 < 3136); beta = sqrt(3136 / 1200) = 1.6166;
  // 30 * beta / 28 = 1.73 -> 2 -> 56; 40 * beta / 28 = 2.31 -> 3 -> 84.
  EXPECT_EQ(smart_resize(30, 40), (HeightWidth{56, 84}));
  EXPECT_EQ(smart_resize(28, 28), (HeightWidth{56, 56}));
}

TEST(SmartResize, AcceptsAspectRatioOf200) { EXPECT_EQ(smart_resize(28, 5600), (HeightWidth{28, 5600})); }

TEST(SmartResize, RejectsAspectRatioAbove200) {
  const std::string message = error_message([] { smart_resize(28, 5628); });
  EXPECT_THAT(message, HasSubstr("28x5628"));
  EXPECT_THAT(message, HasSubstr("201.0"));
  EXPECT_THAT(message, HasSubstr("200"));
}

// HF's current processor takes sides below the factor: 20 rounds to one factor (20 / 28 = 0.71),
// and 1x1 rounds to nothing and is enlarged to min_pixels (beta = 56, sides ceil(56 / 28) * 28).
TEST(SmartResize, TakesSidesBelowFactorLikeHf) {
  EXPECT_EQ(smart_resize(20, 100, 28), (HeightWidth{28, 112}));
  EXPECT_EQ(smart_resize(1, 1, 28), (HeightWidth{56, 56}));
  EXPECT_THAT(error_message([] { smart_resize(0, 100, 28); }),
              HasSubstr("height 0 and width 100 must both be positive"));
  EXPECT_THROW(smart_resize(100, -5, 28), Error);
}

TEST(SmartResize, RejectsMinPixelsAboveMaxPixels) {
  EXPECT_THAT(error_message([] { smart_resize(100, 100, 28, 5000, 4000); }), HasSubstr("5000"));
}

// ---- preprocess ----

TEST(ImageProcessor, PatchRowsAndColumnsFollowTheHfLayout) {
  // 56 x 84 is a multiple of 28 with an area above min_pixels: no resize, so every value can be
  // traced back to its pixel. One image per coordinate, since 8 bits cannot hold (c, y, x).
  const int64_t height = 56;
  const int64_t width = 84;
  const Image ys = make_image(height, width, [](int64_t, int64_t y, int64_t) { return uint8_t(y); });
  const Image xs = make_image(height, width, [](int64_t, int64_t, int64_t x) { return uint8_t(x); });
  const Image cs = make_image(height, width, [](int64_t c, int64_t, int64_t) { return uint8_t(10 * c + 1); });
  const VisionInputs out = preprocess({ys, xs, cs}, identity_values());

  const int64_t patch = 14, tp = 2, merge = 2, grid_h = height / patch, grid_w = width / patch;
  const int64_t rows_per_image = grid_h * grid_w;
  ASSERT_EQ(out.pixel_values.scalar_type(), at::kFloat);
  ASSERT_EQ(out.pixel_values.sizes(), (at::IntArrayRef{3 * rows_per_image, 3 * tp * patch * patch}));
  const at::Tensor pv = out.pixel_values.contiguous();
  const float* data = pv.data_ptr<float>();
  const int64_t cols = pv.size(1);

  // Rows walk merge blocks left to right, top to bottom, and within a block its patches in
  // row-major order; columns walk channel, frame, patch row, patch column.
  int64_t row = 0;
  int64_t checked = 0;
  for (int64_t block_y = 0; block_y < grid_h / merge; ++block_y) {
    for (int64_t block_x = 0; block_x < grid_w / merge; ++block_x) {
      for (int64_t in_y = 0; in_y < merge; ++in_y) {
        for (int64_t in_x = 0; in_x < merge; ++in_x, ++row) {
          const int64_t patch_y = block_y * merge + in_y;
          const int64_t patch_x = block_x * merge + in_x;
          int64_t col = 0;
          for (int64_t c = 0; c < 3; ++c) {
            for (int64_t t = 0; t < tp; ++t) {
              for (int64_t py = 0; py < patch; ++py) {
                for (int64_t px = 0; px < patch; ++px, ++col) {
                  const int64_t y = patch_y * patch + py;
                  const int64_t x = patch_x * patch + px;
                  const float got_y = data[(0 * rows_per_image + row) * cols + col];
                  const float got_x = data[(1 * rows_per_image + row) * cols + col];
                  const float got_c = data[(2 * rows_per_image + row) * cols + col];
                  if (got_y != y || got_x != x || got_c != 10 * c + 1) {
                    ADD_FAILURE() << "row " << row << " col " << col << " should hold (t " << t << ", c " << c << ", y "
                                  << y << ", x " << x << "), holds (c " << (got_c - 1) / 10 << ", y " << got_y << ", x "
                                  << got_x << ")";
                    return;
                  }
                  ++checked;
                }
              }
            }
          }
          ASSERT_EQ(col, cols);
        }
      }
    }
  }
  EXPECT_EQ(row, rows_per_image);
  EXPECT_EQ(checked, rows_per_image * cols);
}

TEST(ImageProcessor, GridAndSizesDescribeEachImage) {
  const Image wide = make_image(100, 300, [](int64_t c, int64_t y, int64_t x) { return uint8_t(c + y + x); });
  const Image square = make_image(224, 224, [](int64_t c, int64_t y, int64_t x) { return uint8_t(c * y + x); });
  const VisionInputs out = preprocess({wide, square}, QwenImageProcessorOptions());

  // 100 x 300 -> 112 x 308 -> 8 x 22 patches; 224 x 224 -> 16 x 16 patches.
  EXPECT_EQ(out.layout, VisionLayout::kPatchFlattened);
  ASSERT_EQ(out.image_grid_thw.scalar_type(), at::kLong);
  ASSERT_EQ(out.image_sizes.scalar_type(), at::kLong);
  EXPECT_EQ(detail::to_int64_vector(out.image_grid_thw), (std::vector<int64_t>{1, 8, 22, 1, 16, 16}));
  EXPECT_EQ(detail::to_int64_vector(out.image_sizes), (std::vector<int64_t>{100, 300, 224, 224}));
  EXPECT_EQ(out.pixel_values.sizes(), (at::IntArrayRef{8 * 22 + 16 * 16, 3 * 2 * 14 * 14}));
  EXPECT_NO_THROW(out.validate(/*spatial_merge_size=*/2));
  EXPECT_EQ(out.placeholder_counts(2), (std::vector<int64_t>{44, 64}));
}

TEST(ImageProcessor, OtherPatchGeometriesChangeGridAndWidth) {
  const Image image = make_image(64, 32, [](int64_t c, int64_t y, int64_t x) { return uint8_t(c + 2 * y + x); });
  const auto options =
      identity_values().patch_size(4).merge_size(2).temporal_patch_size(1).min_pixels(8 * 8).max_pixels(1 << 20);
  const VisionInputs out = preprocess({image}, options);
  EXPECT_EQ(detail::to_int64_vector(out.image_grid_thw), (std::vector<int64_t>{1, 16, 8}));
  ASSERT_EQ(out.pixel_values.sizes(), (at::IntArrayRef{16 * 8, 3 * 1 * 4 * 4}));
  // Row 1 is the second patch of the first 2 x 2 block: patch (0, 1), pixels x = 4..7.
  // Column 16 + 4 * 2 + 3 is channel 1, patch row 2, patch column 3: pixel (y 2, x 7).
  EXPECT_EQ(out.pixel_values[1][16 + 4 * 2 + 3].item<float>(), float(pixel(image, 1, 2, 7)));
  // Row 2 is patch (1, 0): y = 4..7, x = 0..3.
  EXPECT_EQ(out.pixel_values[2][0].item<float>(), float(pixel(image, 0, 4, 0)));
}

TEST(ImageProcessor, NormalizesLikeTheHfProcessor) {
  const Image image = make_image(56, 56, [](int64_t c, int64_t, int64_t) {
    return uint8_t(c == 0 ? 0 : c == 1 ? 128 : 255);
  });
  const QwenImageProcessorOptions options;
  const VisionInputs out = preprocess({image}, options);
  // rescale in double stored as float32, then (x - mean) / std in float32.
  for (int64_t c = 0; c < 3; ++c) {
    const float rescaled = static_cast<float>(pixel(image, c, 0, 0) * (1.0 / 255.0));
    const float expected =
        (rescaled - static_cast<float>(options.image_mean()[c])) / static_cast<float>(options.image_std()[c]);
    const at::Tensor channel = out.pixel_values.narrow(1, c * 2 * 14 * 14, 2 * 14 * 14);
    EXPECT_EQ(channel.min().item<float>(), expected) << "channel " << c;
    EXPECT_EQ(channel.max().item<float>(), expected) << "channel " << c;
  }
  EXPECT_NEAR(out.pixel_values[0][0].item<float>(), (0.0 - 0.48145466) / 0.26862954, 1e-6);
  EXPECT_NEAR(out.pixel_values[0][2 * 14 * 14].item<float>(), (128 / 255.0 - 0.4578275) / 0.26130258, 1e-6);
}

TEST(ImageProcessor, ResizesImagesThatAreNotMultiples) {
  // A constant image stays constant through the bicubic filter, whatever the scale.
  const Image image = make_image(100, 300, [](int64_t c, int64_t, int64_t) { return uint8_t(40 + 50 * c); });
  const VisionInputs out = preprocess({image}, identity_values());
  EXPECT_EQ(detail::to_int64_vector(out.image_grid_thw), (std::vector<int64_t>{1, 8, 22}));
  for (int64_t c = 0; c < 3; ++c) {
    const at::Tensor channel = out.pixel_values.narrow(1, c * 2 * 14 * 14, 2 * 14 * 14);
    EXPECT_EQ(channel.min().item<float>(), 40 + 50 * c);
    EXPECT_EQ(channel.max().item<float>(), 40 + 50 * c);
  }
}

TEST(ImageProcessor, EmptyListGivesEmptyBundle) { EXPECT_TRUE(preprocess({}, QwenImageProcessorOptions()).empty()); }

TEST(ImageProcessor, RejectsBadImagesNamingTheIndex) {
  const Image good = make_image(56, 56, [](int64_t, int64_t, int64_t) { return uint8_t(7); });
  Image short_buffer = good;
  short_buffer.rgb.pop_back();
  std::string message = error_message([&] { preprocess({good, short_buffer}, QwenImageProcessorOptions()); });
  EXPECT_THAT(message, HasSubstr("image 1"));
  EXPECT_THAT(message, HasSubstr("9408"));

  // A picture below one patch is no longer refused: HF enlarges it to min_pixels (56x56).
  const Image tiny = make_image(10, 10, [](int64_t, int64_t, int64_t) { return uint8_t(7); });
  EXPECT_TRUE(at::equal(preprocess({tiny}, QwenImageProcessorOptions()).image_grid_thw,
                        at::tensor({int64_t{1}, int64_t{4}, int64_t{4}}).view({1, 3})));

  EXPECT_THAT(error_message([&] { preprocess({Image{}}, QwenImageProcessorOptions()); }), HasSubstr("0x0"));
}

TEST(ImageProcessor, RejectsInvalidOptions) {
  const Image good = make_image(56, 56, [](int64_t, int64_t, int64_t) { return uint8_t(7); });
  EXPECT_THAT(error_message([&] {
                preprocess({good}, QwenImageProcessorOptions().image_std({1, 0, 1}));
              }),
              HasSubstr("image_std[1]"));
  EXPECT_THAT(error_message([&] { preprocess({good}, QwenImageProcessorOptions().patch_size(0)); }),
              HasSubstr("patch_size"));
  EXPECT_THAT(error_message([&] { preprocess({good}, QwenImageProcessorOptions().min_pixels(10).max_pixels(5)); }),
              HasSubstr("min_pixels 10"));
}

// ---- resize_bicubic ----

TEST(ImageProcessorResize, SameSizeIsACopy) {
  const Image image =
      make_image(13, 17, [](int64_t c, int64_t y, int64_t x) { return uint8_t(c * 71 + y * 13 + x * 29); });
  const Image out = resize_bicubic(image, 13, 17);
  EXPECT_EQ(out.height, 13);
  EXPECT_EQ(out.width, 17);
  EXPECT_EQ(out.rgb, image.rgb);
}

// Pixels of Pillow 9.4's `Image.fromarray(a).resize((w, h), Image.BICUBIC, reducing_gap=None)`,
// which is how the HF Qwen2-VL processor resizes; a = pillow_input(6, 8)
// (pillow_input_value in image_test_util.h).
TEST(ImageProcessorResize, ShrinkingMatchesPillowExactly) {
  const std::vector<uint8_t> expected = {36,  93,  153, 143, 171, 167, 91,  62,  117, 126, 170, 114, 190, 96,  81,
                                         95,  155, 132, 167, 129, 75,  89,  142, 190, 170, 98,  96,  109, 130, 180,
                                         164, 177, 160, 109, 123, 118, 123, 182, 116, 85,  130, 148, 133, 195, 113,
                                         144, 157, 115, 123, 117, 161, 112, 89,  95,  142, 155, 82,  130, 110, 130};
  const Image out = resize_bicubic(make_image(6, 8, pillow_input_value), 4, 5);
  EXPECT_EQ(out.height, 4);
  EXPECT_EQ(out.width, 5);
  EXPECT_EQ(out.rgb, expected);
}

TEST(ImageProcessorResize, EnlargingMatchesPillowExactly) {
  // Includes values clamped to 0 and 255 where the cubic overshoots.
  const std::vector<uint8_t> expected = {
      0,   47,  100, 34,  87,  139, 91,  152, 210, 142, 189, 255, 226, 37,  93,  127, 26,  77,  22,  93,  155, 92,  145,
      220, 141, 228, 70,  206, 157, 31,  255, 22,  90,  13,  64,  116, 53,  105, 177, 116, 178, 200, 162, 226, 144, 128,
      64,  90,  75,  50,  120, 59,  126, 155, 121, 192, 113, 195, 155, 58,  192, 100, 74,  147, 64,  125, 39,  92,  147,
      82,  138, 187, 155, 197, 150, 196, 216, 31,  34,  93,  99,  31,  97,  182, 114, 164, 171, 172, 196, 10,  220, 70,
      60,  152, 57,  138, 45,  127, 182, 63,  116, 182, 108, 177, 86,  187, 164, 28,  240, 54,  78,  81,  88,  138, 73,
      158, 224, 159, 163, 223, 229, 43,  63,  112, 62,  106, 76,  124, 188, 117, 175, 244, 87,  140, 210, 145, 218, 82,
      172, 192, 20,  130, 39,  114, 87,  111, 198, 138, 209, 188, 184, 208, 134, 129, 39,  103, 72,  92,  179, 110, 183,
      185, 188, 238, 140, 112, 167, 235, 182, 212, 120, 158, 189, 63,  19,  88,  144, 96,  155, 199, 166, 218, 117, 152,
      208, 51,  27,  94,  144, 89,  149, 202, 157, 211, 141, 186, 235, 39,  136, 202, 255, 215, 112, 151, 201, 63,  99,
      62,  123, 171, 145, 217, 59,  92,  153, 51,  20,  72,  120, 75,  130, 202, 157, 223, 93,  121, 184, 65,  28,  80,
      111, 172, 233, 138, 147, 112, 118, 115, 64,  144, 104, 156, 205, 191, 126, 57,  106, 83,  77,  24,  89,  140, 123,
      179, 100, 212, 157, 58,  154, 119, 99,  34,  95,  171, 197, 249, 15,  77,  141, 81,  26,  101, 174, 129, 175, 228,
      217, 26,  94,  141, 40,  120, 65,  142, 139, 152, 211, 0,   241, 78,  59,  194, 69,  151, 85,  153, 205};
  const Image out = resize_bicubic(make_image(6, 8, pillow_input_value), 9, 11);
  EXPECT_EQ(out.height, 9);
  EXPECT_EQ(out.width, 11);
  EXPECT_EQ(out.rgb, expected);
}

TEST(ImageProcessorResize, MixedScalesMatchPillowExactly) {
  // 123 x 77 -> 56 x 112: shrinks rows, enlarges columns. Pillow's output, summarized by its
  // byte sum and FNV-1a 64 hash.
  const Image out = resize_bicubic(make_image(123, 77, pillow_input_value), 56, 112);
  uint64_t hash = 14695981039346656037ull;
  uint64_t sum = 0;
  for (uint8_t v : out.rgb) {
    hash = (hash ^ v) * 1099511628211ull;
    sum += v;
  }
  EXPECT_EQ(sum, 2403062u);
  EXPECT_EQ(hash, 17566937838104547945ull);
}

TEST(ImageProcessorResize, ShrinkingAveragesLikeAnAntialiasedFilter) {
  // A 1-pixel checkerboard shrunk 3x: a plain bicubic sampler lands on single pixels there and
  // returns a checkerboard of 0 and 255; PIL's filter, widened by the scale, averages to grey.
  const Image checker =
      make_image(48, 48, [](int64_t, int64_t y, int64_t x) { return uint8_t((x + y) % 2 ? 255 : 0); });
  const Image out = resize_bicubic(checker, 16, 16);
  for (int64_t y = 0; y < 16; ++y) {
    for (int64_t x = 0; x < 16; ++x) EXPECT_NEAR(pixel(out, 1, y, x), 128, 2) << y << "," << x;
  }
}

TEST(ImageProcessorResize, RejectsBadTargetSizes) {
  const Image image = make_image(4, 4, [](int64_t, int64_t, int64_t) { return uint8_t(1); });
  EXPECT_THAT(error_message([&] { resize_bicubic(image, 0, 5); }), HasSubstr("0x5"));
}

// ---- files ----

TEST_F(ImageProcessorFiles, PngRoundTripIsExact) {
  const Image image = make_image(
      37, 53, [](int64_t c, int64_t y, int64_t x) { return uint8_t((c * 97 + y * 31 + x * 57 + x * y) % 256); });
  save_png(path("a.png"), image);
  const Image back = load_image(path("a.png"));
  EXPECT_EQ(back.height, 37);
  EXPECT_EQ(back.width, 53);
  EXPECT_EQ(back.rgb, image.rgb);
}

TEST_F(ImageProcessorFiles, JpegLoadsCloseToWhatWasWritten) {
  const Image image = make_image(48, 64, [](int64_t c, int64_t y, int64_t x) {
    return uint8_t(c == 0 ? 3 * x : c == 1 ? 4 * y : 100 + x + y);
  });
  ASSERT_NE(stbi_write_jpg(path("a.jpg").c_str(), 64, 48, 3, image.rgb.data(), 95), 0);
  const Image back = load_image(path("a.jpg"));
  ASSERT_EQ(back.height, 48);
  ASSERT_EQ(back.width, 64);
  ASSERT_EQ(back.rgb.size(), image.rgb.size());
  double total = 0;
  int max_diff = 0;
  for (size_t i = 0; i < image.rgb.size(); ++i) {
    const int diff = std::abs(int(back.rgb[i]) - int(image.rgb[i]));
    total += diff;
    max_diff = std::max(max_diff, diff);
  }
  EXPECT_LT(total / image.rgb.size(), 2.0);
  EXPECT_LE(max_diff, 16);
}

TEST_F(ImageProcessorFiles, GrayscaleAndRgbaBecomeRgb) {
  const std::vector<uint8_t> gray = {0, 50, 100, 150, 200, 250};  // 2 x 3
  ASSERT_NE(stbi_write_png(path("gray.png").c_str(), 3, 2, 1, gray.data(), 3), 0);
  const Image g = load_image(path("gray.png"));
  ASSERT_EQ(g.height, 2);
  ASSERT_EQ(g.width, 3);
  for (size_t i = 0; i < gray.size(); ++i) {
    for (size_t c = 0; c < 3; ++c) EXPECT_EQ(g.rgb[i * 3 + c], gray[i]);
  }

  const std::vector<uint8_t> rgba = {10, 20, 30, 0, 40, 50, 60, 128, 70, 80, 90, 255};  // 1 x 3
  ASSERT_NE(stbi_write_png(path("rgba.png").c_str(), 3, 1, 4, rgba.data(), 12), 0);
  const Image a = load_image(path("rgba.png"));
  EXPECT_EQ(a.rgb, (std::vector<uint8_t>{10, 20, 30, 40, 50, 60, 70, 80, 90}));
}

TEST_F(ImageProcessorFiles, LoadErrorsNameThePath) {
  const std::string missing = path("missing.png");
  std::string message = error_message([&] { load_image(missing); });
  EXPECT_THAT(message, HasSubstr(missing));
  EXPECT_THAT(message, HasSubstr("No such file"));

  const std::string text = path("notes.png");
  write_bytes(text, "this is not an image at all\n");
  message = error_message([&] { load_image(text); });
  EXPECT_THAT(message, HasSubstr(text));
  EXPECT_THAT(message, HasSubstr("decode"));

  const std::string empty = path("empty.jpg");
  write_bytes(empty, "");
  EXPECT_THAT(error_message([&] { load_image(empty); }), HasSubstr(empty));

  // A valid PNG cut short after its header.
  const Image image = make_image(16, 16, [](int64_t c, int64_t y, int64_t x) { return uint8_t(c + y * x); });
  save_png(path("whole.png"), image);
  std::ifstream in(path("whole.png"), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string truncated = path("truncated.png");
  write_bytes(truncated, bytes.substr(0, 40));
  EXPECT_THAT(error_message([&] { load_image(truncated); }), HasSubstr(truncated));

  EXPECT_THAT(error_message([&] { load_image(dir_.string()); }), HasSubstr(dir_.string()));
}

TEST_F(ImageProcessorFiles, SaveErrorsNameThePath) {
  const Image image = make_image(4, 4, [](int64_t, int64_t, int64_t) { return uint8_t(1); });
  const std::string nowhere = path("no/such/dir/a.png");
  EXPECT_THAT(error_message([&] { save_png(nowhere, image); }), HasSubstr(nowhere));

  Image bad = image;
  bad.rgb.resize(5);
  const std::string target = path("bad.png");
  const std::string message = error_message([&] { save_png(target, bad); });
  EXPECT_THAT(message, HasSubstr(target));
  EXPECT_THAT(message, HasSubstr("48"));
  EXPECT_FALSE(fs::exists(target));
}

// Pillow 9.4's `resize((w, h), Image.BILINEAR, reducing_gap=None)` of pillow_input(6, 8): the
// resampling of Gemma-3's image processor.
TEST(ImageProcessorResize, BilinearMatchesPillowExactly) {
  const std::vector<uint8_t> shrunk = {44,  97,  150, 137, 160, 159, 97,  77,  121, 128, 156, 114, 182, 101, 88,
                                       98,  151, 134, 157, 130, 92,  98,  139, 172, 155, 107, 107, 115, 133, 170,
                                       155, 173, 156, 113, 128, 121, 121, 171, 120, 97,  134, 138, 131, 184, 118,
                                       144, 158, 116, 122, 119, 155, 117, 97,  99,  137, 149, 88,  128, 116, 130};
  EXPECT_EQ(resize_bilinear(make_image(6, 8, pillow_input_value), 4, 5).rgb, shrunk);
  const Image enlarged = resize_bilinear(make_image(6, 8, pillow_input_value), 9, 11);
  ASSERT_EQ(enlarged.rgb.size(), 9u * 11u * 3u);
  const std::vector<uint8_t> first_row = {0,   53,  106, 42,  95,  148, 94,  147, 200, 145, 187,
                                          240, 197, 52,  105, 121, 46,  99,  44,  97,  150, 96,
                                          149, 202, 147, 200, 79,  199, 147, 49,  241, 38,  91};
  EXPECT_EQ(std::vector<uint8_t>(enlarged.rgb.begin(), enlarged.rgb.begin() + 33), first_row);
  // 123 x 77 -> 56 x 112, summarized by Pillow's byte sum and FNV-1a 64 hash.
  const Image mixed = resize_bilinear(make_image(123, 77, pillow_input_value), 56, 112);
  uint64_t hash = 14695981039346656037ull, sum = 0;
  for (uint8_t v : mixed.rgb) {
    hash = (hash ^ v) * 1099511628211ull;
    sum += v;
  }
  EXPECT_EQ(sum, 2403248u);
  EXPECT_EQ(hash, 17891181366062860057ull);
  // Different from the bicubic filter on the same input.
  EXPECT_NE(resize_bicubic(make_image(6, 8, pillow_input_value), 4, 5).rgb, shrunk);
}

}  // namespace
}  // namespace vlmgen
