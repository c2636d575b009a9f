// Qwen2.5-VL: RMSNorm vision blocks with a SwiGLU MLP (gate/up/down, all with biases), window
// attention (window_size pixels, merged tokens reordered window by window and back after the
// merger) except at fullatt_block_indexes, an RMSNorm ln_q in the merger; the LM is Qwen2-VL's.
// config.json's vision_config calls the block width hidden_size and the merger's output
// out_hidden_size.

#include "../qwen_family.h"

namespace vlmgen::detail {
namespace {

void read_vision(const FieldReader& r, QwenVisionConfig& v) {
  v.embed_dim = r.required_int("hidden_size");
  v.hidden_size = r.required_int("out_hidden_size");
  v.intermediate_size = r.required_int("intermediate_size");
  v.patch_size = r.aliased_int_or("patch_size", "spatial_patch_size", 14);
  v.hidden_act = r.string_or("hidden_act", "silu");
  v.window_size = r.int_or("window_size", 112);
  v.fullatt_block_indexes = r.int_list_or("fullatt_block_indexes", {7, 15, 23, 31});
}

nlohmann::json write_vision(const QwenVisionConfig& v) {
  return {{"hidden_size", v.embed_dim},
          {"out_hidden_size", v.hidden_size},
          {"intermediate_size", v.intermediate_size},
          {"in_chans", v.in_channels},
          {"patch_size", v.patch_size},
          {"hidden_act", v.hidden_act},
          {"window_size", v.window_size},
          {"fullatt_block_indexes", v.fullatt_block_indexes}};
}

void tiny_vision(QwenVisionConfig& v) {
  v.intermediate_size = 48;
  v.patch_size = 4;
  v.hidden_act = "silu";
  v.window_size = 16;  // 16 px / (patch 4 * merge 2) = 2x2 merged tokens per window
  v.fullatt_block_indexes = {1};
}

}  // namespace

const QwenFamilySpec& qwen2_5_vl_family() {
  static const QwenFamilySpec spec = {QwenFamily::kQwen2_5Vl,
                                      "qwen2_5_vl",
                                      "Qwen2_5_VLForConditionalGeneration",
                                      "Qwen2.5-VL",
                                      /*vision_rms_norm=*/true,
                                      /*vision_gated_mlp=*/true,
                                      /*patch_embed_bias=*/false,
                                      /*learned_position_table=*/false,
                                      /*window_attention=*/true,
                                      /*deepstack=*/false,
                                      "mlp.gate_proj",
                                      "mlp.up_proj",
                                      "mlp.down_proj",
                                      "merger.ln_q",
                                      "merger.mlp.0",
                                      "merger.mlp.2",
                                      "vision_config.hidden_size",
                                      "vision_config.out_hidden_size",
                                      /*image_frames_share_time=*/true,
                                      /*qwen3_text=*/false,
                                      /*default_rope_theta=*/1000000.0,
                                      /*default_rms_norm_eps=*/1e-6,
                                      /*default_max_position_embeddings=*/128000,
                                      read_vision,
                                      write_vision,
                                      /*nested_text_config=*/false,
                                      tiny_vision};
  return spec;
}

}  // namespace vlmgen::detail
