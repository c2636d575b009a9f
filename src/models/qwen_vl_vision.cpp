// The Qwen-VL vision tower: patch embedding (plus Qwen3-VL's learned positions, interpolated to
// each grid), ViT blocks with 2-D rotary attention inside each frame (or inside windows,
// Qwen2.5-VL), the patch merger that turns merge x merge patches into one LM token, and Qwen3-VL's
// DeepStack mergers on intermediate blocks.

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "qwen_family.h"
#include "qwen_vl_ops.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/kernels/cpu.h"
#include "vlmgen/models/qwen_vl.h"

namespace vlmgen {
namespace {

using Grids = std::vector<std::array<int64_t, 3>>;
using Segments = std::vector<std::pair<int64_t, int64_t>>;  // (first row, rows)

/// (h, w) patch coordinates of every pixel row, in the order the processor emits patches: each
/// frame walks merge windows row-major and the merge x merge patches inside a window row-major.
std::pair<std::vector<int64_t>, std::vector<int64_t>> patch_coordinates(const Grids& grids, int64_t merge) {
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

/// Qwen2.5-VL's window layout. Each frame's grid of merged tokens is cut into `side` x `side`
/// windows from the top-left (the last row and column of windows may be partial); `order` lists
/// the merged tokens window by window (row-major inside a window), and `windows` the merged
/// tokens each window holds, in that order. Frames stay contiguous, so per-frame attention works
/// on the reordered rows as well.
struct WindowPlan {
  std::vector<int64_t> order;
  std::vector<int64_t> windows;
};

WindowPlan window_plan(const Grids& grids, int64_t merge, int64_t side) {
  WindowPlan plan;
  int64_t base = 0;
  for (const auto& [t, h, w] : grids) {
    const int64_t gh = h / merge;
    const int64_t gw = w / merge;
    for (int64_t f = 0; f < t; ++f) {
      for (int64_t r0 = 0; r0 < gh; r0 += side) {
        for (int64_t c0 = 0; c0 < gw; c0 += side) {
          const int64_t r1 = std::min(gh, r0 + side);
          const int64_t c1 = std::min(gw, c0 + side);
          for (int64_t r = r0; r < r1; ++r) {
            for (int64_t c = c0; c < c1; ++c) plan.order.push_back(base + (f * gh + r) * gw + c);
          }
          plan.windows.push_back((r1 - r0) * (c1 - c0));
        }
      }
    }
    base += t * gh * gw;
  }
  return plan;
}

at::Tensor activation(const at::Tensor& x, const std::string& name) {
  if (name == "quick_gelu") {
    if (at::GradMode::is_enabled() && x.requires_grad()) return x * at::sigmoid(1.702 * x);
    at::Tensor y = x.mul(1.702);  // the same values, one [N, mlp] tensor instead of three
    return y.sigmoid_().mul_(x);
  }
  if (name == "silu") return at::silu(x);
  if (name == "gelu_pytorch_tanh") return at::gelu(x, "tanh");
  return at::gelu(x);
}

/// LayerNorm, or RMSNorm when the norm has no bias.
at::Tensor apply_norm(const at::Tensor& x, const qwen_vl::LayerNorm& norm, double eps) {
  if (norm.bias.defined()) return detail::apply_layer_norm(x, norm, eps);
  return detail::apply_rms_norm(x, norm.weight, eps);
}

/// Qwen3-VL: the learned side x side position table sampled bilinearly at each image's
/// h x w patch grid (corners aligned: linspace(0, side - 1, n) along each axis), repeated over the
/// frames, in the processor's patch order. [sum of patches, embed_dim].
at::Tensor interpolated_positions(const at::Tensor& table, const Grids& grids, int64_t merge) {
  const int64_t entries = table.size(0);
  int64_t side = 1;
  while (side * side < entries) ++side;
  const int64_t e = table.size(1);
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(table.device());
  std::vector<at::Tensor> parts;
  for (const auto& [t, h, w] : grids) {
    // Coordinates, their floor and ceil cells, and the fractional parts, in float32 as HF does.
    auto axis = [&](int64_t n) {
      at::Tensor coord = at::linspace(0.0, static_cast<double>(side - 1), n, fopts);
      at::Tensor lo = coord.to(at::kLong);
      at::Tensor hi = (lo + 1).clamp_max(side - 1);
      return std::array<at::Tensor, 3>{lo, hi, coord - lo.to(at::kFloat)};
    };
    auto [h_lo, h_hi, dh] = axis(h);
    auto [w_lo, w_hi, dw] = axis(w);
    auto corner = [&](const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& weight) {
      at::Tensor index = (rows.unsqueeze(1) * side + cols.unsqueeze(0)).reshape({-1});
      return table.index_select(0, index) * weight.reshape({-1, 1});
    };
    at::Tensor one_h = 1 - dh;
    at::Tensor one_w = 1 - dw;
    at::Tensor grid = corner(h_lo, w_lo, one_h.unsqueeze(1) * one_w.unsqueeze(0)) +
                      corner(h_lo, w_hi, one_h.unsqueeze(1) * dw.unsqueeze(0)) +
                      corner(h_hi, w_lo, dh.unsqueeze(1) * one_w.unsqueeze(0)) +
                      corner(h_hi, w_hi, dh.unsqueeze(1) * dw.unsqueeze(0));  // [h * w, e], row-major
    grid = grid.view({h / merge, merge, w / merge, merge, e}).permute({0, 2, 1, 3, 4}).reshape({h * w, e});
    parts.push_back(t == 1 ? grid : grid.repeat({t, 1}));
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
}

/// Query rows per chunk of a segment's attention: [heads, 128, rows] scores at a time.
constexpr int64_t kQueryChunk = 128;

/// Attention of `q`, `k`, `v` [N, heads, head_dim] within each segment of rows: [N, heads * head_dim].
/// In chunks of query rows, so the scores stay small (a 448x448 picture's 1024 patches and 6
/// heads made three 25 MB tensors per layer: scores, scaled, softmaxed; each freshly mapped and
/// faulted in): the bench's
/// image time to first token (100M model, 4-layer tower, that picture) went from 0.71 to 0.60-0.64
/// s, 64 or 256 rows within the noise of 128.
at::Tensor segment_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Segments& segments,
                             double scale) {
  std::vector<at::Tensor> outputs;
  const int64_t width = q.size(1) * q.size(2);
  for (const auto& [first, rows] : segments) {
    // Contiguous once per segment: strided operands would be copied by every chunk's product.
    const at::Tensor kt = k.narrow(0, first, rows).permute({1, 2, 0}).contiguous();  // [heads, head_dim, rows]
    const at::Tensor vf = v.narrow(0, first, rows).transpose(0, 1).contiguous();     // [heads, rows, head_dim]
    for (int64_t c0 = 0; c0 < rows; c0 += kQueryChunk) {
      const int64_t n = std::min(kQueryChunk, rows - c0);
      const at::Tensor qf = q.narrow(0, first + c0, n).transpose(0, 1);  // [heads, n, head_dim]
      at::Tensor probs = at::matmul(qf, kt);
      kernels::scaled_softmax_into(probs, scale);
      outputs.push_back(at::matmul(probs, vf).transpose(0, 1).reshape({n, width}));
    }
  }
  return outputs.size() == 1 ? outputs[0] : at::cat(outputs, 0);
}

}  // namespace

at::Tensor QwenVl::run_vision_tower(const VisionInputs& vision) {
  const QwenVisionConfig& vc = config_.vision;
  const detail::QwenFamilySpec& spec = detail::family_spec(config_.family);
  VLMGEN_CHECK(vision.layout == VisionLayout::kPatchFlattened,
               "{} takes patch-flattened vision inputs (pixel_values [patches, patch_dim] + image_grid_thw)",
               spec.display_name);
  vision.validate(vc.spatial_merge_size);
  VLMGEN_CHECK(vision.pixel_values.defined() && vision.num_images() > 0, "the vision tower needs at least one image");
  const Grids grids = vision.grids();
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
  const int64_t merge = vc.spatial_merge_size;
  const int64_t unit = merge * merge;  // patch rows per merged token
  const double eps = 1e-6;

  // Conv3d with kernel == stride over a patch that is already one kernel's worth of pixels is a
  // matmul with the flattened kernel ([C, tp, p, p] is the row layout the processor uses).
  at::Tensor x = kernels::linear(vision.pixel_values.to(dev, at::kFloat), vision_.patch_embed.reshape({e, patch_dim}));
  if (vision_.patch_embed_bias.defined()) x = x + vision_.patch_embed_bias;
  if (vision_.position_table.defined()) x = x + interpolated_positions(vision_.position_table, grids, merge);
  const int64_t n = x.size(0);
  auto [hpos, wpos] = patch_coordinates(grids, merge);

  // Qwen2.5-VL works on the rows window by window: reorder merged tokens (unit rows each) so
  // every window is contiguous, and undo it after the merger.
  Segments frames;  // attention per frame (HF cu_seqlens: h*w repeated t times)
  int64_t row = 0;
  for (const auto& [t, h, w] : grids) {
    for (int64_t f = 0; f < t; ++f, row += h * w) frames.emplace_back(row, h * w);
  }
  Segments windows;
  at::Tensor order;
  if (spec.window_attention) {
    const WindowPlan plan = window_plan(grids, merge, vc.window_size / (vc.patch_size * merge));
    order = at::tensor(plan.order, at::kLong);
    x = x.view({n / unit, unit, e}).index_select(0, order.to(dev)).view({n, e});
    std::vector<int64_t> h2(hpos.size());
    std::vector<int64_t> w2(wpos.size());
    for (size_t i = 0; i < plan.order.size(); ++i) {
      for (int64_t j = 0; j < unit; ++j) {
        h2[i * unit + j] = hpos[plan.order[i] * unit + j];
        w2[i * unit + j] = wpos[plan.order[i] * unit + j];
      }
    }
    hpos = std::move(h2);
    wpos = std::move(w2);
    row = 0;
    for (int64_t tokens : plan.windows) {
      windows.emplace_back(row, tokens * unit);
      row += tokens * unit;
    }
  }

  // 2-D rotary: the first half of each head's rotary frequencies follows h, the second w.
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
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));

  // merge x merge rows -> one token; `after_shuffle` normalizes the concatenated rows (DeepStack).
  auto run_merger = [&](const at::Tensor& in, const qwen_vl::PatchMerger& m, bool after_shuffle) {
    at::Tensor y = after_shuffle ? apply_norm(in.reshape({n / unit, e * unit}), m.norm, eps)
                                 : apply_norm(in, m.norm, eps).reshape({n / unit, e * unit});
    return detail::apply_row_parallel(at::gelu(detail::apply_linear(y, m.fc1)), m.fc2, comm);
  };

  std::vector<at::Tensor> outputs(1);  // the merger's output first, then the DeepStack features
  const std::vector<int64_t>& deepstack_at = vc.deepstack_visual_indexes;
  const std::vector<int64_t>& full_at = vc.fullatt_block_indexes;
  for (size_t i = 0; i < vision_.blocks.size(); ++i) {
    const qwen_vl::VisionBlock& blk = vision_.blocks[i];
    const bool full = !spec.window_attention || std::count(full_at.begin(), full_at.end(), int64_t(i)) > 0;
    at::Tensor h = apply_norm(x, blk.norm1, eps);
    at::Tensor qkv = detail::apply_linear(h, blk.qkv).view({n, 3, heads, head_dim});
    at::Tensor q = detail::apply_rotary(qkv.select(1, 0), cos, sin);  // [N, heads, head_dim]
    at::Tensor k = detail::apply_rotary(qkv.select(1, 1), cos, sin);
    at::Tensor attn = segment_attention(q, k, qkv.select(1, 2), full ? frames : windows, scale);
    x = x + detail::apply_row_parallel(attn, blk.proj, comm);
    h = apply_norm(x, blk.norm2, eps);
    at::Tensor inner = activation(detail::apply_linear(h, blk.fc1), vc.hidden_act);
    if (blk.up.weight.defined()) inner = inner * detail::apply_linear(h, blk.up);  // SwiGLU
    x = x + detail::apply_row_parallel(inner, blk.fc2, comm);
    auto ds = std::find(deepstack_at.begin(), deepstack_at.end(), int64_t(i));
    if (ds != deepstack_at.end()) outputs.push_back(run_merger(x, vision_.deepstack[ds - deepstack_at.begin()], true));
  }
  outputs[0] = run_merger(x, vision_.merger, false);
  at::Tensor merged = outputs.size() == 1 ? outputs[0] : at::cat(outputs, 1);
  if (order.defined()) {
    at::Tensor inverse = at::empty_like(order);
    inverse.index_put_({order}, at::arange(order.size(0), order.options()));
    merged = merged.index_select(0, inverse.to(dev));
  }
  ++vision_tower_calls_;
  return merged;  // [sum_i t_i*h_i*w_i / merge^2, hidden * (1 + DeepStack features)], float32
}

}  // namespace vlmgen
