#pragma once
// The rows of an FP8 KV cache (KV cache dtype at::kByte, check_kv_cache_dtype), header-only like
// InferenceContext, which writes them. A row is the d E4M3 bytes of a key or value row (sign, 4
// exponent bits of bias 7, 3 mantissa bits; vlmgen/io/fp8.h), then its scale as a float32
// (kFp8KvScaleBytes, native byte order, unaligned): element i is e4m3(byte i) * scale, the scale
// amax / 448 of the row, so the row's largest magnitude lands on E4M3's largest and nothing
// saturates (1 for a row of zeros). A row holding a NaN gets a NaN scale and reads back all NaN;
// one holding an infinity (and no NaN) reads back all +infinity: never as finite numbers.

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"

namespace vlmgen {

inline constexpr int64_t kFp8KvScaleBytes = 4;

namespace detail {

/// The E4M3 byte nearest to `value` (ties to even), saturating at +-448: float_to_e4m3 for
/// non-NaN input, by the float's bits. From 2^-6 up the mantissa is rounded to 3 bits in place and
/// the exponent rebiased from 127 to 7; below, the uniform grid of step 2^-9.
inline uint8_t e4m3_bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  bits &= 0x7fffffffu;
  if (bits >= 0x43e00000u) return sign | 0x7E;  // 448 and above
  if (bits < 0x3c800000u) {                     // below 2^-6: multiples of 2^-9 (8 of them is 0x08)
    float a;
    std::memcpy(&a, &bits, sizeof a);
    return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  }
  bits += 0x7ffffu + ((bits >> 20) & 1u);  // round to 3 mantissa bits, ties to even
  const uint32_t byte = (bits >> 20) - (120u << 3);
  return sign | static_cast<uint8_t>(byte > 0x7Eu ? 0x7Eu : byte);
}

/// The value of an E4M3 byte that is not NaN (a KV row never holds 0x7F or 0xFF).
inline float e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float magnitude = std::ldexp(static_cast<float>(e != 0 ? 8 + m : m), (e != 0 ? e : 1) - 10);
  return (b & 0x80) != 0 ? -magnitude : magnitude;
}

}  // namespace detail

/// Encodes the d floats at src into the d + kFp8KvScaleBytes bytes at dst.
inline void encode_fp8_kv_row(const float* src, int64_t d, uint8_t* dst) {
  float amax = 0.0f;
  for (int64_t i = 0; i < d; ++i) {
    const float a = std::fabs(src[i]);
    amax = a > amax || std::isnan(a) ? a : amax;  // a NaN stays
  }
  const float ratio = amax / 448.0f;
  const float scale = ratio == 0.0f ? 1.0f : ratio;  // zeros, or magnitudes too small to scale: all bytes 0
  std::memcpy(dst + d, &scale, sizeof scale);
  if (!std::isfinite(scale)) {  // 2^-6 everywhere: read back as NaN or infinite through the scale
    std::memset(dst, 0x08, static_cast<size_t>(d));
  } else if (ratio == 0.0f) {
    std::memset(dst, 0, static_cast<size_t>(d));
  } else {
    for (int64_t i = 0; i < d; ++i) dst[i] = detail::e4m3_bits_of(src[i] / scale);
  }
}

/// Rows [..., d] (any float dtype, CPU) to FP8 KV rows [..., d + kFp8KvScaleBytes] (uint8).
inline at::Tensor encode_fp8_kv(const at::Tensor& rows) {
  VLMGEN_CHECK(rows.dim() >= 1 && rows.device().is_cpu() && at::isFloatingType(rows.scalar_type()),
               "encode_fp8_kv: needs float rows [..., d] on the CPU, got {} {} on {}",
               c10::toString(rows.scalar_type()), detail::shape_str(rows), rows.device().str());
  const at::Tensor in = rows.to(at::kFloat).contiguous();
  const int64_t d = rows.size(-1);
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.back() = d + kFp8KvScaleBytes;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(at::kByte));
  const int64_t n = d == 0 ? 0 : in.numel() / d;
  const float* src = in.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t r = 0; r < n; ++r) encode_fp8_kv_row(src + r * d, d, dst + r * (d + kFp8KvScaleBytes));
  return out;
}

/// FP8 KV rows [..., d + kFp8KvScaleBytes] (uint8, CPU, any strides) back to float32 [..., d]:
/// each element e4m3(byte) * scale, one rounding.
inline at::Tensor decode_fp8_kv(const at::Tensor& rows) {
  VLMGEN_CHECK(
      rows.scalar_type() == at::kByte && rows.dim() >= 1 && rows.size(-1) > kFp8KvScaleBytes && rows.device().is_cpu(),
      "decode_fp8_kv: needs uint8 FP8 KV rows [..., d + {}] on the CPU, got {} {} on {}", kFp8KvScaleBytes,
      c10::toString(rows.scalar_type()), detail::shape_str(rows), rows.device().str());
  const at::Tensor in = rows.contiguous();
  const int64_t width = rows.size(-1), d = width - kFp8KvScaleBytes;
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.back() = d;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(at::kFloat));
  float values[256];
  for (int b = 0; b < 256; ++b) values[b] = detail::e4m3_value(static_cast<uint8_t>(b));
  const int64_t n = in.numel() / width;
  const uint8_t* src = in.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    float scale;
    std::memcpy(&scale, src + r * width + d, sizeof scale);
    for (int64_t i = 0; i < d; ++i) dst[r * d + i] = values[src[r * width + i]] * scale;
  }
  return out;
}

}  // namespace vlmgen
