// FP8: the byte formats, the rows of an FP8 KV cache, the checkpoint formats' quantization schemes.
// FP8 checkpoints of the model families and the quantizer: fp8_checkpoint_test.cpp; the peak memory
// of a load and the shipped captioner in FP8: fp8_memory_and_captioner_test.cpp.

#include "vlmgen/io/fp8.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "fp8_test_util.h"
#include "vlmgen/error.h"
#include "vlmgen/fp8_kv_rows.h"
#include "vlmgen/models/quantization.h"

namespace vlmgen {
namespace {

using fp8_test::e4m3_definition;
using ::testing::HasSubstr;

// ---- the byte formats, written out from their definitions ---------------------------------

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

}  // namespace
}  // namespace vlmgen
