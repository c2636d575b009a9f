#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <vector>

#include "vlmgen/content_hash.h"
#include "vlmgen/detail/checked_math.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"

namespace vlmgen {

/// How `pixel_values` is laid out.
enum class VisionLayout {
  /// Qwen-VL: all images' patches flattened into rows, [sum_i t_i*h_i*w_i, patch_dim];
  /// `image_grid_thw` is required and says which rows belong to which image.
  kPatchFlattened,
  /// LLaVA-style: one leading entry per image, [num_images, ...].
  kPerImage,
};

/// The vision tensors of one request, images numbered in order of appearance: row 0's images
/// left to right, then row 1's, and so on. Every tensor is optional; an empty bundle means
/// "no images".
///
///   auto vision = vlmgen::VisionInputs::patch_flattened(pixels, grid);
///   vision.validate(/*spatial_merge_size=*/2);
///   auto second = vision.select({1});   // pixel rows, grid row and size row of image 1
struct VisionInputs {
  /// kPatchFlattened: [sum_i t_i*h_i*w_i, patch_dim]; kPerImage: [num_images, ...]. Any float
  /// dtype, on the model's device.
  at::Tensor pixel_values;
  /// [num_images, 3], integer, (t, h, w) in patches before the spatial merge.
  at::Tensor image_grid_thw;
  /// [num_images, 2], integer, (height, width) of each image in pixels.
  at::Tensor image_sizes;
  VisionLayout layout = VisionLayout::kPatchFlattened;

  static VisionInputs patch_flattened(at::Tensor pixel_values, at::Tensor image_grid_thw, at::Tensor image_sizes = {}) {
    VisionInputs v;
    v.pixel_values = std::move(pixel_values);
    v.image_grid_thw = std::move(image_grid_thw);
    v.image_sizes = std::move(image_sizes);
    v.layout = VisionLayout::kPatchFlattened;
    return v;
  }

  static VisionInputs per_image(at::Tensor pixel_values, at::Tensor image_sizes = {}) {
    VisionInputs v;
    v.pixel_values = std::move(pixel_values);
    v.image_sizes = std::move(image_sizes);
    v.layout = VisionLayout::kPerImage;
    return v;
  }

  /// True when no vision tensor is set.
  bool empty() const { return !pixel_values.defined() && !image_grid_thw.defined() && !image_sizes.defined(); }

  /// Number of images in the bundle (0 when empty). Does not validate.
  int64_t num_images() const {
    if (layout == VisionLayout::kPatchFlattened) {
      if (image_grid_thw.defined()) return image_grid_thw.dim() > 0 ? image_grid_thw.size(0) : 0;
      return image_sizes.defined() && image_sizes.dim() > 0 ? image_sizes.size(0) : 0;
    }
    if (pixel_values.defined()) return pixel_values.dim() > 0 ? pixel_values.size(0) : 0;
    return image_sizes.defined() && image_sizes.dim() > 0 ? image_sizes.size(0) : 0;
  }

  /// (t, h, w) of every image, read once to the host. Requires kPatchFlattened and a grid.
  std::vector<std::array<int64_t, 3>> grids() const {
    VLMGEN_CHECK(image_grid_thw.defined(), "image_grid_thw is required for the patch-flattened layout");
    check_grid_shape();
    std::vector<int64_t> flat = detail::to_int64_vector(image_grid_thw);
    std::vector<std::array<int64_t, 3>> out(flat.size() / 3);
    for (size_t i = 0; i < out.size(); ++i) out[i] = {flat[3 * i], flat[3 * i + 1], flat[3 * i + 2]};
    return out;
  }

  /// Largest spatial merge size validate() accepts (merge^2 must not overflow a count).
  static constexpr int64_t kMaxSpatialMergeSize = 64;

  /// Checks the bundle's tensors against each other. `spatial_merge_size` is the model's
  /// (patches merged per side into one LM token; 1 for none). Throws vlmgen::Error with the
  /// numbers on the first disagreement. Every count derived from the grid is overflow-checked.
  /// Does not read pixel values: check_finite() does.
  void validate(int64_t spatial_merge_size) const {
    if (empty()) return;
    VLMGEN_CHECK(spatial_merge_size >= 1 && spatial_merge_size <= kMaxSpatialMergeSize,
                 "spatial_merge_size must be in [1, {}], got {}", kMaxSpatialMergeSize, spatial_merge_size);
    VLMGEN_CHECK(pixel_values.defined(), "the vision bundle has image_grid_thw/image_sizes but no pixel_values");
    VLMGEN_CHECK(at::isFloatingType(pixel_values.scalar_type()), "pixel_values must be a floating-point tensor, got {}",
                 c10::toString(pixel_values.scalar_type()));
    const int64_t n = num_images();
    if (layout == VisionLayout::kPatchFlattened) {
      VLMGEN_CHECK(pixel_values.dim() == 2,
                   "pixel_values must be [patches, patch_dim] for the patch-flattened layout, got {}",
                   detail::shape_str(pixel_values));
      auto g = grids();
      int64_t rows = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        const auto [t, h, w] = g[i];
        VLMGEN_CHECK(t >= 1 && h >= 1 && w >= 1, "image {}: grid (t, h, w) = ({}, {}, {}) must be positive", i, t, h,
                     w);
        VLMGEN_CHECK(h % spatial_merge_size == 0 && w % spatial_merge_size == 0,
                     "image {}: grid (t, h, w) = ({}, {}, {}) is not divisible by spatial_merge_size {}", i, t, h, w,
                     spatial_merge_size);
        rows = detail::checked_add(rows, patch_rows(g[i]), "image_grid_thw: total patch rows");
      }
      VLMGEN_CHECK(pixel_values.size(0) == rows,
                   "pixel_values has {} rows but image_grid_thw needs {} (sum of t*h*w over {} images)",
                   pixel_values.size(0), rows, n);
    } else {
      VLMGEN_CHECK(pixel_values.dim() >= 2, "pixel_values must be [num_images, ...] for the per-image layout, got {}",
                   detail::shape_str(pixel_values));
      if (image_grid_thw.defined()) {
        check_grid_shape();
        VLMGEN_CHECK(image_grid_thw.size(0) == n, "image_grid_thw has {} rows but pixel_values has {} images",
                     image_grid_thw.size(0), n);
      }
    }
    if (image_sizes.defined()) {
      VLMGEN_CHECK(image_sizes.dim() == 2 && image_sizes.size(1) == 2, "image_sizes must be [num_images, 2], got {}",
                   detail::shape_str(image_sizes));
      VLMGEN_CHECK(detail::is_integral(image_sizes), "image_sizes must be an integer tensor, got {}",
                   c10::toString(image_sizes.scalar_type()));
      VLMGEN_CHECK(image_sizes.size(0) == n, "image_sizes has {} rows but the bundle has {} images",
                   image_sizes.size(0), n);
      const std::vector<int64_t> sizes = detail::to_int64_vector(image_sizes);
      for (size_t i = 0; i < sizes.size(); i += 2) {
        VLMGEN_CHECK(sizes[i] >= 1 && sizes[i + 1] >= 1,
                     "image {}: image_sizes (height, width) = ({}, {}) must be positive", i / 2, sizes[i],
                     sizes[i + 1]);
      }
    }
  }

  /// Throws vlmgen::Error when pixel_values holds a NaN or an infinity (a model fed one
  /// produces NaN logits or, worse, plausible text about nothing). One min/max reduction over
  /// the tensor, no copy.
  void check_finite() const {
    if (!pixel_values.defined() || pixel_values.numel() == 0) return;
    auto [lo, hi] = at::aminmax(pixel_values);
    const double min = lo.item<double>(), max = hi.item<double>();
    VLMGEN_CHECK(std::isfinite(min) && std::isfinite(max),
                 "pixel_values must be finite, got min {} and max {} (NaN or infinity); check the image decoding "
                 "and normalization, or turn GenerationConfig::check_pixel_values off if you check yourself",
                 min, max);
  }

  /// Placeholder tokens each image occupies in the token ids. kPatchFlattened: t*h*w / merge^2;
  /// kPerImage: `tokens_per_image` for every image (models whose count varies per image
  /// override CausalVlm::placeholder_counts instead).
  std::vector<int64_t> placeholder_counts(int64_t spatial_merge_size, int64_t tokens_per_image = 0) const {
    std::vector<int64_t> counts;
    if (empty()) return counts;
    if (layout == VisionLayout::kPatchFlattened) {
      VLMGEN_CHECK(spatial_merge_size >= 1 && spatial_merge_size <= kMaxSpatialMergeSize,
                   "spatial_merge_size must be in [1, {}], got {}", kMaxSpatialMergeSize, spatial_merge_size);
      for (const auto& g : grids()) counts.push_back(patch_rows(g) / (spatial_merge_size * spatial_merge_size));
    } else {
      VLMGEN_CHECK(
          tokens_per_image > 0,
          "per-image vision layout needs a placeholder count per image from the model (tokens_per_image), got {}",
          tokens_per_image);
      counts.assign(static_cast<size_t>(num_images()), tokens_per_image);
    }
    return counts;
  }

  /// The bundle restricted to `images` (ascending indices into this bundle): pixel rows, grid
  /// rows and size rows stay consistent. An empty list gives an empty bundle.
  VisionInputs select(const std::vector<int64_t>& images) const {
    VisionInputs out;
    out.layout = layout;
    if (images.empty() || empty()) return out;
    const int64_t n = num_images();
    for (size_t i = 0; i < images.size(); ++i) {
      VLMGEN_CHECK(images[i] >= 0 && images[i] < n, "image index {} is out of range for a bundle of {} images",
                   images[i], n);
      VLMGEN_CHECK(i == 0 || images[i] > images[i - 1], "image indices must be ascending and unique, got [{}]",
                   fmt::join(images, ", "));
    }
    if (static_cast<int64_t>(images.size()) == n) return *this;
    auto index_on = [&](const at::Tensor& like) {
      return at::tensor(images, at::TensorOptions().dtype(at::kLong)).to(like.device());
    };
    if (layout == VisionLayout::kPatchFlattened) {
      if (pixel_values.defined() && image_grid_thw.defined()) {
        auto g = grids();
        std::vector<int64_t> offset(g.size() + 1, 0);
        for (size_t i = 0; i < g.size(); ++i) offset[i + 1] = offset[i] + g[i][0] * g[i][1] * g[i][2];
        std::vector<at::Tensor> parts;
        for (int64_t i : images) parts.push_back(pixel_values.narrow(0, offset[i], offset[i + 1] - offset[i]));
        out.pixel_values = parts.size() == 1 ? parts[0] : at::cat(parts, 0);
      }
    } else if (pixel_values.defined()) {
      out.pixel_values = pixel_values.index_select(0, index_on(pixel_values));
    }
    if (image_grid_thw.defined()) out.image_grid_thw = image_grid_thw.index_select(0, index_on(image_grid_thw));
    if (image_sizes.defined()) out.image_sizes = image_sizes.index_select(0, index_on(image_sizes));
    return out;
  }

  /// One SHA-256 per image over its pixels (bytes, shape, dtype), grid row and size row: the
  /// identity a continuation or a prefix-cache hit is checked against. Call on a validated
  /// bundle (vlmgen::Error otherwise, never a crash).
  std::vector<ContentHash> fingerprints() const {
    std::vector<ContentHash> out;
    if (empty() || !pixel_values.defined()) return out;
    const int64_t n = num_images();
    std::vector<int64_t> offset(static_cast<size_t>(n) + 1, 0);
    if (layout == VisionLayout::kPatchFlattened) {
      const auto g = grids();
      for (int64_t i = 0; i < n; ++i) offset[i + 1] = detail::checked_add(offset[i], patch_rows(g[i]), "fingerprints");
    } else {
      for (int64_t i = 0; i < n; ++i) offset[i + 1] = i + 1;
    }
    VLMGEN_CHECK(pixel_values.dim() >= 1 && pixel_values.size(0) == offset[n],
                 "fingerprints: pixel_values {} does not hold the {} rows the bundle's {} images need",
                 detail::shape_str(pixel_values), offset[n], n);
    for (int64_t i = 0; i < n; ++i) {
      Sha256 sha;
      sha.update_int(static_cast<int64_t>(layout));
      hash_tensor(sha, pixel_values.narrow(0, offset[i], offset[i + 1] - offset[i]));
      hash_tensor(sha, image_grid_thw.defined() ? image_grid_thw.narrow(0, i, 1) : at::Tensor());
      hash_tensor(sha, image_sizes.defined() && image_sizes.dim() == 2 ? image_sizes.narrow(0, i, 1) : at::Tensor());
      out.push_back(sha.finish());
    }
    return out;
  }

  /// All tensors moved to `device` (pixel_values also to `dtype` when given).
  VisionInputs to(at::Device device, std::optional<at::ScalarType> dtype = std::nullopt) const {
    VisionInputs out = *this;
    if (pixel_values.defined()) {
      out.pixel_values = dtype ? pixel_values.to(device, *dtype) : pixel_values.to(device);
    }
    if (image_grid_thw.defined()) out.image_grid_thw = image_grid_thw.to(device);
    if (image_sizes.defined()) out.image_sizes = image_sizes.to(device);
    return out;
  }

 private:
  void check_grid_shape() const {
    VLMGEN_CHECK(image_grid_thw.dim() == 2 && image_grid_thw.size(1) == 3,
                 "image_grid_thw must be [num_images, 3], got {}", detail::shape_str(image_grid_thw));
    VLMGEN_CHECK(detail::is_integral(image_grid_thw), "image_grid_thw must be an integer tensor, got {}",
                 c10::toString(image_grid_thw.scalar_type()));
  }
  static int64_t patch_rows(const std::array<int64_t, 3>& g) {
    return detail::checked_mul(detail::checked_mul(g[0], g[1], "image_grid_thw t*h"), g[2], "image_grid_thw t*h*w");
  }
};

}  // namespace vlmgen
