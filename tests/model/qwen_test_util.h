#pragma once

// Helpers shared by the Qwen2-VL model tests (single-process and tensor-parallel).

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/models/qwen_vl_config.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen::qwen_test {

constexpr int64_t kImage = 90;  // QwenVlConfig::tiny()'s image placeholder
constexpr int64_t kVisionStart = 88;
constexpr int64_t kVisionEnd = 89;

// QwenVlConfig::tiny() with a smaller MLP, 2-pixel patches and a shorter context, so every
// dimension differs from the others and a transposed weight cannot go unnoticed. The vision
// tower's heads are a parameter (2 divides TP=2, 1 does not).
inline QwenVlConfig test_config(int64_t vision_heads = 2) {
  QwenVlConfig c = QwenVlConfig::tiny();
  c.intermediate_size = 96;
  c.max_position_embeddings = 512;
  c.vision.patch_size = 2;
  c.vision.num_heads = vision_heads;
  return c;
}

inline int64_t patch_dim(const QwenVlConfig& c) {
  return c.vision.in_channels * c.vision.temporal_patch_size * c.vision.patch_size * c.vision.patch_size;
}

// Random patch-flattened pixels for images of the given (t, h, w) grids.
inline VisionInputs make_vision(const QwenVlConfig& c, const std::vector<std::array<int64_t, 3>>& grids,
                                uint64_t seed) {
  at::Generator gen = detail::make_cpu_generator(seed);
  int64_t rows = 0;
  std::vector<int64_t> flat;
  for (const auto& g : grids) {
    rows += g[0] * g[1] * g[2];
    flat.insert(flat.end(), g.begin(), g.end());
  }
  at::Tensor pixels = at::randn({rows, patch_dim(c)}, gen, at::kFloat);
  return VisionInputs::patch_flattened(pixels,
                                       at::tensor(flat, at::kLong).reshape({static_cast<int64_t>(grids.size()), 3}));
}

// text, <vision_start>, `count` placeholders, <vision_end>, text
inline std::vector<int64_t> image_prompt(std::vector<int64_t> before, int64_t count,
                                         const std::vector<int64_t>& after) {
  before.push_back(kVisionStart);
  before.insert(before.end(), static_cast<size_t>(count), kImage);
  before.push_back(kVisionEnd);
  before.insert(before.end(), after.begin(), after.end());
  return before;
}

inline void report(const char* what, double value) { std::printf("[ measured ] %s: %.3g\n", what, value); }

}  // namespace vlmgen::qwen_test
