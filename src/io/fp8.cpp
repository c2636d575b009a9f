#include "vlmgen/io/fp8.h"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"

namespace vlmgen {
namespace {

float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Builds the float from the byte's fields: a normal value gets its exponent rebiased into
// float32's and its mantissa bits shifted to the top; a subnormal is m times the smallest step.
float decode(uint8_t byte, int exponent_bits, int mantissa_bits, bool ieee_specials) {
  const uint32_t sign = static_cast<uint32_t>(byte >> 7) << 31;
  const int bias = (1 << (exponent_bits - 1)) - 1;
  const uint32_t e = (byte >> mantissa_bits) & ((1u << exponent_bits) - 1);
  const uint32_t m = byte & ((1u << mantissa_bits) - 1);
  const uint32_t e_max = (1u << exponent_bits) - 1;
  if (ieee_specials && e == e_max) {
    return m == 0 ? from_bits(sign | 0x7f800000u) : std::numeric_limits<float>::quiet_NaN();
  }
  if (!ieee_specials && e == e_max && m == (1u << mantissa_bits) - 1) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) {
    const float step = std::ldexp(1.0f, 1 - bias - mantissa_bits);
    const float magnitude = static_cast<float>(m) * step;
    return sign != 0 ? -magnitude : magnitude;
  }
  const uint32_t exponent = static_cast<uint32_t>(static_cast<int>(e) - bias + 127);
  return from_bits(sign | (exponent << 23) | (m << (23 - mantissa_bits)));
}

struct Tables {
  std::array<float, 256> e4m3{};
  std::array<float, 256> e5m2{};
  Tables() {
    for (int b = 0; b < 256; ++b) {
      e4m3[static_cast<size_t>(b)] = decode(static_cast<uint8_t>(b), 4, 3, false);
      e5m2[static_cast<size_t>(b)] = decode(static_cast<uint8_t>(b), 5, 2, true);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

const char* fp8_dtype_name(Fp8Format format) { return format == Fp8Format::kE4M3 ? "F8_E4M3" : "F8_E5M2"; }

std::optional<Fp8Format> fp8_format_from_dtype_name(const std::string& name) {
  if (name == "F8_E4M3") return Fp8Format::kE4M3;
  if (name == "F8_E5M2") return Fp8Format::kE5M2;
  return std::nullopt;
}

float fp8_to_float(uint8_t byte, Fp8Format format) {
  return format == Fp8Format::kE4M3 ? tables().e4m3[byte] : tables().e5m2[byte];
}

at::Tensor fp8_decode(const at::Tensor& bytes, Fp8Format format) {
  VLMGEN_CHECK(bytes.scalar_type() == at::kByte, "FP8 data must be held as uint8 bytes, got {}",
               c10::toString(bytes.scalar_type()));
  const at::Tensor in = bytes.to(at::kCPU).contiguous();
  at::Tensor out = at::empty(in.sizes(), at::TensorOptions().dtype(at::kFloat));
  const auto& table = format == Fp8Format::kE4M3 ? tables().e4m3 : tables().e5m2;
  const uint8_t* src = in.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const int64_t n = in.numel();
  for (int64_t i = 0; i < n; ++i) dst[i] = table[src[i]];
  return out;
}

uint8_t float_to_e4m3(float value) {
  if (std::isnan(value)) return 0x7F;
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  const float a = std::fabs(value);
  if (a >= kE4M3Max) return sign | 0x7E;
  // Below the smallest normal (2^-6) the grid is uniform with step 2^-9: round to it (ties to
  // even: nearbyint under the default rounding mode); 8 steps is the smallest normal, 0x08.
  if (a < 0.015625f) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  int e = std::ilogb(a);                                      // 2^e <= a < 2^(e+1), -6 <= e <= 8
  float m = std::nearbyint(std::ldexp(a, -e) * 8.0f) - 8.0f;  // 0..8 after rounding
  if (m >= 8.0f) {
    m = 0.0f;
    ++e;
  }
  const int biased = e + 7;
  if (biased > 15 || (biased == 15 && m >= 7.0f)) return sign | 0x7E;
  return sign | static_cast<uint8_t>(biased << 3) | static_cast<uint8_t>(m);
}

at::Tensor fp8_encode_e4m3(const at::Tensor& values) {
  const at::Tensor in = values.to(at::kCPU, at::kFloat).contiguous();
  at::Tensor out = at::empty(in.sizes(), at::TensorOptions().dtype(at::kByte));
  const float* src = in.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t n = in.numel();
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_e4m3(src[i]);
  return out;
}

}  // namespace vlmgen
