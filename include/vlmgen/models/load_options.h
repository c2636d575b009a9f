#pragma once

// How a checkpoint is loaded: the dtype the language model's matrices are kept in.

#include <c10/core/ScalarType.h>

#include <string>

#include "vlmgen/error.h"

namespace vlmgen {

struct LoadOptions {
  /// float32 (default; exact parity with the reference), bfloat16 or float16: the embedding,
  /// attention and MLP weights and lm_head are stored in this dtype (read without a float32
  /// copy), norms, biases and the vision tower stay float32, and compute on the CPU is float32
  /// (on an accelerator a 16-bit model computes in its dtype).
  at::ScalarType weights_dtype = at::kFloat;
  /// For an FP8 checkpoint: keep the decoder's quantized linears as their bytes and scales (one
  /// byte a weight; the CPU kernels decode them as they read them, float32 compute) instead of
  /// dequantizing them to weights_dtype. A weight whose scale blocks do not fit that (an input
  /// block not a multiple of 16, or blocks split by tensor parallelism) is dequantized, with a
  /// warning saying how many. CPU only. A checkpoint that is not FP8 is a vlmgen::Error.
  bool keep_fp8 = false;
};

/// The options a command line's `--dtype` names: f32, bf16, f16, or fp8 (an FP8 checkpoint's
/// linears kept as bytes, its other matrices in bfloat16).
inline LoadOptions load_options_for_dtype(const std::string& name);

/// "f32"/"float32", "bf16"/"bfloat16" or "f16"/"fp16"/"float16"; anything else is a vlmgen::Error
/// listing those.
inline at::ScalarType parse_weights_dtype(const std::string& name) {
  if (name == "f32" || name == "float32") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "f16" || name == "fp16" || name == "float16") return at::kHalf;
  VLMGEN_FAIL("weights dtype must be f32, bf16 or f16, got '{}'", name);
}

inline LoadOptions load_options_for_dtype(const std::string& name) {
  LoadOptions options;
  if (name == "fp8") {
    options.weights_dtype = at::kBFloat16;
    options.keep_fp8 = true;
    return options;
  }
  try {
    options.weights_dtype = parse_weights_dtype(name);
  } catch (const Error&) {
    VLMGEN_FAIL("dtype must be f32, bf16, f16 or fp8, got '{}'", name);
  }
  return options;
}

}  // namespace vlmgen
