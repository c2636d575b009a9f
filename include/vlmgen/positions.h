#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"

namespace vlmgen {

/// Position ids of a request's prompt, and how to continue them for generated tokens.
/// Kept per request in the generator's sequence state (never on the model), so two requests
/// with different images never share a stale rope delta.
struct RopePlan {
  /// [B, L] (1-D rotary) or [3, B, L] (M-RoPE: t, h, w), int64, CPU. Columns are those of the
  /// left-padded prompt; padding columns hold any value (they are masked).
  at::Tensor prompt_positions;
  /// [B]: the position of a token generated at column c of row b is c - pad_b + delta[b] on
  /// every axis (pad_b = left padding of row b). 0 for 1-D rotary.
  std::vector<int64_t> delta;
};

/// 1-D positions from a left-padding mask ([B, L], 1 real, 0 padding): 0, 1, 2, ... over the
/// real tokens of each row; padding gets 1 (never read through the mask).
inline RopePlan plan_1d_positions(const at::Tensor& attention_mask) {
  VLMGEN_CHECK(attention_mask.dim() == 2, "attention_mask must be [B, L], got {}", detail::shape_str(attention_mask));
  at::Tensor m = attention_mask.to(at::kCPU, at::kLong);
  at::Tensor pos = m.cumsum(1) - 1;
  pos.masked_fill_(m == 0, 1);
  return {pos, std::vector<int64_t>(static_cast<size_t>(m.size(0)), 0)};
}

/// Position ids for all `total` columns (prompt then generated) of a left-padded batch:
/// [B, total] or [3, B, total], int64, CPU. `pads[b]` is row b's left padding.
inline at::Tensor extend_positions(const RopePlan& plan, const std::vector<int64_t>& pads, int64_t total) {
  const at::Tensor& p = plan.prompt_positions;
  VLMGEN_CHECK(p.defined() && (p.dim() == 2 || (p.dim() == 3 && p.size(0) == 3)),
               "prompt positions must be [B, L] or [3, B, L], got {}", detail::shape_str(p));
  const int64_t b = p.size(p.dim() - 2);
  const int64_t l = p.size(p.dim() - 1);
  VLMGEN_CHECK(static_cast<int64_t>(pads.size()) == b && static_cast<int64_t>(plan.delta.size()) == b,
               "position plan for {} rows got {} paddings and {} deltas", b, pads.size(), plan.delta.size());
  VLMGEN_CHECK(total >= l, "cannot extend {} prompt positions to {}", l, total);
  if (total == l) return p.to(at::kLong).contiguous();
  // column c of row b: c - pad_b + delta_b
  at::Tensor cols = at::arange(l, total, at::kLong).unsqueeze(0).expand({b, total - l});
  std::vector<int64_t> shift(static_cast<size_t>(b));
  for (int64_t r = 0; r < b; ++r) shift[r] = plan.delta[r] - pads[r];
  at::Tensor gen = cols + at::tensor(shift, at::kLong).unsqueeze(1);
  if (p.dim() == 3) gen = gen.unsqueeze(0).expand({3, b, total - l});
  return at::cat({p.to(at::kLong), gen}, -1).contiguous();
}

}  // namespace vlmgen
