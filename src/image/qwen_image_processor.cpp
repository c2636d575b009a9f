#include "vlmgen/image/qwen_image_processor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "config_fields.h"
#include "vlmgen/error.h"

namespace vlmgen {
namespace detail {
namespace {

constexpr int64_t kChannels = 3;

void check_image(const Image& image, const std::string& what) {
  VLMGEN_CHECK(image.height > 0 && image.width > 0, "{}: the image must have pixels, got {}x{} (height x width)", what,
               image.height, image.width);
  // Checked before multiplying so that absurd sizes cannot overflow the product below.
  VLMGEN_CHECK(image.height <= std::numeric_limits<int32_t>::max() / image.width / kChannels,
               "{}: the image is too large, {}x{} (height x width)", what, image.height, image.width);
  const int64_t expected = image.height * image.width * kChannels;
  VLMGEN_CHECK(static_cast<int64_t>(image.rgb.size()) == expected,
               "{}: a {}x{} RGB image needs {} bytes (height * width * 3), got {}", what, image.height, image.width,
               expected, image.rgb.size());
}

// Python's round() on height / factor: to the nearest integer, ties to even. Integer arithmetic
// is exact where a float quotient could land a hair off .5.
int64_t round_half_even_div(int64_t numerator, int64_t denominator) {
  const int64_t q = numerator / denominator;
  const int64_t twice_r = 2 * (numerator % denominator);
  if (twice_r > denominator || (twice_r == denominator && q % 2 != 0)) return q + 1;
  return q;
}

// ---- PIL-compatible bicubic resampling (Pillow libImaging/Resample.c) ----
// The constants and the order of operations below are Pillow's: changing any of them (a = -0.75
// as in torch, float accumulation, one 2-D pass) moves pixels by one or two levels and the
// model no longer sees what it saw through the HF processor.

constexpr int kPrecisionBits = 32 - 8 - 2;

double bicubic_filter(double x) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

// Pillow's BILINEAR: a triangle of support 1.
double bilinear_filter(double x) {
  if (x < 0.0) x = -x;
  return x < 1.0 ? 1.0 - x : 0.0;
}

enum class Filter { kBicubic, kBilinear };

// For each output index along one axis: the first input index, how many inputs it reads, and
// their fixed-point weights (ksize per output, zero-padded).
struct AxisCoefficients {
  int ksize = 0;
  std::vector<int> first;
  std::vector<int> count;
  std::vector<int32_t> weights;  // [out_size * ksize]
};

AxisCoefficients precompute_coefficients(int in_size, int out_size, Filter filter) {
  const double scale = static_cast<double>(static_cast<float>(in_size)) / out_size;
  // Shrinking widens the filter by the scale factor: that is PIL's antialiasing.
  const double filter_scale = std::max(scale, 1.0);
  const double support = (filter == Filter::kBicubic ? 2.0 : 1.0) * filter_scale;
  AxisCoefficients c;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(out_size);
  c.count.resize(out_size);
  c.weights.assign(static_cast<size_t>(out_size) * c.ksize, 0);
  std::vector<double> k(c.ksize);
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = (xx + 0.5) * scale;
    const double ss = 1.0 / filter_scale;
    // Truncation toward zero, then clamping, exactly as Pillow rounds its window.
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      const double t = (x + xmin - center + 0.5) * ss;
      const double w = filter == Filter::kBicubic ? bicubic_filter(t) : bilinear_filter(t);
      k[x] = w;
      ww += w;
    }
    for (int x = 0; x < xmax; ++x) {
      if (ww != 0.0) k[x] /= ww;
    }
    int32_t* out = &c.weights[static_cast<size_t>(xx) * c.ksize];
    for (int x = 0; x < xmax; ++x) {
      out[x] = k[x] < 0 ? static_cast<int32_t>(-0.5 + k[x] * (1 << kPrecisionBits))
                        : static_cast<int32_t>(0.5 + k[x] * (1 << kPrecisionBits));
    }
    c.first[xx] = xmin;
    c.count[xx] = xmax;
  }
  return c;
}

uint8_t clip8(int64_t in) {
  if (in >= (int64_t{1} << kPrecisionBits << 8)) return 255;
  if (in <= 0) return 0;
  return static_cast<uint8_t>(in >> kPrecisionBits);
}

Image resample_horizontal(const Image& in, int out_width, Filter filter) {
  const AxisCoefficients c = precompute_coefficients(static_cast<int>(in.width), out_width, filter);
  Image out{in.height, out_width, std::vector<uint8_t>(static_cast<size_t>(in.height) * out_width * kChannels)};
  for (int64_t y = 0; y < in.height; ++y) {
    const uint8_t* row = &in.rgb[static_cast<size_t>(y * in.width * kChannels)];
    uint8_t* dst = &out.rgb[static_cast<size_t>(y * out_width * kChannels)];
    for (int xx = 0; xx < out_width; ++xx) {
      const int32_t* k = &c.weights[static_cast<size_t>(xx) * c.ksize];
      for (int64_t ch = 0; ch < kChannels; ++ch) {
        int64_t sum = int64_t{1} << (kPrecisionBits - 1);
        for (int x = 0; x < c.count[xx]; ++x) sum += row[(c.first[xx] + x) * kChannels + ch] * int64_t{k[x]};
        dst[xx * kChannels + ch] = clip8(sum);
      }
    }
  }
  return out;
}

Image resample_vertical(const Image& in, int out_height, Filter filter) {
  const AxisCoefficients c = precompute_coefficients(static_cast<int>(in.height), out_height, filter);
  const int64_t row_bytes = in.width * kChannels;
  Image out{out_height, in.width, std::vector<uint8_t>(static_cast<size_t>(out_height * row_bytes))};
  for (int yy = 0; yy < out_height; ++yy) {
    const int32_t* k = &c.weights[static_cast<size_t>(yy) * c.ksize];
    uint8_t* dst = &out.rgb[static_cast<size_t>(yy * row_bytes)];
    for (int64_t i = 0; i < row_bytes; ++i) {
      int64_t sum = int64_t{1} << (kPrecisionBits - 1);
      for (int y = 0; y < c.count[yy]; ++y) {
        sum += in.rgb[static_cast<size_t>((c.first[yy] + y) * row_bytes + i)] * int64_t{k[y]};
      }
      dst[i] = clip8(sum);
    }
  }
  return out;
}

}  // namespace
}  // namespace detail

namespace detail {
namespace {

Image resize_with(const Image& image, int64_t height, int64_t width, Filter filter, const char* what) {
  check_image(image, what);
  VLMGEN_CHECK(height > 0 && width > 0 && height <= std::numeric_limits<int32_t>::max() / width / kChannels,
               "{}: target size must be positive and fit in memory, got {}x{} (height x width)", what, height, width);
  // Like Pillow, run only the passes whose axis changes size; horizontal first, since the
  // 8-bit rounding between the passes makes the order visible. Its image (the input's height x
  // the new width) is bounded too: a tall, narrow picture widened (8 x 8,388,608 to 896 wide, a
  // 200 KB PNG within every decode limit) would otherwise take 22 GB.
  VLMGEN_CHECK(width == image.width || image.height <= kDefaultMaxImagePixels / width,
               "{}: resizing a {}x{} (height x width) image to {}x{} passes through {}x{} pixels, above the limit of "
               "{} (kDefaultMaxImagePixels): the image is too tall for its width",
               what, image.height, image.width, height, width, image.height, width, kDefaultMaxImagePixels);
  Image out = width != image.width ? resample_horizontal(image, static_cast<int>(width), filter) : image;
  if (height != image.height) out = resample_vertical(out, static_cast<int>(height), filter);
  return out;
}

}  // namespace
}  // namespace detail

Image resize_bicubic(const Image& image, int64_t height, int64_t width) {
  return detail::resize_with(image, height, width, detail::Filter::kBicubic, "resize_bicubic");
}

Image resize_bilinear(const Image& image, int64_t height, int64_t width) {
  return detail::resize_with(image, height, width, detail::Filter::kBilinear, "resize_bilinear");
}

std::pair<int64_t, int64_t> smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels,
                                         int64_t max_pixels) {
  using Limits = QwenImageProcessorLimits;
  // Bounded first, so that none of the products and float conversions below can overflow.
  VLMGEN_CHECK(factor >= 1 && factor <= Limits::kMaxFactor, "smart_resize: factor must be in [1, {}], got {}",
               Limits::kMaxFactor, factor);
  VLMGEN_CHECK(min_pixels >= 1 && min_pixels <= max_pixels,
               "smart_resize: need 1 <= min_pixels <= max_pixels, got min_pixels {} and max_pixels {}", min_pixels,
               max_pixels);
  VLMGEN_CHECK(max_pixels <= Limits::kMaxPixels, "smart_resize: max_pixels {} is above the limit of {}", max_pixels,
               Limits::kMaxPixels);
  VLMGEN_CHECK(height <= Limits::kMaxSide && width <= Limits::kMaxSide,
               "smart_resize: a {}x{} (height x width) image has a side above the limit of {}", height, width,
               Limits::kMaxSide);
  // Sides below `factor` are taken, as HF's processor takes them today: they round to 0, and
  // the enlarge branch below brings the area up to min_pixels (older HF versions refused them).
  VLMGEN_CHECK(height >= 1 && width >= 1, "smart_resize: height {} and width {} must both be positive", height, width);
  const double ratio = static_cast<double>(std::max(height, width)) / static_cast<double>(std::min(height, width));
  VLMGEN_CHECK(ratio <= 200.0, "smart_resize: the aspect ratio of a {}x{} (height x width) image is {:.1f}, above 200",
               height, width, ratio);
  int64_t h_bar = detail::round_half_even_div(height, factor) * factor;
  int64_t w_bar = detail::round_half_even_div(width, factor) * factor;
  // The float expressions mirror HF's Python so that borderline sizes land on the same side.
  if (h_bar * w_bar > max_pixels) {
    const double beta = std::sqrt(static_cast<double>(height * width) / static_cast<double>(max_pixels));
    h_bar = std::max(factor, static_cast<int64_t>(std::floor(static_cast<double>(height) / beta / factor)) * factor);
    w_bar = std::max(factor, static_cast<int64_t>(std::floor(static_cast<double>(width) / beta / factor)) * factor);
  } else if (h_bar * w_bar < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / static_cast<double>(height * width));
    h_bar = static_cast<int64_t>(std::ceil(static_cast<double>(height) * beta / factor)) * factor;
    w_bar = static_cast<int64_t>(std::ceil(static_cast<double>(width) * beta / factor)) * factor;
  }
  return {h_bar, w_bar};
}

void QwenImageProcessorOptions::validate() const {
  using Limits = QwenImageProcessorLimits;
  VLMGEN_CHECK(patch_size_ >= 1 && patch_size_ <= Limits::kMaxFactor,
               "QwenImageProcessorOptions: patch_size must be in [1, {}], got {}", Limits::kMaxFactor, patch_size_);
  VLMGEN_CHECK(temporal_patch_size_ >= 1 && temporal_patch_size_ <= Limits::kMaxTemporalPatchSize,
               "QwenImageProcessorOptions: temporal_patch_size must be in [1, {}], got {}",
               Limits::kMaxTemporalPatchSize, temporal_patch_size_);
  VLMGEN_CHECK(merge_size_ >= 1 && merge_size_ <= Limits::kMaxFactor,
               "QwenImageProcessorOptions: merge_size must be in [1, {}], got {}", Limits::kMaxFactor, merge_size_);
  VLMGEN_CHECK(patch_size_ * merge_size_ <= Limits::kMaxFactor,
               "QwenImageProcessorOptions: patch_size {} * merge_size {} must be at most {}", patch_size_, merge_size_,
               Limits::kMaxFactor);
  VLMGEN_CHECK(max_pixels_ <= Limits::kMaxPixels, "QwenImageProcessorOptions: max_pixels {} is above the limit of {}",
               max_pixels_, Limits::kMaxPixels);
  VLMGEN_CHECK(min_pixels_ >= 1 && min_pixels_ <= max_pixels_,
               "QwenImageProcessorOptions: need 1 <= min_pixels <= max_pixels, got min_pixels {} and max_pixels {}",
               min_pixels_, max_pixels_);
  for (int c = 0; c < 3; ++c) {
    VLMGEN_CHECK(std::isfinite(image_mean_[c]), "QwenImageProcessorOptions: image_mean[{}] must be finite, got {}", c,
                 image_mean_[c]);
    VLMGEN_CHECK(std::isfinite(image_std_[c]) && image_std_[c] != 0.0,
                 "QwenImageProcessorOptions: image_std[{}] must be finite and non-zero, got {}", c, image_std_[c]);
  }
  VLMGEN_CHECK(std::isfinite(rescale_), "QwenImageProcessorOptions: rescale must be finite, got {}", rescale_);
  detail::check_normalization(image_mean_, image_std_, rescale_, "QwenImageProcessorOptions");
}

VisionInputs preprocess(const std::vector<Image>& images, const QwenImageProcessorOptions& options) {
  options.validate();
  if (images.empty()) return VisionInputs();
  const int64_t patch = options.patch_size();
  const int64_t tp = options.temporal_patch_size();
  const int64_t merge = options.merge_size();
  // float32 like the HF processor's numpy arrays, so that the normalization rounds the same way.
  std::vector<float> mean(3);
  std::vector<float> std_dev(3);
  for (int c = 0; c < 3; ++c) {
    mean[c] = static_cast<float>(options.image_mean()[c]);
    std_dev[c] = static_cast<float>(options.image_std()[c]);
  }
  const at::Tensor mean_t = at::tensor(mean, at::kFloat).view({3, 1, 1});
  const at::Tensor std_t = at::tensor(std_dev, at::kFloat).view({3, 1, 1});

  std::vector<at::Tensor> rows;
  std::vector<int64_t> grid;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < images.size(); ++i) {
    const Image& image = images[i];
    const std::string what = fmt::format("preprocess: image {}", i);
    detail::check_image(image, what);
    std::pair<int64_t, int64_t> resized_hw;
    try {
      resized_hw =
          smart_resize(image.height, image.width, options.factor(), options.min_pixels(), options.max_pixels());
    } catch (const Error& e) {
      throw Error(fmt::format("{}: {}", what, e.what()));
    }
    const auto [height, width] = resized_hw;
    // Bounds the resampling and the pixel_values of this image, whatever the aspect ratio did.
    VLMGEN_CHECK(height * width <= QwenImageProcessorLimits::kMaxPixels &&
                     height * width * tp <= QwenImageProcessorLimits::kMaxPixelFrames,
                 "{}: resizes to {}x{} (height x width) x {} frames, above the limits of {} pixels and {} pixel-frames "
                 "(QwenImageProcessorLimits)",
                 what, height, width, tp, QwenImageProcessorLimits::kMaxPixels,
                 QwenImageProcessorLimits::kMaxPixelFrames);
    const Image resized = resize_bicubic(image, height, width);

    // [H, W, C] uint8 -> [C, H, W]; rescale in double then store float32, as HF's rescale does.
    at::Tensor pixels = at::from_blob(const_cast<uint8_t*>(resized.rgb.data()), {height, width, 3}, at::kByte)
                            .permute({2, 0, 1})
                            .to(at::kDouble)
                            .mul(options.rescale())
                            .to(at::kFloat);
    pixels = pixels.sub(mean_t).div(std_t);

    const int64_t grid_h = height / patch;
    const int64_t grid_w = width / patch;
    // A still image is a clip of temporal_patch_size identical frames, one temporal patch long.
    at::Tensor clip = pixels.unsqueeze(0).expand({tp, 3, height, width});
    at::Tensor patches = clip.reshape({1, tp, 3, grid_h / merge, merge, patch, grid_w / merge, merge, patch})
                             .permute({0, 3, 6, 4, 7, 2, 1, 5, 8})
                             .reshape({grid_h * grid_w, 3 * tp * patch * patch});
    rows.push_back(patches);
    grid.insert(grid.end(), {1, grid_h, grid_w});
    sizes.insert(sizes.end(), {image.height, image.width});
  }
  const auto n = static_cast<int64_t>(images.size());
  at::Tensor pixel_values = rows.size() == 1 ? rows[0].contiguous() : at::cat(rows, 0);
  at::Tensor image_grid_thw = at::tensor(grid, at::kLong).view({n, 3});
  at::Tensor image_sizes = at::tensor(sizes, at::kLong).view({n, 2});
  return VisionInputs::patch_flattened(std::move(pixel_values), std::move(image_grid_thw), std::move(image_sizes));
}

}  // namespace vlmgen
