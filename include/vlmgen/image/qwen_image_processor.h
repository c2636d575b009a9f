#pragma once

// Image input for the Qwen2-VL reference model: decode PNG/JPEG files, resize them the way the
// HF `Qwen2VLImageProcessor` does, and lay the pixels out as its `pixel_values`.
//
//   auto image = vlmgen::load_image("beach.jpg");
//   vlmgen::VisionInputs vision = vlmgen::preprocess({image}, vlmgen::QwenImageProcessorOptions());
//   // vision.pixel_values:   [grid_t*grid_h*grid_w, 3*2*14*14] float32
//   // vision.image_grid_thw: [[1, grid_h, grid_w]]
//   // vision.image_sizes:    [[height, width]] of the file

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "vlmgen/image/image.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen {

/// Bounds on the Qwen2-VL image processor, so that neither a setting nor an image can make it
/// allocate or compute without limit. Qwen2-VL's own settings: patch 14, merge 2, temporal 2,
/// max_pixels 12,845,056.
struct QwenImageProcessorLimits {
  /// Largest input side for smart_resize (stb's own decoding limit).
  static constexpr int64_t kMaxSide = int64_t{1} << 24;
  /// Largest patch_size * merge_size: the smallest resized image is factor^2 pixels.
  static constexpr int64_t kMaxFactor = 4096;
  static constexpr int64_t kMaxTemporalPatchSize = 64;
  /// Largest min_pixels / max_pixels, and largest resized image (smart_resize may exceed
  /// max_pixels for extreme aspect ratios, as HF's does; never this).
  static constexpr int64_t kMaxPixels = int64_t{1} << 26;
  /// Largest resized height * width * temporal_patch_size of one image: its pixel_values rows
  /// hold 3 float32 per pixel and frame (1.5 GiB at this bound).
  static constexpr int64_t kMaxPixelFrames = int64_t{1} << 27;
};

/// Resamples `image` to `height` x `width` with PIL's bicubic filter (`Image.resize(...,
/// BICUBIC)`: a = -0.5, antialiased when shrinking, 8-bit fixed-point, horizontal pass first,
/// each pass rounded and clamped to [0, 255]). The HF processor resizes through PIL, so this
/// reproduces its pixels exactly rather than approximately. Same size returns a copy.
Image resize_bicubic(const Image& image, int64_t height, int64_t width);
/// The same with Pillow's bilinear filter (`Image.resize(..., BILINEAR)`, a triangle of support 1,
/// antialiased when shrinking): the resampling of Gemma-3's image processor.
Image resize_bilinear(const Image& image, int64_t height, int64_t width);

/// Qwen2-VL's resize rule: the (height, width) closest to the input whose sides are multiples
/// of `factor` (patch_size * merge_size) and whose area lies in [min_pixels, max_pixels],
/// keeping the aspect ratio. Each side is rounded to the nearest multiple (ties to even, as
/// Python's `round`); an area above max_pixels is scaled down by sqrt(area / max_pixels) and
/// floored to multiples, one below min_pixels scaled up and ceiled.
/// Sides below `factor` round to 0 and are enlarged to min_pixels, as HF does today (older HF
/// versions refused them). Throws vlmgen::Error when a side is not positive or is above
/// QwenImageProcessorLimits::kMaxSide,
/// the aspect ratio exceeds 200, factor exceeds kMaxFactor or max_pixels exceeds kMaxPixels.
///   smart_resize(224, 224, 28, 56 * 56, 28 * 28 * 1280) == {224, 224}
std::pair<int64_t, int64_t> smart_resize(int64_t height, int64_t width, int64_t factor = 28,
                                         int64_t min_pixels = 56 * 56, int64_t max_pixels = 28 * 28 * 1280);

/// Settings of the Qwen2-VL image processor; the defaults are Qwen2-VL's
/// `preprocessor_config.json`.
///   auto options = QwenImageProcessorOptions().max_pixels(512 * 28 * 28);
class QwenImageProcessorOptions {
 public:
  /// Side of a square vision patch in pixels. Default 14.
  QwenImageProcessorOptions& patch_size(int64_t value) {
    patch_size_ = value;
    return *this;
  }
  int64_t patch_size() const { return patch_size_; }

  /// Frames per temporal patch; a still image is repeated this many times. Default 2.
  QwenImageProcessorOptions& temporal_patch_size(int64_t value) {
    temporal_patch_size_ = value;
    return *this;
  }
  int64_t temporal_patch_size() const { return temporal_patch_size_; }

  /// Patches merged per side into one LM token; resized sides are multiples of
  /// patch_size * merge_size. Default 2.
  QwenImageProcessorOptions& merge_size(int64_t value) {
    merge_size_ = value;
    return *this;
  }
  int64_t merge_size() const { return merge_size_; }

  /// Smallest area in pixels after resizing. Default 56 * 56.
  QwenImageProcessorOptions& min_pixels(int64_t value) {
    min_pixels_ = value;
    return *this;
  }
  int64_t min_pixels() const { return min_pixels_; }

  /// Largest area in pixels after resizing; bounds the number of vision tokens. Default
  /// 28 * 28 * 1280.
  QwenImageProcessorOptions& max_pixels(int64_t value) {
    max_pixels_ = value;
    return *this;
  }
  int64_t max_pixels() const { return max_pixels_; }

  /// Per-channel (R, G, B) mean subtracted after rescaling. Default CLIP's
  /// {0.48145466, 0.4578275, 0.40821073}.
  QwenImageProcessorOptions& image_mean(std::array<double, 3> value) {
    image_mean_ = value;
    return *this;
  }
  const std::array<double, 3>& image_mean() const { return image_mean_; }

  /// Per-channel (R, G, B) divisor applied after the mean. Default CLIP's
  /// {0.26862954, 0.26130258, 0.27577711}.
  QwenImageProcessorOptions& image_std(std::array<double, 3> value) {
    image_std_ = value;
    return *this;
  }
  const std::array<double, 3>& image_std() const { return image_std_; }

  /// Factor from 8-bit values to the model's range. Default 1 / 255.
  QwenImageProcessorOptions& rescale(double value) {
    rescale_ = value;
    return *this;
  }
  double rescale() const { return rescale_; }

  /// patch_size * merge_size: the multiple every resized side is rounded to.
  int64_t factor() const { return patch_size_ * merge_size_; }

  /// Throws vlmgen::Error naming the field when a value cannot work (non-positive sizes,
  /// min_pixels > max_pixels, a zero or non-finite std, a non-finite mean or rescale) or exceeds
  /// QwenImageProcessorLimits (factor, temporal_patch_size, max_pixels).
  void validate() const;

 private:
  int64_t patch_size_ = 14;
  int64_t temporal_patch_size_ = 2;
  int64_t merge_size_ = 2;
  int64_t min_pixels_ = 56 * 56;
  int64_t max_pixels_ = 28 * 28 * 1280;
  std::array<double, 3> image_mean_ = {0.48145466, 0.4578275, 0.40821073};
  std::array<double, 3> image_std_ = {0.26862954, 0.26130258, 0.27577711};
  double rescale_ = 1.0 / 255.0;
};

/// Turns `images` into Qwen2-VL vision inputs, images in the given order: each one is resized
/// with smart_resize + resize_bicubic, rescaled, normalized, repeated temporal_patch_size times
/// and cut into patches in the HF processor's row order (merge_size x merge_size blocks of
/// neighbouring patches are consecutive rows).
///   pixel_values:   [sum_i grid_h_i * grid_w_i, 3 * temporal_patch_size * patch_size^2], float32, CPU
///   image_grid_thw: [num_images, 3], int64, (1, resized_height / patch, resized_width / patch)
///   image_sizes:    [num_images, 2], int64, (height, width) of each image before resizing
/// An empty list gives an empty bundle. Throws vlmgen::Error (naming the image's index) on a
/// malformed image, an impossible size, a resized image above QwenImageProcessorLimits, or
/// invalid options; the checks run before any pixel is resampled.
VisionInputs preprocess(const std::vector<Image>& images,
                        const QwenImageProcessorOptions& options = QwenImageProcessorOptions());

}  // namespace vlmgen
