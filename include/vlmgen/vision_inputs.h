#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <numeric>
#include <vector>

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

  static VisionInputs patch_flattened(at::Tensor pixel_values, at::Tensor image_grid_thw,
                                      at::Tensor image_sizes = {}) {
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
  bool empty() const {
    return !pixel_values.defined() && !image_grid_thw.defined() && !image_sizes.defined();
  }

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
    VLMGEN_CHECK(image_grid_thw.dim() == 2 && image_grid_thw.size(1) == 3,
                 "image_grid_thw must be [num_images, 3], got {}", detail::shape_str(image_grid_thw));
    VLMGEN_CHECK(detail::is_integral(image_grid_thw), "image_grid_thw must be an integer tensor, got {}",
                 c10::toString(image_grid_thw.scalar_type()));
    std::vector<int64_t> flat = detail::to_int64_vector(image_grid_thw);
    std::vector<std::array<int64_t, 3>> out(flat.size() / 3);
    for (size_t i = 0; i < out.size(); ++i) out[i] = {flat[3 * i], flat[3 * i + 1], flat[3 * i + 2]};
    return out;
  }

  /// Checks the bundle's tensors against each other. `spatial_merge_size` is the model's
  /// (patches merged per side into one LM token; 1 for none). Throws vlmgen::Error with the
  /// numbers on the first disagreement.
  void validate(int64_t spatial_merge_size) const {
    if (empty()) return;
    VLMGEN_CHECK(spatial_merge_size >= 1, "spatial_merge_size must be >= 1, got {}", spatial_merge_size);
    VLMGEN_CHECK(pixel_values.defined(), "the vision bundle has image_grid_thw/image_sizes but no pixel_values");
    VLMGEN_CHECK(at::isFloatingType(pixel_values.scalar_type()),
                 "pixel_values must be a floating-point tensor, got {}",
                 c10::toString(pixel_values.scalar_type()));
    const int64_t n = num_images();
    if (layout == VisionLayout::kPatchFlattened) {
      VLMGEN_CHECK(pixel_values.dim() == 2, "pixel_values must be [patches, patch_dim] for the patch-flattened layout, got {}",
                   detail::shape_str(pixel_values));
      auto g = grids();
      int64_t rows = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        const auto [t, h, w] = g[i];
        VLMGEN_CHECK(t >= 1 && h >= 1 && w >= 1, "image {}: grid (t, h, w) = ({}, {}, {}) must be positive", i, t, h, w);
        VLMGEN_CHECK(h % spatial_merge_size == 0 && w % spatial_merge_size == 0,
                     "image {}: grid (t, h, w) = ({}, {}, {}) is not divisible by spatial_merge_size {}",
                     i, t, h, w, spatial_merge_size);
        rows += t * h * w;
      }
      VLMGEN_CHECK(pixel_values.size(0) == rows,
                   "pixel_values has {} rows but image_grid_thw needs {} (sum of t*h*w over {} images)",
                   pixel_values.size(0), rows, n);
    } else {
      VLMGEN_CHECK(!image_grid_thw.defined() || image_grid_thw.size(0) == n,
                   "image_grid_thw has {} rows but pixel_values has {} images", image_grid_thw.size(0), n);
      VLMGEN_CHECK(pixel_values.dim() >= 2, "pixel_values must be [num_images, ...] for the per-image layout, got {}",
                   detail::shape_str(pixel_values));
    }
    if (image_sizes.defined()) {
      VLMGEN_CHECK(image_sizes.dim() == 2 && image_sizes.size(1) == 2,
                   "image_sizes must be [num_images, 2], got {}", detail::shape_str(image_sizes));
      VLMGEN_CHECK(image_sizes.size(0) == n, "image_sizes has {} rows but the bundle has {} images",
                   image_sizes.size(0), n);
    }
  }

  /// Placeholder tokens each image occupies in the token ids. kPatchFlattened: t*h*w / merge^2;
  /// kPerImage: `tokens_per_image` for every image (models whose count varies per image
  /// override CausalVlm::placeholder_counts instead).
  std::vector<int64_t> placeholder_counts(int64_t spatial_merge_size, int64_t tokens_per_image = 0) const {
    std::vector<int64_t> counts;
    if (empty()) return counts;
    if (layout == VisionLayout::kPatchFlattened) {
      for (const auto& [t, h, w] : grids()) counts.push_back(t * h * w / (spatial_merge_size * spatial_merge_size));
    } else {
      VLMGEN_CHECK(tokens_per_image > 0,
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

  /// One 64-bit fingerprint per image from its grid, size and pixels: equal pictures give equal
  /// fingerprints; a different picture gives a different one except with negligible chance.
  std::vector<uint64_t> fingerprints() const {
    std::vector<uint64_t> out;
    if (empty() || !pixel_values.defined()) return out;
    const int64_t n = num_images();
    std::vector<int64_t> offset(static_cast<size_t>(n) + 1, 0);
    std::vector<int64_t> grid = detail::to_int64_vector(image_grid_thw);
    std::vector<int64_t> sizes = detail::to_int64_vector(image_sizes);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t rows = layout == VisionLayout::kPatchFlattened ? grid[3 * i] * grid[3 * i + 1] * grid[3 * i + 2] : 1;
      offset[i + 1] = offset[i] + rows;
    }
    auto mix = [](uint64_t h, uint64_t v) {
      h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
      return h;
    };
    const at::Tensor flat = pixel_values.reshape({pixel_values.size(0), -1});
    for (int64_t i = 0; i < n; ++i) {
      at::Tensor values = flat.narrow(0, offset[i], offset[i + 1] - offset[i]).reshape({-1}).to(at::kDouble);
      // Two position-weighted sums (periods 8191 and 127) and a plain one: cheap, and a swap,
      // shift or edit of pixels changes at least one of them.
      at::Tensor index = at::arange(values.numel(), values.options());
      at::Tensor sums = at::stack({values.sum(), (values * (index.fmod(8191.0) + 1)).sum(),
                                   (values * (index.fmod(127.0) + 1)).sum()})
                            .to(at::kCPU);
      uint64_t h = 1469598103934665603ull;
      for (int64_t k = 0; k < 3; ++k) {
        const double v = sums[k].item<double>();
        uint64_t bits;
        std::memcpy(&bits, &v, sizeof bits);
        h = mix(h, bits);
      }
      for (int64_t k = 0; k < 3 && !grid.empty(); ++k) h = mix(h, static_cast<uint64_t>(grid[3 * i + k]));
      for (int64_t k = 0; k < 2 && !sizes.empty(); ++k) h = mix(h, static_cast<uint64_t>(sizes[2 * i + k]));
      out.push_back(h);
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
};

}  // namespace vlmgen
