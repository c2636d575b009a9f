#pragma once

// What the FP8 formats (quantization.cpp) and the FP8 quantizer (quantizer.cpp) share. Private to
// src/models.

#include <cstdint>

namespace vlmgen::detail {

/// The largest hf_quant_config.json read; config.json may be 16 times this.
inline constexpr int64_t kMaxQuantConfigBytes = int64_t{1} << 20;

}  // namespace vlmgen::detail
