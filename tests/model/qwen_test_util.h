#pragma once

// Helpers shared by the Qwen-VL model tests (single-process and tensor-parallel).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/load_options.h"
#include "vlmgen/models/qwen_vl.h"
#include "vlmgen/models/qwen_vl_config.h"
#include "vlmgen/testing/forward_spy.h"
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

// The device the device tests (device_test.cpp) put models and inputs on: VLMGEN_TEST_DEVICE,
// "cpu" when unset; "cuda" or "cuda:N" on a GPU machine (scripts/gpu-check.sh). A device this
// process cannot use fails the test with parse_device's error; it is never skipped.
inline at::Device test_device() {
  const char* name = std::getenv("VLMGEN_TEST_DEVICE");
  return parse_device(name == nullptr || *name == '\0' ? "cpu" : name);
}

inline void report(const char* what, double value) { std::printf("[ measured ] %s: %.3g\n", what, value); }

// Left-padded batches, full forwards, hash-derived weights and generator requests.
// Left-padded [B, L] ids and mask of `rows`.
struct Batch {
  at::Tensor ids;   // [B, L], int64
  at::Tensor mask;  // [B, L], int64
  std::vector<int64_t> pads;
};

inline Batch left_pad(const std::vector<std::vector<int64_t>>& rows) {
  int64_t len = 0;
  for (const auto& r : rows) len = std::max<int64_t>(len, static_cast<int64_t>(r.size()));
  const auto b = static_cast<int64_t>(rows.size());
  Batch out{at::zeros({b, len}, at::kLong), at::zeros({b, len}, at::kLong), {}};
  for (int64_t i = 0; i < b; ++i) {
    const auto n = static_cast<int64_t>(rows[i].size());
    out.pads.push_back(len - n);
    out.ids[i].narrow(0, len - n, n).copy_(at::tensor(rows[i], at::kLong));
    out.mask[i].narrow(0, len - n, n).fill_(1);
  }
  return out;
}

// Full no-cache forward over a left-padded batch: [B, L, vocab].
inline at::Tensor full_forward(CausalVlm& model, const Batch& batch, const VisionInputs& vision) {
  ForwardArgs args;
  args.input_ids = batch.ids;
  args.attention_mask = batch.mask;
  args.position_ids = model.plan_positions(batch.ids, batch.mask, vision).prompt_positions;
  args.vision = vision;
  return model.forward(args);
}

inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a.to(at::kCPU) - b.to(at::kCPU)).abs().max().item<double>();
}

// uniform in [-amp, amp), a deterministic hash of (i, k); identical in double on every libm
// Max |a - expected| for golden numbers.
inline double max_abs_diff_to(const at::Tensor& a, const std::vector<double>& expected) {
  return max_abs_diff(a.to(at::kDouble), at::tensor(expected, at::kDouble));
}

inline std::vector<double> hashed(int64_t n, int64_t k, double amp) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const double h = std::sin((i + 1) * 12.9898 + (k + 1) * 78.233) * 43758.5453;
    out[i] = (h - std::floor(h) - 0.5) * 2 * amp;
  }
  return out;
}

inline at::Tensor hashed_tensor(int64_t n, int64_t k, double amp, double offset = 0.0) {
  std::vector<double> v = hashed(n, k, amp);
  for (double& x : v) x += offset;
  return at::tensor(v, at::kDouble).to(at::kFloat);
}

inline int64_t name_key(const std::string& name) {
  int64_t key = 0;
  for (size_t j = 0; j < name.size(); ++j) key += static_cast<int64_t>(j + 1) * static_cast<unsigned char>(name[j]);
  return key % 9973;
}

inline void fill_hashed_weights(QwenVl& model) {
  for (const auto& [weight_name, t] : model.named_weights()) {
    const std::string& name = weight_name;  // a lambda may not capture a structured binding in C++17 (clang)
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    // As the PyTorch references do: norm weights 1 + U(-0.2, 0.2), Qwen3-VL's position table
    // U(-0.5, 0.5), everything else U(-0.1, 0.1).
    const bool norm = ends_with("norm1.weight") || ends_with("norm2.weight") || ends_with("ln_q.weight") ||
                      ends_with("norm.weight") || ends_with("layernorm.weight");
    const double amp = norm ? 0.2 : ends_with("pos_embed.weight") ? 0.5 : 0.1;
    *t = hashed_tensor(t->numel(), name_key(name), amp, norm ? 1.0 : 0.0).view(t->sizes());
  }
}

inline GenerateRequest make_request(const std::vector<std::vector<int64_t>>& prompts, const VisionInputs& vision,
                                    InferenceContext* context = nullptr) {
  GenerateRequest request;
  request.prompts = prompts;
  request.vision = vision;
  request.context = context;
  return request;
}

// The prompt's logits at steps 0..7 of a no-cache generation; returns max|diff| from step 0.
inline double prompt_logit_drift(CausalVlm& model, const std::vector<std::vector<int64_t>>& prompts,
                                 const VisionInputs& vision, ReplayMode mode, double* argmax_agreement = nullptr) {
  testing::ForwardSpy spy(model);
  spy.record_tensors(true);
  Generator(spy).generate(
      make_request(prompts, vision),
      GenerationConfig().max_new_tokens(8).enable_kv_cache(false).replay_mode(mode).full_logits(true));
  EXPECT_EQ(spy.calls().size(), 8u);
  const at::Tensor& step0 = spy.calls().front().logits;
  const int64_t prompt_len = step0.size(1);
  // Padding query rows are garbage by design; compare real columns only.
  at::Tensor real = left_pad(prompts).mask.to(at::kBool);
  const at::Tensor argmax0 = step0.argmax(-1).masked_select(real);
  double worst = 0.0;
  if (argmax_agreement != nullptr) *argmax_agreement = 1.0;
  for (const auto& call : spy.calls()) {
    at::Tensor prefix = call.logits.narrow(1, 0, prompt_len);
    worst = std::max(
        worst, max_abs_diff(prefix.masked_fill(~real.unsqueeze(-1), 0), step0.masked_fill(~real.unsqueeze(-1), 0)));
    if (argmax_agreement != nullptr) {
      const double agree = prefix.argmax(-1).masked_select(real).eq(argmax0).to(at::kDouble).mean().item<double>();
      *argmax_agreement = std::min(*argmax_agreement, agree);
    }
  }
  return worst;
}

// A temporary folder for checkpoints, removed with the object.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = ::testing::TempDir() + "vlmgen_checkpoints_XXXXXX";
    VLMGEN_CHECK(::mkdtemp(pattern.data()) != nullptr, "mkdtemp {} failed", pattern);
    root_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(root_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string dir(const std::string& name) const { return (std::filesystem::path(root_) / name).string(); }

 private:
  std::string root_;
};

// The tensors of a saved checkpoint, by name.
inline std::map<std::string, at::Tensor> read_all_tensors(const std::string& dir) {
  SafetensorsCheckpoint ckpt(dir);
  std::map<std::string, at::Tensor> out;
  for (const auto& n : ckpt.names()) out.emplace(n, ckpt.tensor(n));
  return out;
}

// A checkpoint folder with this config.json text and these tensors.
inline void write_checkpoint_dir(const std::string& dir, const std::string& config_json,
                                 const std::map<std::string, at::Tensor>& tensors) {
  std::filesystem::create_directories(dir);
  std::FILE* f = std::fopen((dir + "/config.json").c_str(), "wb");
  VLMGEN_CHECK(f != nullptr, "cannot write {}/config.json", dir);
  std::fwrite(config_json.data(), 1, config_json.size(), f);
  std::fclose(f);
  save_safetensors(dir + "/model.safetensors", tensors);
}

}  // namespace vlmgen::qwen_test
