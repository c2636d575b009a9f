#pragma once

// The Gemma-3 tests' model and inputs: the tiny model with the reference script's hashed weights,
// images with its pixels, placeholder runs.

#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "qwen_test_util.h"
#include "vlmgen/models/gemma3.h"

namespace vlmgen::gemma3_test {

using qwen_test::hashed_tensor;
using qwen_test::name_key;

constexpr int64_t kImage = 90, kBoi = 88, kEoi = 89;

inline std::vector<int64_t> image() { return {kBoi, kImage, kImage, kImage, kImage, kEoi}; }

inline std::vector<int64_t> concat(std::initializer_list<std::vector<int64_t>> parts) {
  std::vector<int64_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

inline bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// As the reference script fills them: SigLIP LayerNorm weights 1 + U(-0.2, 0.2), Gemma RMSNorm
// weights U(-0.2, 0.2) (used as 1 + w), position embeddings U(-0.5, 0.5), the rest U(-0.1, 0.1).
inline void fill_hashed_weights(Gemma3& model) {
  for (const auto& [weight_name, t] : model.named_weights()) {
    const std::string& name = weight_name;
    bool layer_norm = false, gemma_norm = false;
    for (const char* s : {"layer_norm1.weight", "layer_norm2.weight", "vision_model.post_layernorm.weight"})
      layer_norm = layer_norm || ends_with(name, s);
    for (const char* s : {"input_layernorm.weight", "post_attention_layernorm.weight",
                          "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight", "q_norm.weight",
                          "k_norm.weight", "language_model.norm.weight", "mm_soft_emb_norm.weight"})
      gemma_norm = gemma_norm || ends_with(name, s);
    const double amp = layer_norm || gemma_norm ? 0.2 : ends_with(name, "position_embedding.weight") ? 0.5 : 0.1;
    *t = hashed_tensor(t->numel(), name_key(name), amp, layer_norm ? 1.0 : 0.0).view(t->sizes());
  }
}

// Images with the reference's pixels: hashed(3 * 16 * 16, key, 1.0).
inline VisionInputs hashed_images(const std::vector<int64_t>& keys) {
  std::vector<at::Tensor> pixels;
  for (int64_t k : keys) pixels.push_back(hashed_tensor(3 * 16 * 16, k, 1.0).view({3, 16, 16}));
  return VisionInputs::per_image(at::stack(pixels));
}

inline std::unique_ptr<Gemma3> hashed_model(const Gemma3Config& config = Gemma3Config::tiny()) {
  auto model = std::make_unique<Gemma3>(config, 0);
  fill_hashed_weights(*model);
  return model;
}

}  // namespace vlmgen::gemma3_test
