// Qwen3-VL (dense): a Conv3d patch embedding with bias plus a learned square position table
// interpolated bilinearly to each grid, LayerNorm vision blocks with linear_fc1 -> tanh-GELU ->
// linear_fc2, the merger norm -> linear_fc1 -> GELU -> linear_fc2, and DeepStack mergers (norm
// after the 2x2 shuffle) on the outputs of deepstack_visual_indexes; the Qwen3 LM (q/k RMSNorm
// per head, no q/k/v bias) with interleaved M-RoPE. HF writes its config nested (text_config).

#include "../qwen_family.h"

namespace vlmgen::detail {
namespace {

void read_vision(const FieldReader& r, QwenVisionConfig& v) {
  v.embed_dim = r.required_int("hidden_size");
  v.hidden_size = r.required_int("out_hidden_size");
  v.intermediate_size = r.required_int("intermediate_size");
  v.patch_size = r.aliased_int_or("patch_size", "spatial_patch_size", 16);
  v.hidden_act = r.string_or("hidden_act", "gelu_pytorch_tanh");
  v.num_position_embeddings = r.int_or("num_position_embeddings", 2304);
  v.deepstack_visual_indexes = r.int_list_or("deepstack_visual_indexes", {8, 16, 24});
}

nlohmann::json write_vision(const QwenVisionConfig& v) {
  return {{"hidden_size", v.embed_dim},
          {"out_hidden_size", v.hidden_size},
          {"intermediate_size", v.intermediate_size},
          {"in_channels", v.in_channels},
          {"patch_size", v.patch_size},
          {"hidden_act", v.hidden_act},
          {"num_position_embeddings", v.num_position_embeddings},
          {"deepstack_visual_indexes", v.deepstack_visual_indexes}};
}

void tiny_vision(QwenVisionConfig& v) {
  v.intermediate_size = 48;
  v.patch_size = 4;
  v.hidden_act = "gelu_pytorch_tanh";
  v.num_position_embeddings = 16;  // a 4x4 table: grids other than 4x4 interpolate
  v.depth = 3;                     // DeepStack after blocks 1 and 2: list position, block index and LM layer all differ
  v.deepstack_visual_indexes = {1, 2};
}

}  // namespace

const QwenFamilySpec& qwen3_vl_family() {
  static const QwenFamilySpec spec = {QwenFamily::kQwen3Vl,
                                      "qwen3_vl",
                                      "Qwen3VLForConditionalGeneration",
                                      "Qwen3-VL",
                                      /*vision_rms_norm=*/false,
                                      /*vision_gated_mlp=*/false,
                                      /*patch_embed_bias=*/true,
                                      /*learned_position_table=*/true,
                                      /*window_attention=*/false,
                                      /*deepstack=*/true,
                                      "mlp.linear_fc1",
                                      nullptr,
                                      "mlp.linear_fc2",
                                      "merger.norm",
                                      "merger.linear_fc1",
                                      "merger.linear_fc2",
                                      "vision_config.hidden_size",
                                      "vision_config.out_hidden_size",
                                      /*image_frames_share_time=*/false,
                                      /*qwen3_text=*/true,
                                      /*default_rope_theta=*/5000000.0,
                                      /*default_rms_norm_eps=*/1e-6,
                                      /*default_max_position_embeddings=*/128000,
                                      read_vision,
                                      write_vision,
                                      /*nested_text_config=*/true,
                                      tiny_vision};
  return spec;
}

}  // namespace vlmgen::detail
