#pragma once

// The Qwen2-VL name of the Qwen-VL model class, which implements Qwen2-VL, Qwen2.5-VL and
// Qwen3-VL (QwenVlConfig::family says which).

#include "vlmgen/models/qwen_vl.h"

namespace vlmgen {

using Qwen2Vl = QwenVl;
namespace qwen2_vl = qwen_vl;

}  // namespace vlmgen
