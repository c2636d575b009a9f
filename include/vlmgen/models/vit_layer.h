#pragma once

#include "vlmgen/models/qwen_vl.h"

namespace vlmgen::vit {

/// A pre-LayerNorm transformer encoder layer as SigLIP (Gemma-3) and CLIP (LLaVA-NeXT) name it
/// in transformers: x + out_proj(attention(layer_norm1(x))), then x + fc2(act(fc1(layer_norm2(x)))).
struct EncoderLayer {
  qwen_vl::LayerNorm layer_norm1;
  qwen_vl::Linear q_proj, k_proj, v_proj, out_proj;  // [width, width] + bias
  qwen_vl::LayerNorm layer_norm2;
  qwen_vl::Linear fc1;  // [mlp, width] + bias
  qwen_vl::Linear fc2;  // [width, mlp] + bias
};

}  // namespace vlmgen::vit
