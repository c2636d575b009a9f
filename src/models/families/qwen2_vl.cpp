// Qwen2-VL: LayerNorm vision blocks with fc1 -> quick_gelu -> fc2, attention per frame, the
// merger ln_q -> mlp.0 -> GELU -> mlp.2; the Qwen2 LM with q/k/v biases and chunked M-RoPE.

#include "../qwen_family.h"

namespace vlmgen::detail {
namespace {

void read_vision(const FieldReader& r, QwenVisionConfig& v) {
  const QwenVisionConfig defaults;
  v.embed_dim = r.required_int("embed_dim");
  v.hidden_size = r.required_int("hidden_size");
  v.mlp_ratio = r.int_or("mlp_ratio", defaults.mlp_ratio, /*allow_integral_float=*/true);
  v.patch_size = r.aliased_int_or("patch_size", "spatial_patch_size", defaults.patch_size);
  v.hidden_act = r.string_or("hidden_act", "quick_gelu");
}

nlohmann::json write_vision(const QwenVisionConfig& v) {
  return {{"embed_dim", v.embed_dim},  {"hidden_size", v.hidden_size}, {"mlp_ratio", v.mlp_ratio},
          {"in_chans", v.in_channels}, {"patch_size", v.patch_size},   {"hidden_act", v.hidden_act}};
}

void tiny_vision(QwenVisionConfig& v) {
  v.mlp_ratio = 2;
  v.patch_size = 4;
  v.hidden_act = "quick_gelu";
}

}  // namespace

const QwenFamilySpec& qwen2_vl_family() {
  static const QwenFamilySpec spec = {QwenFamily::kQwen2Vl,
                                      "qwen2_vl",
                                      "Qwen2VLForConditionalGeneration",
                                      "Qwen2-VL",
                                      /*vision_rms_norm=*/false,
                                      /*vision_gated_mlp=*/false,
                                      /*patch_embed_bias=*/false,
                                      /*learned_position_table=*/false,
                                      /*window_attention=*/false,
                                      /*deepstack=*/false,
                                      "mlp.fc1",
                                      nullptr,
                                      "mlp.fc2",
                                      "merger.ln_q",
                                      "merger.mlp.0",
                                      "merger.mlp.2",
                                      "vision_config.embed_dim",
                                      "vision_config.hidden_size",
                                      /*image_frames_share_time=*/false,
                                      /*qwen3_text=*/false,
                                      /*default_rope_theta=*/1000000.0,
                                      /*default_rms_norm_eps=*/1e-5,
                                      /*default_max_position_embeddings=*/32768,
                                      read_vision,
                                      write_vision,
                                      /*nested_text_config=*/false,
                                      tiny_vision};
  return spec;
}

}  // namespace vlmgen::detail
