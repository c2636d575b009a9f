// The dtype of a Qwen-VL model's weights: 16-bit language-model matrices, FP8 linears kept as
// their bytes (LoadOptions), and finding a decoder linear by its checkpoint name.

#include <fmt/format.h>

#include <string>
#include <utility>

#include "vlmgen/error.h"
#include "vlmgen/models/qwen_vl.h"

namespace vlmgen {

bool QwenVl::is_lm_matrix(const std::string& name, const at::Tensor& tensor) {
  return tensor.dim() == 2 && (name.rfind("model.", 0) == 0 || name == "lm_head.weight");
}

at::ScalarType QwenVl::weights_dtype() const { return lm_.embed_tokens.scalar_type(); }

void QwenVl::convert_weights(at::ScalarType dtype) {
  check_weights_dtype(dtype);
  for (auto& [name, tensor] : named_weights())  // FP8 bytes stay as they are
    if (is_lm_matrix(name, *tensor) && tensor->scalar_type() != at::kByte) *tensor = tensor->to(dtype).contiguous();
  if (config_.tie_word_embeddings) tie_lm_head();
}

bool QwenVl::keeps_fp8() const {
  for (const qwen_vl::DecoderLayer& l : lm_.layers)
    for (const qwen_vl::Linear* linear :
         {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj})
      if (linear->fp8.defined()) return true;
  return lm_.lm_head_fp8.defined();
}

qwen_vl::Linear* QwenVl::decoder_linear(const std::string& name) {
  for (size_t i = 0; i < lm_.layers.size(); ++i) {
    const std::string prefix = fmt::format("model.layers.{}.", i);
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    qwen_vl::DecoderLayer& l = lm_.layers[i];
    const std::pair<const char*, qwen_vl::Linear*> linears[] = {
        {"self_attn.q_proj.weight", &l.q_proj}, {"self_attn.k_proj.weight", &l.k_proj},
        {"self_attn.v_proj.weight", &l.v_proj}, {"self_attn.o_proj.weight", &l.o_proj},
        {"mlp.gate_proj.weight", &l.gate_proj}, {"mlp.up_proj.weight", &l.up_proj},
        {"mlp.down_proj.weight", &l.down_proj}};
    for (const auto& [suffix, linear] : linears)
      if (name.compare(prefix.size(), std::string::npos, suffix) == 0) return linear;
    return nullptr;
  }
  return nullptr;
}

void QwenVl::check_weights_dtype(at::ScalarType dtype) {
  VLMGEN_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
               "weights_dtype must be float32, bfloat16 or float16, got {}", c10::toString(dtype));
}

}  // namespace vlmgen
