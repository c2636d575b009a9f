#pragma once

// How a checkpoint is loaded: the dtype the language model's matrices are kept in.

#include <c10/core/ScalarType.h>

#include <string>

#include "vlmgen/error.h"

namespace vlmgen {

struct LoadOptions {
  /// float32 (default; exact parity with the reference), bfloat16 or float16: the embedding,
  /// attention and MLP weights and lm_head are stored in this dtype (read without a float32
  /// copy), norms, biases and the vision tower stay float32, and compute is float32.
  at::ScalarType weights_dtype = at::kFloat;
};

/// "f32"/"float32", "bf16"/"bfloat16" or "f16"/"fp16"/"float16"; anything else is a vlmgen::Error
/// listing those.
inline at::ScalarType parse_weights_dtype(const std::string& name) {
  if (name == "f32" || name == "float32") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "f16" || name == "fp16" || name == "float16") return at::kHalf;
  VLMGEN_FAIL("weights dtype must be f32, bf16 or f16, got '{}'", name);
}

}  // namespace vlmgen
