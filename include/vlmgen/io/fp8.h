#pragma once
// The two 8-bit float formats of FP8 checkpoints, held as bytes (LibTorch 1.13 has no float8
// dtype): decoding every byte exactly, and rounding floats to E4M3 for the quantizer.
//
//   E4M3 ("F8_E4M3", float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits. No
//   infinities; S.1111.111 is NaN, so the largest magnitude is 1.75 * 2^8 = 448. Exponent 0 is
//   subnormal: m * 2^-9.
//   E5M2 ("F8_E5M2", float8_e5m2): sign, 5 exponent bits (bias 15), 2 mantissa bits, as IEEE:
//   exponent 31 is infinity (m = 0) or NaN; exponent 0 is subnormal: m * 2^-16.

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>

namespace vlmgen {

enum class Fp8Format { kE4M3, kE5M2 };

/// Largest finite E4M3 magnitude.
inline constexpr float kE4M3Max = 448.0f;

/// "F8_E4M3" / "F8_E5M2", as safetensors names them.
const char* fp8_dtype_name(Fp8Format format);
/// The format a safetensors dtype name stands for, if it is one of them.
std::optional<Fp8Format> fp8_format_from_dtype_name(const std::string& name);

/// The exact value of one byte (NaN for the NaN encodings, +-infinity for E5M2's).
float fp8_to_float(uint8_t byte, Fp8Format format);

/// Bytes (uint8, any shape, CPU) to float32 values of the same shape.
at::Tensor fp8_decode(const at::Tensor& bytes, Fp8Format format);

/// The E4M3 byte nearest to `value` (ties to even mantissa); magnitudes above 448 saturate to
/// +-448, NaN becomes 0x7F.
uint8_t float_to_e4m3(float value);

/// float32 values (any shape) to E4M3 bytes (uint8, CPU), as float_to_e4m3.
at::Tensor fp8_encode_e4m3(const at::Tensor& values);

}  // namespace vlmgen
