#pragma once

// The Qwen2.5-VL and Qwen3-VL tests' cases and fixture (qwen_families_test.cpp,
// qwen_families_checkpoint_test.cpp): the reference script's prompts and images, the golden
// numbers of a family, and the tiny model of that family with hash-derived weights.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <vector>

#include "qwen_test_util.h"
#include "vlmgen/models/qwen_vl.h"
#include "vlmgen/models/qwen_vl_config.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen::qwen_families_test {

using qwen_test::Batch;
using qwen_test::fill_hashed_weights;
using qwen_test::full_forward;
using qwen_test::hashed_tensor;
using qwen_test::kImage;
using qwen_test::kVisionEnd;
using qwen_test::kVisionStart;
using qwen_test::left_pad;
using qwen_test::max_abs_diff_to;
using qwen_test::patch_dim;

using Grid = std::array<int64_t, 3>;

// The reference script's cases (its image(), pixels_for() and prompts).
inline std::vector<int64_t> image(const Grid& g) {
  std::vector<int64_t> out = {kVisionStart};
  out.insert(out.end(), static_cast<size_t>(g[0] * g[1] * g[2] / 4), kImage);
  out.push_back(kVisionEnd);
  return out;
}

inline std::vector<int64_t> concat(std::initializer_list<std::vector<int64_t>> parts) {
  std::vector<int64_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

inline VisionInputs hashed_vision(const QwenVlConfig& c, const std::vector<Grid>& grids,
                                  const std::vector<int64_t>& keys) {
  std::vector<at::Tensor> pixels;
  std::vector<int64_t> flat;
  for (size_t i = 0; i < grids.size(); ++i) {
    const int64_t n = grids[i][0] * grids[i][1] * grids[i][2];
    pixels.push_back(hashed_tensor(n * patch_dim(c), keys[i], 1.0).view({n, patch_dim(c)}));
    flat.insert(flat.end(), grids[i].begin(), grids[i].end());
  }
  return VisionInputs::patch_flattened(at::cat(pixels, 0),
                                       at::tensor(flat, at::kLong).view({static_cast<int64_t>(grids.size()), 3}));
}

inline const Grid kGridA = {1, 4, 4};  // 2x2 merged tokens: one window
inline const Grid kGridB = {1, 6, 8};  // 3x4 merged tokens: 2x2 windows, partial last row
inline const Grid kGridC = {2, 4, 6};  // two frames of 2x3 merged tokens: partial last column
inline const Grid kGridD = {1, 8, 4};  // 4x2 merged tokens; 8x4 patches against a 4x4 position table

struct Golden {
  const char* name;
  QwenFamily family;
  const std::vector<double>& text;
  const std::vector<double>& batch_embedding;
  const std::vector<double>& batch_deepstack0;
  const std::vector<double>& batch_deepstack1;
  const std::vector<double>& batch_row0;
  const std::vector<double>& batch_row1;
  const std::vector<double>& turns_embedding;
  const std::vector<double>& turns_deepstack0;
  const std::vector<double>& turns_deepstack1;
  const std::vector<double>& turns_row0;
};

inline void PrintTo(const Golden& g, std::ostream* os) { *os << g.name; }

#define VLMGEN_GOLDEN(ns, family)                                                                                \
  Golden {                                                                                                       \
#ns, family, ns::kTextRow0, ns::kBatchEmbedding, ns::kBatchDeepStack0, ns::kBatchDeepStack1, ns::kBatchRow0, \
        ns::kBatchRow1, ns::kTurnsEmbedding, ns::kTurnsDeepStack0, ns::kTurnsDeepStack1, ns::kTurnsRow0          \
  }

class QwenFamilyTest : public ::testing::TestWithParam<Golden> {
 protected:
  QwenFamilyTest() : config_(QwenVlConfig::tiny(GetParam().family)), model_(config_, 0) { fill_hashed_weights(model_); }

  at::Tensor u_hidden() const { return hashed_tensor(config_.hidden_size, 4343, 1.0).to(at::kDouble); }
  at::Tensor u_vocab() const { return hashed_tensor(config_.vocab_size, 4242, 1.0).to(at::kDouble); }
  // Logits [B, L, V] projected on u_vocab: [B, L].
  at::Tensor project(const at::Tensor& logits) const { return at::matmul(logits.to(at::kDouble), u_vocab()); }

  std::vector<std::vector<int64_t>> batch_rows() const {
    return {concat({{1, 2}, image(kGridA), {3, 4}, image(kGridB), {5}}), concat({{6}, image(kGridC), {7, 8}})};
  }
  VisionInputs batch_vision() const { return hashed_vision(config_, {kGridA, kGridB, kGridC}, {1001, 1002, 1003}); }
  std::vector<int64_t> turn1() const { return concat({{9, 10}, image(kGridA), {11, 12, 13}}); }
  std::vector<int64_t> turns_row() const { return concat({turn1(), {14, 15}, image(kGridD), {16, 17}}); }
  VisionInputs turns_vision() const { return hashed_vision(config_, {kGridA, kGridD}, {1001, 1004}); }

  // Max |diff| of the batch case's logit projections against the golden rows.
  double batch_logit_error(QwenVl& model) {
    Batch batch = left_pad(batch_rows());
    at::Tensor p = project(full_forward(model, batch, batch_vision()));
    const int64_t n0 = static_cast<int64_t>(batch_rows()[0].size());
    const int64_t n1 = static_cast<int64_t>(batch_rows()[1].size());
    return std::max(max_abs_diff_to(p[0].narrow(0, batch.pads[0], n0), GetParam().batch_row0),
                    max_abs_diff_to(p[1].narrow(0, batch.pads[1], n1), GetParam().batch_row1));
  }

  QwenVlConfig config_;
  QwenVl model_;
};

}  // namespace vlmgen::qwen_families_test
