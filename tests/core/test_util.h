#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <vector>

#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen::test {

/// Patch-flattened pixels for images with the given (t, h, w) grids: random rows of width 12,
/// different for every `seed`, plus the grid and (height, width) = 14 * (h, w).
inline VisionInputs make_images(const std::vector<std::array<int64_t, 3>>& grids, uint64_t seed = 1) {
  at::Generator gen = detail::make_cpu_generator(seed);
  int64_t rows = 0;
  std::vector<int64_t> flat_grid, sizes;
  for (const auto& g : grids) {
    rows += g[0] * g[1] * g[2];
    flat_grid.insert(flat_grid.end(), g.begin(), g.end());
    sizes.push_back(14 * g[1]);
    sizes.push_back(14 * g[2]);
  }
  at::Tensor pixels = at::rand({rows, 12}, gen, at::kFloat);
  const auto n = static_cast<int64_t>(grids.size());
  return VisionInputs::patch_flattened(pixels, at::tensor(flat_grid, at::kLong).reshape({n, 3}),
                                       at::tensor(sizes, at::kLong).reshape({n, 2}));
}

/// text tokens, then `count` placeholders, then more text.
inline std::vector<int64_t> prompt_with_image(std::vector<int64_t> before, int64_t image_token, int64_t count,
                                              const std::vector<int64_t>& after) {
  before.insert(before.end(), static_cast<size_t>(count), image_token);
  before.insert(before.end(), after.begin(), after.end());
  return before;
}

}  // namespace vlmgen::test
