#pragma once

// The decoder layers of a Qwen-family decode step on the CPU as one pass over buffers this
// module owns (private to src/models). Op by op, a step made about 80 ATen calls and a dozen
// tensors per layer, 1-2 ms of a 10 ms FP8 step of the 100M config; here each layer is the
// kernels' own loops (src/kernels/kernels_internal.h), the window's keys and values written
// straight into the KV cache. Same arithmetic as the op-by-op path: RMSNorm, rotary, the
// linears, the gated product and attention are the same functions, so the two agree bit for
// bit (VLMGEN_FUSED_DECODE=0 runs the layers op by op).

#include <ATen/ATen.h>

#include <vector>

#include "vlmgen/inference_context.h"
#include "vlmgen/models/qwen_vl.h"

namespace vlmgen::detail {

/// One request's rows in a fused decode step: `rows` rows of the step's stream from `first_row`,
/// one new column each, over `context` (its rows are the request's rows).
struct FusedDecodeRows {
  InferenceContext* context = nullptr;
  int64_t first_row = 0;
  int64_t rows = 0;
  at::Tensor key_real;  // [rows, context length + 1], bool or uint8: the key is not padding
};

/// Whether this step can run fused: the CPU kernels on (kernels::enabled()), float32 hidden
/// states that autograd does not record, every row one column over a float32 CPU KV cache
/// whose length is the window's start, at most the kernels' row count, and every decoder weight
/// one the kernels read. Otherwise the caller runs the layers op by op.
bool fused_decode_fits(const qwen_vl::LanguageModel& lm, const QwenVlConfig& c, const at::Tensor& hidden,
                       const std::vector<FusedDecodeRows>& requests);

/// Runs every decoder layer on `hidden` (T rows of hidden floats) for the step's T rows, with
/// rotary cos and sin of each row (T x head_dim floats each, e.g. [B, 1, 1, head_dim]), appending
/// each layer's keys and values to the requests' caches: the residual stream after the last
/// layer, [T, hidden]. Only for arguments fused_decode_fits accepted (it checks the caches'
/// room, layout and key masks, which this does not check again).
at::Tensor fused_decode_layers(const qwen_vl::LanguageModel& lm, const QwenVlConfig& c, const at::Tensor& hidden,
                               const at::Tensor& cos, const at::Tensor& sin,
                               const std::vector<FusedDecodeRows>& requests);

}  // namespace vlmgen::detail
