// FP8 checkpoints: the byte formats, the three checkpoint formats, the quantizer.

#include "vlmgen/io/fp8.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "qwen_test_util.h"
#include "shapes/shapes_data.h"
#include "shapes/shapes_model.h"
#include "vlmgen/fp8_kv_rows.h"
#include "vlmgen/generator.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/models/quantization.h"
#include "vlmgen/models/qwen_vl.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT
using ::testing::HasSubstr;

// ---- the byte formats, written out from their definitions ---------------------------------

// E4M3 (float8_e4m3fn): bias 7, 3 mantissa bits, no infinities, S.1111.111 NaN.
double e4m3_definition(int b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  double v;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) {
    v = std::ldexp(m / 8.0, 1 - 7);
  } else {
    v = std::ldexp(1.0 + m / 8.0, e - 7);
  }
  return s ? -v : v;
}

// E5M2: bias 15, 2 mantissa bits, IEEE infinities and NaNs.
double e5m2_definition(int b) {
  const int s = b >> 7, e = (b >> 2) & 31, m = b & 3;
  double v;
  if (e == 31) {
    if (m != 0) return std::numeric_limits<double>::quiet_NaN();
    v = std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    v = std::ldexp(m / 4.0, 1 - 15);
  } else {
    v = std::ldexp(1.0 + m / 4.0, e - 15);
  }
  return s ? -v : v;
}

void expect_same_value(double expected, float got, const std::string& what) {
  if (std::isnan(expected)) {
    EXPECT_TRUE(std::isnan(got)) << what;
    return;
  }
  EXPECT_EQ(static_cast<double>(got), expected) << what;
  EXPECT_EQ(std::signbit(got), std::signbit(expected)) << what << " (sign of zero)";
}

TEST(Fp8Bytes, EveryByteOfBothFormatsDecodesAsTheFormatDefines) {
  at::Tensor all = at::arange(256, at::kLong).to(at::kByte);
  at::Tensor e4 = fp8_decode(all, Fp8Format::kE4M3);
  at::Tensor e5 = fp8_decode(all, Fp8Format::kE5M2);
  int nans4 = 0, nans5 = 0;
  for (int b = 0; b < 256; ++b) {
    expect_same_value(e4m3_definition(b), fp8_to_float(static_cast<uint8_t>(b), Fp8Format::kE4M3),
                      fmt::format("E4M3 byte {:#04x}", b));
    expect_same_value(e5m2_definition(b), fp8_to_float(static_cast<uint8_t>(b), Fp8Format::kE5M2),
                      fmt::format("E5M2 byte {:#04x}", b));
    expect_same_value(e4m3_definition(b), e4[b].item<float>(), fmt::format("decoded tensor, E4M3 {:#04x}", b));
    expect_same_value(e5m2_definition(b), e5[b].item<float>(), fmt::format("decoded tensor, E5M2 {:#04x}", b));
    nans4 += std::isnan(e4m3_definition(b));
    nans5 += std::isnan(e5m2_definition(b));
  }
  EXPECT_EQ(nans4, 2);  // 0x7F and 0xFF
  EXPECT_EQ(nans5, 6);  // exponent 31 with a non-zero mantissa, both signs
  // Landmarks, by hand.
  EXPECT_EQ(fp8_to_float(0x7E, Fp8Format::kE4M3), 448.0f);
  EXPECT_EQ(fp8_to_float(0x38, Fp8Format::kE4M3), 1.0f);
  EXPECT_EQ(fp8_to_float(0x08, Fp8Format::kE4M3), 0.015625f);     // smallest normal, 2^-6
  EXPECT_EQ(fp8_to_float(0x01, Fp8Format::kE4M3), 0.001953125f);  // smallest subnormal, 2^-9
  EXPECT_EQ(fp8_to_float(0xC4, Fp8Format::kE4M3), -3.0f);         // 1.1000.100: -(1.5 * 2)
  EXPECT_EQ(fp8_to_float(0x7B, Fp8Format::kE5M2), 57344.0f);
  EXPECT_EQ(fp8_to_float(0x3C, Fp8Format::kE5M2), 1.0f);
  EXPECT_TRUE(std::isinf(fp8_to_float(0xFC, Fp8Format::kE5M2)));
  EXPECT_EQ(fp8_to_float(0x01, Fp8Format::kE5M2), std::ldexp(1.0f, -16));
  EXPECT_THROW(fp8_decode(at::zeros({2}, at::kFloat), Fp8Format::kE4M3), Error);
}

TEST(Fp8Bytes, E4M3RoundingIsNearestEvenAndSaturates) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;  // NaN
    EXPECT_EQ(float_to_e4m3(static_cast<float>(e4m3_definition(b))), b) << fmt::format("byte {:#04x}", b);
  }
  EXPECT_EQ(float_to_e4m3(1.0625f), 0x38);        // between 1 (m=0) and 1.125 (m=1): to even, m=0
  EXPECT_EQ(float_to_e4m3(1.1875f), 0x3A);        // between 1.125 (m=1) and 1.25 (m=2): m=2
  EXPECT_EQ(float_to_e4m3(1.0626f), 0x39);        // just above the tie
  EXPECT_EQ(float_to_e4m3(0x1p-10f), 0x00);       // half the smallest subnormal: to 0
  EXPECT_EQ(float_to_e4m3(0x3p-10f), 0x02);       // between subnormals 1 and 2: to 2
  EXPECT_EQ(float_to_e4m3(0.0146484375f), 0x08);  // 7.5 * 2^-9 rounds up into the smallest normal
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7E);         // would round to 480, which does not exist: saturate
  EXPECT_EQ(float_to_e4m3(1e9f), 0x7E);
  EXPECT_EQ(float_to_e4m3(-1e9f), 0xFE);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  at::Tensor values = at::tensor({1.0f, -3.0f, 448.0f, 500.0f});
  EXPECT_TRUE(fp8_encode_e4m3(values).equal(at::tensor({0x38, 0xC4, 0x7E, 0x7E}, at::kByte)));
}

// ---- the rows of an FP8 KV cache ------------------------------------------------------------

// The cache's encoder (by the float's bits) rounds as float_to_e4m3 does (tested above against
// the definition) on every E4M3 value, every midpoint between neighbours (ties), the floats just
// either side of each midpoint, and a sweep of float bit patterns over the whole range; its
// decoder gives each non-NaN byte's defined value.
TEST(Fp8KvRows, BytesRoundAsTheQuantizersEncoderAndDecodeAsDefined) {
  std::vector<float> probes;
  for (int b = 0; b < 127; ++b) {  // positive finite values, in order
    const auto here = static_cast<float>(e4m3_definition(b));
    probes.push_back(here);
    if (b + 1 < 127) {
      const auto mid = static_cast<float>((e4m3_definition(b) + e4m3_definition(b + 1)) / 2);
      probes.insert(probes.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)});
    }
  }
  for (uint32_t bits = 0; bits < 0x44000000u; bits += 4099) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    probes.push_back(f);
  }
  probes.insert(probes.end(), {448.0f, 460.0f, 464.0f, 470.0f, 1e9f, std::numeric_limits<float>::infinity()});
  for (float p : probes) {
    for (float v : {p, -p}) ASSERT_EQ(detail::e4m3_bits_of(v), float_to_e4m3(v)) << fmt::format("{:a}", v);
  }
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;
    expect_same_value(e4m3_definition(b), detail::e4m3_value(static_cast<uint8_t>(b)), fmt::format("byte {:#x}", b));
  }
}

// A hand-computed row: amax 2, so the scale is 2 / 448 = 1 / 224 and the elements over it are 448,
// -224, 67.2 and 0: bytes 0x7E (1.75 * 2^8), 0xF6 (-1.75 * 2^7), 0x68 (2^6: 67.2 = 1.05 * 2^6
// rounds to mantissa 0) and 0x00; read back 2, -1, 64 / 224, 0.
TEST(Fp8KvRows, AHandComputedRowAndItsScale) {
  const float row[4] = {2.0f, -1.0f, 0.3f, 0.0f};
  uint8_t bytes[8];
  encode_fp8_kv_row(row, 4, bytes);
  EXPECT_EQ(std::vector<int>(bytes, bytes + 4), (std::vector<int>{0x7E, 0xF6, 0x68, 0x00}));
  float scale;
  std::memcpy(&scale, bytes + 4, sizeof scale);
  EXPECT_EQ(scale, 2.0f / 448.0f);
  const at::Tensor back = decode_fp8_kv(at::from_blob(bytes, {8}, at::kByte));
  EXPECT_EQ(back[0].item<float>(), 448.0f * scale);
  EXPECT_EQ(back[1].item<float>(), -224.0f * scale);
  EXPECT_EQ(back[2].item<float>(), 64.0f * scale);
  EXPECT_EQ(back[3].item<float>(), 0.0f);
}

// Rows of every magnitude read back within half an E4M3 step of their row's scale: relative 2^-4
// for elements in E4M3's normal range, 2^-10 of the scale below it; each row's scale is its own
// amax / 448 (a wrong ratio such as 448/127 fails here). Zeros stay zeros; a row holding a NaN or
// an infinity never reads back as finite numbers. encode and decode keep any leading shape.
TEST(Fp8KvRows, RowsReadBackWithinHalfAStepOfTheirOwnScale) {
  at::manual_seed(3);
  at::Tensor rows = at::randn({3, 5, 64}) * at::pow(10.0, at::linspace(-4, 4, 15)).view({3, 5, 1});
  rows[0][0].zero_();
  const at::Tensor bytes = encode_fp8_kv(rows);
  ASSERT_EQ(bytes.sizes(), (at::IntArrayRef{3, 5, 68}));
  const at::Tensor back = decode_fp8_kv(bytes);
  ASSERT_EQ(back.sizes(), rows.sizes());
  const at::Tensor flat = rows.view({15, 64}), out = back.view({15, 64}), b = bytes.view({15, 68});
  for (int64_t r = 0; r < 15; ++r) {
    float scale;
    std::memcpy(&scale, b[r].data_ptr<uint8_t>() + 64, sizeof scale);
    const float amax = flat[r].abs().max().item<float>();
    EXPECT_EQ(scale, amax == 0.0f ? 1.0f : amax / 448.0f) << "row " << r;
    for (int64_t i = 0; i < 64; ++i) {
      const double x = flat[r][i].item<float>(), y = out[r][i].item<float>();
      const double bound = std::abs(x) >= 0x1p-6 * scale ? std::abs(x) * 0x1p-4 : 0x1p-10 * scale;
      ASSERT_LE(std::abs(x - y), bound * (1 + 1e-6)) << "row " << r << " element " << i;
    }
  }
  EXPECT_TRUE(out[0].eq(0).all().item<bool>());
  at::Tensor bad = at::ones({2, 16});
  bad[0][3] = std::numeric_limits<float>::quiet_NaN();
  bad[1][5] = std::numeric_limits<float>::infinity();
  const at::Tensor bad_back = decode_fp8_kv(encode_fp8_kv(bad));
  EXPECT_FALSE(at::isfinite(bad_back).any().item<bool>());
  EXPECT_THROW(decode_fp8_kv(at::zeros({2, 4}, at::kByte)), Error);  // no room for a scale
  EXPECT_THROW(decode_fp8_kv(at::zeros({2, 20})), Error);            // not bytes
}

// ---- the checkpoint formats -----------------------------------------------------------------

const char* kHfConfig = R"({"model_type": "qwen3_vl", "quantization_config": {"quant_method": "fp8",
  "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
  "modules_to_not_convert": ["lm_head", "visual"]}})";

TEST(Fp8Schemes, EachFormatMapsToOneDescription) {
  auto hf = QuantizationScheme::from_json(kHfConfig, "");
  ASSERT_TRUE(hf.has_value());
  EXPECT_EQ(hf->format, QuantFormat::kHfFineGrained);
  EXPECT_EQ(hf->granularity, ScaleGranularity::kPerBlock);
  EXPECT_EQ(hf->block, (std::array<int64_t, 2>{128, 128}));
  EXPECT_EQ(hf->scale_suffix, "weight_scale_inv");
  EXPECT_EQ(hf->scale_use, ScaleUse::kMultiply);
  EXPECT_EQ(hf->scale_shape({300, 129}), (std::vector<int64_t>{3, 2}));

  const std::string modelopt = R"({"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization":
    {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head", "*visual*"]}})";
  auto mo = QuantizationScheme::from_json(R"({"model_type": "qwen3_vl"})", modelopt);
  ASSERT_TRUE(mo.has_value());
  EXPECT_EQ(mo->format, QuantFormat::kModelOpt);
  EXPECT_EQ(mo->granularity, ScaleGranularity::kPerTensor);
  EXPECT_EQ(mo->scale_suffix, "weight_scale");
  auto channel = QuantizationScheme::from_json(
      R"({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}})", "");
  EXPECT_EQ(channel->granularity, ScaleGranularity::kPerChannel);
  auto pb = QuantizationScheme::from_json("", R"({"quantization": {"quant_algo": "FP8_PB_WO"}})");
  EXPECT_EQ(pb->granularity, ScaleGranularity::kPerBlock);

  const std::string ct = R"({"quantization_config": {"quant_method": "compressed-tensors", "format":
    "float-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type":
    "float", "strategy": "channel", "symmetric": true, "dynamic": false}, "input_activations": {"num_bits": 8,
    "type": "float", "strategy": "token", "dynamic": true}}}, "ignore": ["lm_head", "re:.*visual.*"]}})";
  auto c = QuantizationScheme::from_json(ct, "");
  EXPECT_EQ(c->format, QuantFormat::kCompressedTensors);
  EXPECT_EQ(c->granularity, ScaleGranularity::kPerChannel);
  EXPECT_EQ(c->scale_suffix, "weight_scale");

  EXPECT_FALSE(QuantizationScheme::from_json(R"({"model_type": "qwen2_vl"})", "").has_value());

  // "fp8" without a block size (vLLM, AutoFP8): one weight_scale per tensor; ignored_layers.
  auto vllm = QuantizationScheme::from_json(
      R"({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers":
      ["lm_head"]}})",
      "");
  EXPECT_EQ(vllm->granularity, ScaleGranularity::kPerTensor);
  EXPECT_EQ(vllm->scale_suffix, "weight_scale");
  EXPECT_TRUE(vllm->is_excluded("lm_head"));
  // An older ModelOpt export's own config.json entry (quant_library, no quant_method) defers to
  // hf_quant_config.json; a newer one lists exclusions under "ignore".
  auto library = QuantizationScheme::from_json(R"({"quantization_config": {"quant_library": "modelopt"}})",
                                               R"({"quantization": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}})");
  EXPECT_EQ(library->granularity, ScaleGranularity::kPerChannel);
  auto ignore = QuantizationScheme::from_json(
      R"({"quantization_config": {"quant_method": "modelopt", "quant_algo": "fp8_pb_wo", "group_size": 64,
      "ignore": ["lm_head", "model.visual*"]}})",
      "");
  EXPECT_EQ(ignore->granularity, ScaleGranularity::kPerBlock);
  EXPECT_EQ(ignore->block, (std::array<int64_t, 2>{64, 64}));
  EXPECT_TRUE(ignore->is_excluded("model.visual.blocks.0.attn.qkv"));
}

void expect_refused(const std::string& config, const std::string& hf_quant, const std::string& named) {
  try {
    QuantizationScheme::from_json(config, hf_quant);
    ADD_FAILURE() << "accepted: " << config << hf_quant;
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(named));
  }
}

TEST(Fp8Schemes, SchemesVlmgenCannotLoadFaithfullyAreErrorsNamingThem) {
  expect_refused("", R"({"quantization": {"quant_algo": "NVFP4"}})", "quant_algo 'NVFP4' is not supported");
  expect_refused("", R"({"quantization": {"quant_algo": "W4A16_AWQ"}})", "'W4A16_AWQ'");
  expect_refused(R"({"quantization_config": {"quant_method": "awq", "bits": 4}})", "", "quant_method 'awq'");
  expect_refused(R"({"quantization_config": {"quant_method": "fp8", "activation_scheme": "sometimes"}})", "",
                 "activation_scheme must be 'dynamic' or 'static'");
  expect_refused(R"({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g":
      {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}, "ignore": ["re:visual(["]}})",
                 "", "ignore pattern 'visual([' is not a regular expression");
  expect_refused(R"({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}})",
                 "", "format 'pack-quantized'");
  expect_refused(R"({"quantization_config": {"quant_method": "compressed-tensors", "config_groups":
      {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}})",
                 "", "weights of 8 bits of type 'int'");
  expect_refused(R"({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})", "",
                 "weight_block_size must be two positive integers");
}

TEST(Fp8Schemes, ExclusionsFollowEachFormatsOwnMatchingRule) {
  QuantizationScheme s;
  s.excluded = {"lm_head", "visual"};
  s.format = QuantFormat::kHfFineGrained;  // anywhere in the name
  EXPECT_TRUE(s.is_excluded("model.visual.blocks.0.attn.qkv"));
  EXPECT_TRUE(s.is_excluded("lm_head"));
  EXPECT_FALSE(s.is_excluded("model.layers.0.mlp.up_proj"));
  s.format = QuantFormat::kModelOpt;  // shell wildcards on the whole name
  s.excluded = {"lm_head", "*visual*", "model.layers.1.*"};
  EXPECT_TRUE(s.is_excluded("model.visual.merger.mlp.0"));
  EXPECT_TRUE(s.is_excluded("model.layers.1.mlp.up_proj"));
  EXPECT_FALSE(s.is_excluded("model.layers.10.mlp.up_proj"));
  EXPECT_FALSE(s.is_excluded("model.lm_head_extra"));
  s.format = QuantFormat::kCompressedTensors;  // exact, or re: as Python's re.match (from the start)
  s.excluded = {"lm_head", "re:.*visual.*", "re:(?i)MODEL\\.LAYERS\\.1\\."};
  EXPECT_TRUE(s.is_excluded("lm_head"));
  EXPECT_TRUE(s.is_excluded("model.visual.blocks.0.mlp.fc1"));
  EXPECT_FALSE(s.is_excluded("model.lm_head"));
  EXPECT_TRUE(s.is_excluded("model.layers.1.mlp.up_proj"));     // anchored at the start, case folded
  EXPECT_FALSE(s.is_excluded("x.model.layers.1.mlp.up_proj"));  // re.match does not search
  // The pattern that kept std::regex busy for minutes on one name: no match, at once.
  s.excluded = {"re:(.|.)*#"};
  EXPECT_FALSE(s.is_excluded("model.layers.10.self_attn.q_proj"));
  // Python's {,n} (0 to n times) is not read as text here.
  s.excluded = {"re:model{,3}"};
  EXPECT_THROW(s.is_excluded("model"), Error);
  // One that backtracks without end in any engine is an error naming it.
  s.excluded = {"re:(\\w+\\w+)+(#|%)"};
  try {
    s.is_excluded("model_layers_10_self_attn_q_proj_weight_more");
    ADD_FAILURE() << "matched a runaway pattern";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("could not be matched against module"));
  }
}

// The dequantization rule on blocks computed by hand: w = decoded byte x its scale.
TEST(Fp8Schemes, DequantizationRuleOnHandComputedWeights) {
  // Bytes: 0x38 = 1, 0x40 = 2, 0xB8 = -1, 0x3C = 1.5, 0x30 = 0.5, 0x00 = 0.
  const at::Tensor bytes =
      at::tensor({0x38, 0x40, 0xB8, 0x3C, 0x30, 0x00, 0x40, 0x38, 0x30}, at::kByte).reshape({3, 3});
  QuantizationScheme block;
  block.granularity = ScaleGranularity::kPerBlock;
  block.block = {2, 2};  // a [3, 3] weight: 2 x 2 blocks, the last row and column partial
  const at::Tensor grid = at::tensor({2.0f, 3.0f, 5.0f, 7.0f}).reshape({2, 2});
  // Row 0: 1*2, 2*2, -1*3; row 1: 1.5*2, 0.5*2, 0*3; row 2: 2*5, 1*5, 0.5*7.
  const at::Tensor by_hand = at::tensor({2.0f, 4.0f, -3.0f, 3.0f, 1.0f, 0.0f, 10.0f, 5.0f, 3.5f}).reshape({3, 3});
  EXPECT_TRUE(block.dequantize(bytes, grid, "w").equal(by_hand)) << block.dequantize(bytes, grid, "w");

  QuantizationScheme channel;
  channel.granularity = ScaleGranularity::kPerChannel;
  const at::Tensor rows = at::tensor({2.0f, 0.5f, 4.0f});
  const at::Tensor by_row = at::tensor({2.0f, 4.0f, -2.0f, 0.75f, 0.25f, 0.0f, 8.0f, 4.0f, 2.0f}).reshape({3, 3});
  EXPECT_TRUE(channel.dequantize(bytes, rows, "w").equal(by_row));
  EXPECT_TRUE(channel.dequantize(bytes, rows.reshape({3, 1}), "w").equal(by_row));  // [out, 1] as ModelOpt writes

  QuantizationScheme tensor;
  tensor.granularity = ScaleGranularity::kPerTensor;
  const at::Tensor by_tensor =
      at::tensor({0.25f, 0.5f, -0.25f, 0.375f, 0.125f, 0.0f, 0.5f, 0.25f, 0.125f}).reshape({3, 3});
  EXPECT_TRUE(tensor.dequantize(bytes, at::full({}, 0.25f), "w").equal(by_tensor));
  EXPECT_TRUE(tensor.dequantize(bytes, at::full({1}, 0.25f), "w").equal(by_tensor));
}

TEST(Fp8Schemes, BadScalesAreErrorsNamingTheTensor) {
  const at::Tensor bytes = at::zeros({4, 6}, at::kByte);
  QuantizationScheme s;
  s.block = {2, 4};
  auto message = [&](const at::Tensor& scale) {
    try {
      s.dequantize(bytes, scale, "model.layers.0.mlp.up_proj.weight");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message(at::ones({2, 2})), "accepted");  // [4, 6] in blocks of 2 x 4: a 2 x 2 grid
  EXPECT_THAT(message(at::ones({2, 1})), HasSubstr("model.layers.0.mlp.up_proj.weight"));
  EXPECT_THAT(message(at::ones({2, 1})), HasSubstr("need [2, 2] (blocks of 2 x 4, rounded up)"));
  EXPECT_THAT(message(at::ones({2, 3})), HasSubstr("is [2, 3]"));
  EXPECT_THAT(message(-at::ones({2, 2})), HasSubstr("finite and >= 0"));
  EXPECT_THAT(message(at::full({2, 2}, std::nanf(""))), HasSubstr("finite and >= 0"));
  EXPECT_THAT(message(at::ones({2, 2}, at::kLong)), HasSubstr("must be a float tensor"));
}

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

// ---- resident memory of a load -------------------------------------------------------------------

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif
#else
constexpr bool kAddressSanitizer = false;
#endif

int64_t status_kb(const char* field) {  // a field of /proc/self/status in kB; -1 where there is none
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(field, 0) == 0) return std::stoll(line.substr(std::strlen(field) + 1));
  return -1;
}

// Weights kept as FP8 bytes cost their bytes: the load's peak resident memory above where it
// started stays within 10% of the loaded weights plus 10 MB (a 4 MiB conversion buffer, 2 MiB
// pages). Reading each weight's bytes to a heap copy, checking them through two tensor-sized
// temporaries and then copying them into place took the peak to 1.9x here (the 16 MB head), and
// the holes those left in the heap piled up to 1.4x the weights on the 100M bench model.
TEST(Fp8Load, PeakResidentMemoryOfABytesLoadIsTheWeights) {
  if (kAddressSanitizer) GTEST_SKIP() << "AddressSanitizer holds freed memory in quarantine";
  if (status_kb("VmHWM:") < 0 || !std::ofstream("/proc/self/clear_refs").good())
    GTEST_SKIP() << "no /proc/self/status peak to reset here";
  ScratchDir scratch;
  QwenVlConfig c = test_config();  // a large output head: its temporaries would show
  c.hidden_size = 256;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.mrope_section = {8, 12, 12};
  c.intermediate_size = 768;
  c.vocab_size = 65536;
  c.vision.hidden_size = 256;
  {
    QwenVl model(c, 3);
    model.save_checkpoint(scratch.dir("f32"));
  }
  QuantizeOptions options;
  options.quantize_lm_head = true;
  quantize_checkpoint(scratch.dir("f32"), scratch.dir("fp8"), options);
  const LoadOptions keep = load_options_for_dtype("fp8");  // as --dtype fp8: 16-bit embedding
  std::ofstream("/proc/self/clear_refs") << "5";           // the peak starts again from the present RSS
  const int64_t start = status_kb("VmRSS:");
  if (status_kb("VmHWM:") > start + 4096) GTEST_SKIP() << "this kernel does not reset the peak RSS";
  std::unique_ptr<QwenVl> model = QwenVl::from_checkpoint(scratch.dir("fp8"), ParallelContext::single(), keep);
  const int64_t peak = status_kb("VmHWM:");
  int64_t bytes = 0;
  for (auto& [name, t] : model->named_weights()) bytes += t->numel() * static_cast<int64_t>(t->element_size());
  ASSERT_EQ(model->language_model().lm_head.scalar_type(), at::kByte);
  report("weights MB", static_cast<double>(bytes) / 1e6);
  report("load peak above the start MB", static_cast<double>(peak - start) / 1e3);
  EXPECT_LE(static_cast<double>(peak - start) * 1024, 1.1 * static_cast<double>(bytes) + 10e6);
}

// ---- the shipped captioner ----------------------------------------------------------------------

/// How many of 200 unseen pictures (evaluation scenes of `seed`) two captioners caption alike.
int same_captions(shapes::ShapesCaptioner& a, shapes::ShapesCaptioner& b, uint64_t seed) {
  std::vector<Image> pictures;
  for (const shapes::Scene& scene : shapes::make_scenes(seed, shapes::Split::kEval, 0, 200))
    pictures.push_back(scene.image);
  const auto x = a.caption(pictures, GenerationConfig(), 50);
  const auto y = b.caption(pictures, GenerationConfig(), 50);
  int same = 0;
  for (size_t i = 0; i < pictures.size(); ++i) same += x.captions[i] == y.captions[i];
  return same;
}

// A trained model is the measure of FP8 rounding (a random tiny model's greedy path is chaotic):
// the captioner's FP8 copy captions 200 unseen pictures as the F32 model does. Its lm_head is
// tied (stored nowhere): quantizing must skip it, not dereference it.
TEST(Fp8ShapesCaptioner, TiedCaptionerInFp8CaptionsLikeF32) {
  ScratchDir scratch;
  const std::string source = shapes::default_checkpoint_dir(VLMGEN_SOURCE_DIR);
  const QuantizeReport report = quantize_checkpoint(source, scratch.dir("fp8"));
  EXPECT_GT(report.quantized, 0);
  SafetensorsCheckpoint q(scratch.dir("fp8"));
  EXPECT_FALSE(q.contains("lm_head.weight"));
  EXPECT_FALSE(q.entry("model.embed_tokens.weight").fp8.has_value());
  shapes::ShapesCaptioner f32 = shapes::ShapesCaptioner::load(source);
  shapes::ShapesCaptioner fp8 = shapes::ShapesCaptioner::load(scratch.dir("fp8"));
  EXPECT_TRUE(fp8.model().tied_embeddings());
  const int same = same_captions(f32, fp8, 11);
  std::printf("[ measured ] FP8 (HF blocks) captions equal to F32 on %d of 200 pictures\n", same);
  EXPECT_GE(same, 190);

  QuantizeOptions with_embedding;
  with_embedding.quantize_embedding = true;
  quantize_checkpoint(source, scratch.dir("fp8-embedding"), with_embedding);
  EXPECT_TRUE(SafetensorsCheckpoint(scratch.dir("fp8-embedding")).entry("model.embed_tokens.weight").fp8.has_value());
  EXPECT_TRUE(shapes::ShapesCaptioner::load(scratch.dir("fp8-embedding")).model().tied_embeddings());
}

// The same measure for an FP8 KV cache: the f32 captioner caching its keys and values as E4M3
// rows captions 200 unseen pictures as it does over a float32 cache; a cache whose scales were
// off (448/127 instead of amax/448) or whose rows were read with another row's scale would not.
TEST(Fp8ShapesCaptioner, AnFp8KvCacheCaptionsLikeAFloat32Cache) {
  const std::string source = shapes::default_checkpoint_dir(VLMGEN_SOURCE_DIR);
  shapes::ShapesCaptioner exact = shapes::ShapesCaptioner::load(source);
  shapes::ShapesCaptioner rounded = shapes::ShapesCaptioner::load(source);
  rounded.model().set_kv_cache_dtype(at::kByte);
  const int same = same_captions(exact, rounded, 13);
  std::printf("[ measured ] FP8 KV cache: captions equal to the float32 cache's on %d of 200 pictures\n", same);
  EXPECT_GE(same, 190);
}

}  // namespace
}  // namespace vlmgen
