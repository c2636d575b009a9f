// The Qwen2-VL vision tower: patch embedding, ViT blocks with 2-D rotary attention inside each
// frame, and the patch merger that turns merge x merge patches into one LM token.

#include <array>
#include <cmath>
#include <utility>
#include <vector>

#include "qwen2_vl_ops.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/models/qwen2_vl.h"

namespace vlmgen {
namespace {

/// (h, w) patch coordinates of every pixel row, in the order the processor emits patches: each
/// frame walks merge windows row-major and the merge x merge patches inside a window row-major.
std::pair<std::vector<int64_t>, std::vector<int64_t>> patch_coordinates(
    const std::vector<std::array<int64_t, 3>>& grids, int64_t merge) {
  std::vector<int64_t> hpos;
  std::vector<int64_t> wpos;
  for (const auto& [t, h, w] : grids) {
    for (int64_t frame = 0; frame < t; ++frame) {
      for (int64_t wh = 0; wh < h / merge; ++wh) {
        for (int64_t ww = 0; ww < w / merge; ++ww) {
          for (int64_t ih = 0; ih < merge; ++ih) {
            for (int64_t iw = 0; iw < merge; ++iw) {
              hpos.push_back(wh * merge + ih);
              wpos.push_back(ww * merge + iw);
            }
          }
        }
      }
    }
  }
  return {hpos, wpos};
}

at::Tensor activation(const at::Tensor& x, const std::string& name) {
  if (name == "quick_gelu") return x * at::sigmoid(1.702 * x);
  return at::gelu(x);
}

}  // namespace

at::Tensor Qwen2Vl::run_vision_tower(const VisionInputs& vision) {
  const QwenVisionConfig& vc = config_.vision;
  VLMGEN_CHECK(vision.layout == VisionLayout::kPatchFlattened,
               "Qwen2-VL takes patch-flattened vision inputs (pixel_values [patches, patch_dim] + image_grid_thw)");
  vision.validate(vc.spatial_merge_size);
  VLMGEN_CHECK(vision.pixel_values.defined() && vision.num_images() > 0, "the vision tower needs at least one image");
  const std::vector<std::array<int64_t, 3>> grids = vision.grids();
  const int64_t patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size * vc.patch_size;
  VLMGEN_CHECK(vision.pixel_values.size(1) == patch_dim,
               "pixel_values rows must have {} values (channels {} x temporal {} x {} x {}), got {}", patch_dim,
               vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size, vision.pixel_values.size(1));

  const at::Device dev = device();
  const int64_t e = vc.embed_dim;
  const int64_t head_dim = e / vc.num_heads;
  // Sharded: this rank computes num_heads / tp heads and its slice of each MLP; replicated:
  // everything, with no communication.
  Communicator* comm = vision_sharded_ ? tp_comm_ : nullptr;
  const int64_t heads = vc.num_heads / (vision_sharded_ ? parallel_.tp_size() : 1);
  const int64_t local_e = heads * head_dim;
  const int64_t merge = vc.spatial_merge_size;
  const double eps = 1e-6;

  // Conv3d with kernel == stride over a patch that is already one kernel's worth of pixels is a
  // matmul with the flattened kernel ([C, tp, p, p] is the row layout the processor uses).
  at::Tensor x = at::matmul(vision.pixel_values.to(dev, at::kFloat), vision_.patch_embed.reshape({e, patch_dim}).t());
  const int64_t n = x.size(0);

  // 2-D rotary: the first half of each head's rotary frequencies follows h, the second w.
  auto [hpos, wpos] = patch_coordinates(grids, merge);
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(dev);
  const int64_t rotary_dim = head_dim / 2;
  at::Tensor inv_freq =
      at::pow(10000.0, at::arange(0, rotary_dim, 2, fopts) / static_cast<double>(rotary_dim)).reciprocal();
  at::Tensor h_angles = at::tensor(hpos, at::kLong).to(dev, at::kFloat).unsqueeze(1) * inv_freq;
  at::Tensor w_angles = at::tensor(wpos, at::kLong).to(dev, at::kFloat).unsqueeze(1) * inv_freq;
  at::Tensor angles = at::cat({h_angles, w_angles}, 1);  // [N, head_dim / 2]
  angles = at::cat({angles, angles}, 1);                 // [N, head_dim]
  at::Tensor cos = angles.cos().unsqueeze(1);            // [N, 1, head_dim]
  at::Tensor sin = angles.sin().unsqueeze(1);

  // Attention stays inside each frame of each image (HF cu_seqlens: h*w repeated t times).
  std::vector<std::pair<int64_t, int64_t>> frames;  // (first row, rows)
  int64_t row = 0;
  for (const auto& [t, h, w] : grids) {
    for (int64_t f = 0; f < t; ++f, row += h * w) frames.emplace_back(row, h * w);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));

  for (const qwen2_vl::VisionBlock& blk : vision_.blocks) {
    at::Tensor h = detail::apply_layer_norm(x, blk.norm1, eps);
    at::Tensor qkv = detail::apply_linear(h, blk.qkv).view({n, 3, heads, head_dim});
    at::Tensor q = detail::apply_rotary(qkv.select(1, 0), cos, sin);  // [N, heads, head_dim]
    at::Tensor k = detail::apply_rotary(qkv.select(1, 1), cos, sin);
    at::Tensor v = qkv.select(1, 2);
    std::vector<at::Tensor> outputs;
    outputs.reserve(frames.size());
    for (const auto& [first, rows] : frames) {
      at::Tensor qf = q.narrow(0, first, rows).transpose(0, 1);  // [heads, rows, head_dim]
      at::Tensor kf = k.narrow(0, first, rows).transpose(0, 1);
      at::Tensor vf = v.narrow(0, first, rows).transpose(0, 1);
      at::Tensor probs = at::softmax(at::matmul(qf, kf.transpose(1, 2)) * scale, -1);
      outputs.push_back(at::matmul(probs, vf).transpose(0, 1).reshape({rows, local_e}));
    }
    at::Tensor attn = outputs.size() == 1 ? outputs[0] : at::cat(outputs, 0);
    x = x + detail::apply_row_parallel(attn, blk.proj, comm);
    h = detail::apply_layer_norm(x, blk.norm2, eps);
    x = x + detail::apply_row_parallel(activation(detail::apply_linear(h, blk.fc1), vc.hidden_act), blk.fc2, comm);
  }

  // Merger: consecutive merge^2 rows are one merge window, concatenated into one LM token.
  at::Tensor merged = detail::apply_layer_norm(x, vision_.ln_q, eps).reshape({n / (merge * merge), e * merge * merge});
  merged =
      detail::apply_row_parallel(at::gelu(detail::apply_linear(merged, vision_.merger_fc1)), vision_.merger_fc2, comm);
  ++vision_tower_calls_;
  return merged;  // [sum_i t_i*h_i*w_i / merge^2, hidden], float32
}

}  // namespace vlmgen
