// FP8 checkpoints of the three Qwen-VL families in every checkpoint format: each loads as the F32
// model of its dequantized weights (as F32, as bytes, as bfloat16); the quantizer's scales and
// rounding; a quantized output head; bad FP8 checkpoints.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "fp8_test_util.h"
#include "qwen_test_util.h"
#include "vlmgen/generator.h"
#include "vlmgen/io/fp8.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/models/quantization.h"
#include "vlmgen/models/qwen_vl.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT
using fp8_test::e4m3_definition;
using ::testing::HasSubstr;

// ---- checkpoints of the three families --------------------------------------------------------

bool is_lm_linear(const std::string& name, const at::Tensor& t) {
  return t.dim() == 2 && name.find("visual") == std::string::npos && name.find(".layers.") != std::string::npos &&
         name.size() > 12 && name.compare(name.size() - 12, 12, "_proj.weight") == 0;
}

std::string json_with(const std::string& config_json, const std::string& quantization_config) {
  const size_t close = config_json.rfind('}');
  return config_json.substr(0, close) + ", \"quantization_config\": " + quantization_config + "}";
}

void write_json(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// The F32 weight the test computes itself from an FP8 tensor: the format definition's value of
// each byte times the scale that covers it (the loop spells out which scale that is).
at::Tensor dequantize_by_definition(const at::Tensor& bytes, const at::Tensor& scale, ScaleGranularity g,
                                    std::array<int64_t, 2> block) {
  const at::Tensor b = bytes.contiguous();
  const at::Tensor s = scale.to(at::kFloat).contiguous().reshape({-1});
  const int64_t rows = b.size(0), cols = b.size(1);
  const int64_t grid_cols = (cols + block[1] - 1) / block[1];
  at::Tensor out = at::empty({rows, cols}, at::kFloat);
  auto in = b.accessor<uint8_t, 2>();
  auto o = out.accessor<float, 2>();
  auto sa = s.accessor<float, 1>();
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      float k = 0.0f;
      switch (g) {
        case ScaleGranularity::kPerTensor: k = sa[0]; break;
        case ScaleGranularity::kPerChannel: k = sa[i]; break;
        case ScaleGranularity::kPerBlock: k = sa[(i / block[0]) * grid_cols + j / block[1]]; break;
      }
      o[i][j] = static_cast<float>(e4m3_definition(in[i][j])) * k;
    }
  }
  return out;
}

struct Variant {
  const char* name;
  QuantFormat format;
  ScaleGranularity granularity;
  std::array<int64_t, 2> block;
  std::string quantization_config;  // empty: written by quantize_checkpoint
  const char* scale_suffix;
};

class Fp8CheckpointTest : public ::testing::TestWithParam<QwenFamily> {
 protected:
  Fp8CheckpointTest() : config_(QwenVlConfig::tiny(GetParam())), model_(config_, 7) {
    model_.save_checkpoint(dir("f32"));
  }

  std::string dir(const std::string& name) const { return scratch_.dir(name); }

  // Writes the F32 checkpoint with its LM linear weights as FP8 in `v`'s layout, by the test's
  // own hand (scales amax / 448 per row / tensor / block).
  void write_variant(const Variant& v, const std::string& out) {
    std::map<std::string, at::Tensor> tensors = read_all_tensors(dir("f32"));
    std::map<std::string, Fp8Format> fp8;
    std::map<std::string, at::Tensor> extra;
    for (auto& [name, t] : tensors) {
      if (!is_lm_linear(name, t)) continue;
      at::Tensor scale;
      at::Tensor expanded;
      if (v.granularity == ScaleGranularity::kPerChannel) {
        scale = std::get<0>(t.abs().max(1, true)) / kE4M3Max;  // [out, 1]
        expanded = scale;
      } else if (v.granularity == ScaleGranularity::kPerBlock) {
        const int64_t b0 = v.block[0], b1 = v.block[1];
        scale = at::empty({(t.size(0) + b0 - 1) / b0, (t.size(1) + b1 - 1) / b1});
        expanded = at::empty_like(t);
        for (int64_t i = 0; i < scale.size(0); ++i) {
          for (int64_t j = 0; j < scale.size(1); ++j) {
            const int64_t h = std::min(b0, t.size(0) - i * b0), w = std::min(b1, t.size(1) - j * b1);
            const at::Tensor amax = t.narrow(0, i * b0, h).narrow(1, j * b1, w).abs().max();
            scale[i][j] = amax / kE4M3Max;
            expanded.narrow(0, i * b0, h).narrow(1, j * b1, w).fill_(amax / kE4M3Max);
          }
        }
      } else {
        scale = t.abs().max() / kE4M3Max;
        expanded = scale;
      }
      const std::string module = name.substr(0, name.size() - 7);
      extra[module + "." + v.scale_suffix] = scale;
      t = fp8_encode_e4m3(t / expanded);
      fp8[name] = Fp8Format::kE4M3;
    }
    tensors.insert(extra.begin(), extra.end());
    std::filesystem::create_directories(out);
    write_json(out + "/config.json", json_with(config_.to_json(), v.quantization_config));
    save_safetensors(out + "/model.safetensors", tensors, {}, fp8);
  }

  void make(const Variant& v, const std::string& out) {
    if (v.quantization_config.empty()) {
      QuantizeOptions options;
      options.format = v.format;
      options.block = v.block;
      quantize_checkpoint(dir("f32"), out, options);
    } else {
      write_variant(v, out);
    }
  }

  // The F32 checkpoint whose LM weights are the FP8 checkpoint's, dequantized by the test.
  void write_reference(const std::string& fp8_dir, const Variant& v, const std::string& out) {
    SafetensorsCheckpoint q(fp8_dir);
    std::map<std::string, at::Tensor> tensors;
    for (const std::string& name : q.names()) {
      if (name.find("_scale") != std::string::npos) continue;
      const SafetensorsEntry& e = q.entry(name);
      if (!e.fp8) {
        tensors[name] = q.tensor(name);
        continue;
      }
      const std::string module = name.substr(0, name.size() - 7);
      tensors[name] =
          dequantize_by_definition(q.tensor(name), q.tensor(module + "." + v.scale_suffix), v.granularity, v.block);
    }
    write_checkpoint_dir(out, config_.to_json(), tensors);
  }

  std::vector<Variant> variants() const {
    return {
        {"HF fine-grained, blocks of 24 x 40 (partial edges)",
         QuantFormat::kHfFineGrained,
         ScaleGranularity::kPerBlock,
         {24, 40},
         "",
         "weight_scale_inv"},
        {"ModelOpt FP8 per tensor", QuantFormat::kModelOpt, ScaleGranularity::kPerTensor, {1, 1}, "", "weight_scale"},
        {"ModelOpt FP8_PER_CHANNEL_PER_TOKEN",
         QuantFormat::kModelOpt,
         ScaleGranularity::kPerChannel,
         {1, 1},
         R"({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "exclude_modules": ["lm_head"]})",
         "weight_scale"},
        {"compressed-tensors per channel",
         QuantFormat::kCompressedTensors,
         ScaleGranularity::kPerChannel,
         {1, 1},
         R"({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0":
            {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
            "ignore": ["lm_head", "re:.*visual.*"]})",
         "weight_scale"},
        {"ModelOpt FP8_PB_WO, square blocks of 32",
         QuantFormat::kModelOpt,
         ScaleGranularity::kPerBlock,
         {32, 32},
         R"({"quant_method": "modelopt", "quant_algo": "FP8_PB_WO", "group_size": 32, "ignore": ["lm_head"]})",
         "weight_scale"},
        {"compressed-tensors blocks of 24 x 40",
         QuantFormat::kCompressedTensors,
         ScaleGranularity::kPerBlock,
         {24, 40},
         R"({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0":
            {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
            "block_structure": [24, 40]}}}, "ignore": ["lm_head"]})",
         "weight_scale"},
        {"vLLM fp8 per tensor (no block size)",
         QuantFormat::kHfFineGrained,
         ScaleGranularity::kPerTensor,
         {1, 1},
         R"({"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]})",
         "weight_scale"},
        {"compressed-tensors per tensor",
         QuantFormat::kCompressedTensors,
         ScaleGranularity::kPerTensor,
         {1, 1},
         R"({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0":
            {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}},
            "ignore": ["lm_head"]})",
         "weight_scale"},
    };
  }

  QwenVlConfig config_;
  QwenVl model_;
  ScratchDir scratch_;
};

TEST_P(Fp8CheckpointTest, EachFormatLoadsAsTheF32ModelOfItsDequantizedWeights) {
  const int64_t count = config_.vision.spatial_merge_size;
  const std::vector<std::array<int64_t, 3>> grids = {{1, 2 * count, 2 * count}, {1, 2 * count, 4 * count}};
  const VisionInputs vision = make_vision(config_, grids, 5);
  const std::vector<int64_t> counts = model_.placeholder_counts(vision);
  const Batch text = left_pad({{1, 2, 3, 4, 5, 6, 7}});
  const Batch images = left_pad({image_prompt({1, 2}, counts[0], {3}), image_prompt({4}, counts[1], {5, 6, 7, 8, 9})});
  const std::vector<Variant> all = variants();
  for (size_t index = 0; index < all.size(); ++index) {
    const Variant& v = all[index];
    SCOPED_TRACE(v.name);
    const std::string fp8_dir = dir("fp8-" + std::to_string(index));
    make(v, fp8_dir);
    std::unique_ptr<CausalVlm> fp8 = load_model(fp8_dir);
    write_reference(fp8_dir, v, fp8_dir + "-reference");
    std::unique_ptr<CausalVlm> reference = load_model(fp8_dir + "-reference");
    // The same checkpoint computed from its bytes (keep_fp8) wherever the scale blocks allow it.
    LoadOptions keep;
    keep.keep_fp8 = true;
    std::unique_ptr<QwenVl> bytes = QwenVl::from_checkpoint(fp8_dir, ParallelContext::single(), keep);
    int64_t kept = 0;
    for (const auto& [name, t] : bytes->named_weights()) kept += t->scalar_type() == at::kByte ? 1 : 0;
    const bool aligned = v.granularity != ScaleGranularity::kPerBlock || v.block[1] % 16 == 0;
    if (aligned) {
      EXPECT_EQ(kept, 7 * config_.num_hidden_layers);  // every decoder linear: 1 byte a weight
    }
    EXPECT_EQ(bytes->keeps_fp8(), kept > 0);
    std::unique_ptr<QwenVl> bf16_model =
        QwenVl::from_checkpoint(fp8_dir, ParallelContext::single(), LoadOptions{at::kBFloat16});
    for (const auto& [what, batch, vis] : {std::tuple<const char*, Batch, VisionInputs>{"text", text, VisionInputs()},
                                           std::tuple<const char*, Batch, VisionInputs>{"images", images, vision}}) {
      const at::Tensor got = full_forward(*fp8, batch, vis);
      const at::Tensor want = full_forward(*reference, batch, vis);
      const double rel = (got - want).abs().max().item<double>() / want.abs().max().item<double>();
      EXPECT_LE(rel, 1e-5) << what;
      const at::Tensor from_bytes = full_forward(*bytes, batch, vis);
      EXPECT_LE((from_bytes - got).abs().max().item<double>() / got.abs().max().item<double>(), 1e-5) << what;
      // bf16 mode: the dequantized weights rounded to bfloat16 (at most 2^-9 of each weight), so
      // the logits move by well under 1% of their largest magnitude.
      const at::Tensor bf16 = full_forward(*bf16_model, batch, vis);
      EXPECT_LE((bf16 - from_bytes).abs().max().item<double>() / got.abs().max().item<double>(), 1e-2) << what;
      // And the FP8 weights are not the F32 ones (the check above would pass on an F32 load).
      const double moved = (got - full_forward(model_, batch, vis)).abs().max().item<double>();
      EXPECT_GT(moved, 1e-4) << what << ": FP8 rounding must show against the F32 model";
    }
    GenerateRequest request = make_request({image_prompt({1, 2}, counts[0], {3})}, vision.select({0}));
    Generator generator(*fp8);
    const auto with_kv = generator.generate(request, GenerationConfig().max_new_tokens(6));
    const auto without = generator.generate(request, GenerationConfig().max_new_tokens(6).enable_kv_cache(false));
    const auto ref_tokens = Generator(*reference).generate(request, GenerationConfig().max_new_tokens(6));
    EXPECT_EQ(with_kv.sequences[0].tokens, without.sequences[0].tokens);
    EXPECT_EQ(with_kv.sequences[0].tokens, ref_tokens.sequences[0].tokens);
    EXPECT_EQ(Generator(*bytes).generate(request, GenerationConfig().max_new_tokens(6)).sequences[0].tokens,
              ref_tokens.sequences[0].tokens);
  }
}

// The quantizer: scales from the weights' own amax, error within half a step, exclusions.
TEST_P(Fp8CheckpointTest, QuantizerScalesAreAmaxOver448AndErrorsStayWithinHalfAStep) {
  QuantizeOptions options;
  options.block = {24, 40};
  std::vector<std::string> progress;
  options.progress = [&](size_t i, size_t n, const std::string& name, bool) {
    EXPECT_EQ(i, progress.size() + 1);
    progress.push_back(name);
  };
  const QuantizeReport report = quantize_checkpoint(dir("f32"), dir("hf"), options);
  const std::map<std::string, at::Tensor> original = read_all_tensors(dir("f32"));
  EXPECT_EQ(progress.size(), original.size());
  SafetensorsCheckpoint q(dir("hf"));
  int64_t checked = 0;
  for (const auto& [name, w] : original) {
    const SafetensorsEntry& e = q.entry(name);
    const bool lm_linear = is_lm_linear(name, w);
    EXPECT_EQ(e.fp8.has_value(), lm_linear) << name << ": only the LM's linear weights are FP8";
    if (!lm_linear) {
      EXPECT_TRUE(q.tensor(name).equal(w)) << name << " is copied unchanged";
      continue;
    }
    const at::Tensor scale = q.tensor(name.substr(0, name.size() - 7) + ".weight_scale_inv");
    ASSERT_EQ(scale.sizes().vec(), (std::vector<int64_t>{(w.size(0) + 23) / 24, (w.size(1) + 39) / 40})) << name;
    const at::Tensor bytes = q.tensor(name);
    for (int64_t bi = 0; bi < scale.size(0); ++bi) {
      for (int64_t bj = 0; bj < scale.size(1); ++bj) {
        const at::Tensor block = w.narrow(0, bi * 24, std::min<int64_t>(24, w.size(0) - bi * 24))
                                     .narrow(1, bj * 40, std::min<int64_t>(40, w.size(1) - bj * 40));
        const float s = scale[bi][bj].item<float>();
        // The seeds' INT8->FP8 bug (scales x 448/127) would be 3.5x off here.
        ASSERT_EQ(s, block.abs().max().item<float>() / 448.0f) << name << " block " << bi << "," << bj;
        const at::Tensor b = bytes.narrow(0, bi * 24, block.size(0)).narrow(1, bj * 40, block.size(1));
        for (int64_t i = 0; i < block.size(0); ++i) {
          for (int64_t j = 0; j < block.size(1); ++j) {
            const double x = block[i][j].item<float>() / s;  // in E4M3 units
            const double step =
                std::fabs(x) < 0.015625 ? std::ldexp(1.0, -9) : std::ldexp(1.0, std::ilogb(std::fabs(x)) - 3);
            const double err = std::fabs(e4m3_definition(b[i][j].item<uint8_t>()) - x);
            ASSERT_LE(err, 0.5 * step * (1 + 1e-6)) << name << " [" << i << "," << j << "] x=" << x;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 1000);
  EXPECT_EQ(report.quantized, static_cast<int64_t>(std::count_if(original.begin(), original.end(), [](const auto& kv) {
              return is_lm_linear(kv.first, kv.second);
            })));

  // ModelOpt: one scale per tensor, amax / 448, written as that format's producers write it.
  QuantizeOptions per_tensor;
  per_tensor.format = QuantFormat::kModelOpt;
  quantize_checkpoint(dir("f32"), dir("modelopt"), per_tensor);
  SafetensorsCheckpoint m(dir("modelopt"));
  const std::string up = "model.layers.0.mlp.up_proj";
  EXPECT_EQ(m.tensor(up + ".weight_scale").item<float>(),
            original.at(up + ".weight").abs().max().item<float>() / 448.0f);
  EXPECT_TRUE(std::filesystem::exists(dir("modelopt") + "/hf_quant_config.json"));
  auto scheme = QuantizationScheme::from_checkpoint(dir("modelopt"));
  ASSERT_TRUE(scheme.has_value());
  EXPECT_EQ(scheme->algorithm, "FP8");
  EXPECT_TRUE(scheme->is_excluded("visual.blocks.0.attn.qkv"));  // this checkpoint spells it visual.*
  EXPECT_FALSE(scheme->is_excluded("model.layers.0.mlp.up_proj"));

  QuantizeOptions huge;
  huge.block = {4000000000000, 1};
  EXPECT_THROW(quantize_checkpoint(dir("f32"), dir("huge"), huge), Error);
  // Refused without writing: an FP8 input, and an output folder that already holds files.
  EXPECT_THROW(quantize_checkpoint(dir("modelopt"), dir("again")), Error);
  EXPECT_FALSE(std::filesystem::exists(dir("again")));
  // An f32 checkpoint holding a tensor named like a scale: it would be written over the computed
  // scale of its weight (the output sorted it after up_proj.weight).
  std::map<std::string, at::Tensor> stray = original;
  stray[up + ".weight_scale_inv"] = at::ones({1, 1});
  write_checkpoint_dir(dir("stray"), config_.to_json(), stray);
  try {
    quantize_checkpoint(dir("stray"), dir("stray-fp8"));
    ADD_FAILURE() << "quantized a checkpoint holding a scale tensor";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(up + ".weight_scale_inv"));
    EXPECT_THAT(e.what(), HasSubstr("named like an FP8 scale"));
  }
  try {
    quantize_checkpoint(dir("f32"), dir("hf"), options);
    ADD_FAILURE() << "overwrote a checkpoint folder";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("exists and is not empty"));
  }
}

// An output head quantized on request is read as bytes too and computes as its dequantized
// weights do; written back, it is the dequantized head.
TEST_P(Fp8CheckpointTest, AQuantizedOutputHeadIsKeptAsBytesAndComputesAsItsDequantizedWeights) {
  QuantizeOptions options;
  options.quantize_lm_head = true;
  quantize_checkpoint(dir("f32"), dir("head"), options);
  SafetensorsCheckpoint q(dir("head"));
  ASSERT_TRUE(q.entry("lm_head.weight").fp8.has_value());
  const Variant v{"HF blocks of 128 with the head",
                  QuantFormat::kHfFineGrained,
                  ScaleGranularity::kPerBlock,
                  {128, 128},
                  "",
                  "weight_scale_inv"};
  write_reference(dir("head"), v, dir("head-reference"));
  LoadOptions keep;
  keep.keep_fp8 = true;
  std::unique_ptr<QwenVl> bytes = QwenVl::from_checkpoint(dir("head"), ParallelContext::single(), keep);
  EXPECT_EQ(bytes->language_model().lm_head.scalar_type(), at::kByte);
  EXPECT_TRUE(bytes->language_model().lm_head_fp8.defined());
  EXPECT_TRUE(bytes->keeps_fp8());
  std::unique_ptr<QwenVl> reference = QwenVl::from_checkpoint(dir("head-reference"));
  const Batch text = left_pad({{1, 2, 3, 4, 5, 6, 7}, {8, 9}});
  const at::Tensor want = full_forward(*reference, text, VisionInputs());
  const at::Tensor got = full_forward(*bytes, text, VisionInputs());
  EXPECT_LE((got - want).abs().max().item<double>() / want.abs().max().item<double>(), 1e-5);
  // Without the head quantized the logits differ by more than the bound above.
  std::unique_ptr<QwenVl> plain_head = QwenVl::from_checkpoint(dir("head-reference"));
  plain_head->language_model().lm_head = model_.language_model().lm_head.clone();
  EXPECT_GT((full_forward(*plain_head, text, VisionInputs()) - want).abs().max().item<double>() /
                want.abs().max().item<double>(),
            1e-4);
  bytes->save_checkpoint(dir("head-saved"));
  EXPECT_TRUE(SafetensorsCheckpoint(dir("head-saved"))
                  .tensor("lm_head.weight")
                  .equal(SafetensorsCheckpoint(dir("head-reference")).tensor("lm_head.weight")));
}

TEST_P(Fp8CheckpointTest, BadFp8CheckpointsAreErrorsNamingTheTensor) {
  Variant hf = variants()[0];
  make(hf, dir("good"));
  const std::map<std::string, at::Tensor> good = read_all_tensors(dir("good"));
  const std::string config_text = [&] {
    std::ifstream in(dir("good") + "/config.json");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  const std::string up = "model.layers.0.mlp.up_proj";
  auto refused = [&](const std::string& name, std::map<std::string, at::Tensor> tensors, const std::string& config,
                     std::map<std::string, Fp8Format> fp8) {
    const std::string d = dir(name);
    std::filesystem::create_directories(d);
    write_json(d + "/config.json", config);
    save_safetensors(d + "/model.safetensors", tensors, {}, fp8);
    try {
      load_model(d);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("loaded");
  };
  std::map<std::string, Fp8Format> fp8;
  for (const auto& [name, t] : good) {
    if (t.scalar_type() == at::kByte) fp8[name] = Fp8Format::kE4M3;
  }
  auto without_scale = good;
  without_scale.erase(up + ".weight_scale_inv");
  EXPECT_THAT(refused("no-scale", without_scale, config_text, fp8),
              HasSubstr("FP8 tensor " + up + ".weight in checkpoint"));
  EXPECT_THAT(refused("no-scale", without_scale, config_text, fp8),
              HasSubstr("has no scale " + up + ".weight_scale_inv"));
  auto wrong_shape = good;
  wrong_shape[up + ".weight_scale_inv"] = at::ones({1, 1});
  EXPECT_THAT(refused("wrong-shape", wrong_shape, config_text, fp8), HasSubstr("the scale of FP8 tensor " + up));
  // The grid was made with blocks of 24 x 40; a config that declares 128 x 128 does not divide so.
  std::string declared = config_text;
  declared.replace(declared.find("24,"), 3, "128,");
  EXPECT_THAT(refused("declared-block", good, declared, fp8), HasSubstr("blocks of 128 x 40, rounded up"));
  std::string excluded = config_text;
  excluded.replace(excluded.find("\"lm_head\""), 9, "\"mlp\"");
  EXPECT_THAT(refused("excluded", good, excluded, fp8), HasSubstr("excludes module"));
  EXPECT_THAT(refused("no-config", good, config_.to_json(), fp8), HasSubstr("declares no quantization"));
  std::string algo = config_text;
  algo.replace(algo.find("\"fp8\""), 5, "\"mxfp8\"");
  EXPECT_THAT(refused("algo", good, algo, fp8), HasSubstr("quant_method 'mxfp8' is not supported"));

  // Computing from the bytes (keep_fp8) reads them as halves, where E4M3's NaN byte would be a
  // number: such a weight is refused, naming it.
  const std::string nan_dir = dir("nan-byte");
  make(variants()[1], nan_dir);  // per tensor: every decoder linear kept as bytes
  std::map<std::string, at::Tensor> with_nan = read_all_tensors(nan_dir);
  std::map<std::string, Fp8Format> nan_fp8;
  for (const auto& [name, t] : with_nan)
    if (t.scalar_type() == at::kByte) nan_fp8[name] = Fp8Format::kE4M3;
  const at::Tensor clean = with_nan.at(up + ".weight");
  LoadOptions keep;
  keep.keep_fp8 = true;
  for (const int nan_byte : {0x7f, 0xff}) {  // both signs, one byte in the middle of the tensor
    SCOPED_TRACE(nan_byte);
    with_nan[up + ".weight"] = clean.clone();
    with_nan[up + ".weight"].view(-1)[clean.numel() / 2 + 5] = nan_byte;
    save_safetensors(nan_dir + "/model.safetensors", with_nan, {}, nan_fp8);
    try {
      QwenVl::from_checkpoint(nan_dir, ParallelContext::single(), keep);
      ADD_FAILURE() << "an E4M3 NaN byte loaded with keep_fp8";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("FP8 tensor " + up + ".weight in checkpoint"));
      EXPECT_THAT(e.what(), HasSubstr("holds NaN bytes"));
    }
  }
  with_nan[up + ".weight"] = clean;  // the same bytes without a NaN load
  save_safetensors(nan_dir + "/model.safetensors", with_nan, {}, nan_fp8);
  EXPECT_NO_THROW(QwenVl::from_checkpoint(nan_dir, ParallelContext::single(), keep));
}

INSTANTIATE_TEST_SUITE_P(Families, Fp8CheckpointTest,
                         ::testing::Values(QwenFamily::kQwen2Vl, QwenFamily::kQwen2_5Vl, QwenFamily::kQwen3Vl),
                         [](const auto& info) { return std::string(family_model_type(info.param)); });

}  // namespace
}  // namespace vlmgen
