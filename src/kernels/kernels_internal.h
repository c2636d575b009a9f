#pragma once

// The kernels on buffers the caller owns (private to src/): what kernels::linear, rms_norm,
// rotary and decode_attention run after their checks, and what the fused CPU decode step
// (src/models/fused_decode.cpp) calls directly, so that a decode step makes no tensor per
// operation. Same arithmetic either way: a fused step and an op-by-op step agree bit for bit
// where they share a function here.

#include <ATen/ATen.h>

#include <cstdint>
#include <initializer_list>

#include "raw_kernels.h"
#include "vlmgen/kernels/cpu.h"

namespace vlmgen::kernels::internal {

/// The CPU reports the path's instructions and this build compiled them (asked once per path).
bool cpu_has(Isa isa);
/// Floats on whole 64-byte lines (the kernels' 64-byte loads of a row whose width is a multiple
/// of 16 floats never straddle two; std::vector<float>'s storage from malloc is 16-byte aligned:
/// a 16-row f32 decode step of the bench's 100M model took 58.8 ms on such rows, 55.4 aligned).
/// Grown only, and then neither copied nor zeroed: its users write every float before they read it.
class AlignedFloats {
 public:
  AlignedFloats() = default;
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  ~AlignedFloats();
  float* data() { return data_; }
  /// At least n floats.
  void resize(size_t n);

 private:
  float* data_ = nullptr;
  size_t size_ = 0;
};

/// True when autograd would record an operation on any of `tensors`.
bool needs_grad(std::initializer_list<const at::Tensor*> tensors);
/// What linear() sends to the kernels: float32 x, a contiguous 2-D float32/bfloat16/float16 CPU
/// weight (or uint8 FP8 bytes with scales), a float32 CPU bias or none.
bool kernel_fits(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const Fp8Scales& fp8);
/// kernel_fits for the weight, bias and scales alone.
bool weight_fits(const at::Tensor& weight, const at::Tensor& bias, const Fp8Scales& fp8);
/// The scale grid of FP8 weight `w`, checked against its shape (a vlmgen::Error naming both
/// otherwise), contiguous; undefined without FP8.
at::Tensor checked_fp8_grid(const at::Tensor& w, const Fp8Scales& fp8);

/// y[r * ldy + o] = x[r * ldx + :] . weight[o, :] (+ bias[o]) for r < rows, on the ATen threads.
/// `grid` is checked_fp8_grid(weight, fp8); the weight passed kernel_fits.
void linear_rows(Isa isa, const float* x, int64_t ldx, int64_t rows, const at::Tensor& weight, const float* bias,
                 const at::Tensor& grid, const Fp8Scales& fp8, float* y, int64_t ldy);

/// The rows of x [..., in]: the product of its leading sizes (x.dim() >= 1; also when in is 0).
int64_t leading_rows(const at::Tensor& x);

/// The kernels' name for a weight's storage, and its FP8 scales on raw pointers (grid from
/// checked_fp8_grid).
raw::WeightType weight_type(const at::Tensor& w, const Fp8Scales& fp8);
raw::Fp8Scales raw_scales(const at::Tensor& grid, const Fp8Scales& fp8);
/// Rows [first, last) of `weight` as float32 (FP8: times their scales) into dst, on the ATen
/// threads.
void widen_rows(Isa isa, const at::Tensor& weight, const Fp8Scales& fp8, const at::Tensor& grid, int64_t first,
                int64_t last, float* dst);

/// The kernels of one path on raw pointers: outputs [begin, end) of a; elements (16-bit) or rows
/// (FP8) [begin, end) of a widened weight.
void run_rows_linear(Isa isa, const raw::RowsLinear& a, int64_t begin, int64_t end);
void run_widen(Isa isa, const raw::WidenArgs& a, int64_t begin, int64_t end);

/// a (FP8 weights, their scales `grid`) computed over the weights widened a chunk of outputs at a
/// time into a buffer each thread keeps, on the ATen threads.
void fp8_rows_widened(Isa isa, const raw::RowsLinear& a, const at::Tensor& weight, const at::Tensor& grid,
                      const Fp8Scales& fp8);

/// x [..., in] times a weight that passed kernel_fits and the shape checks, for many rows (many_rows.cpp): on the
/// GEMM tiles of `isa` when `tiles` (16-bit and FP8 weights widened a block of output rows at a
/// time into a buffer the thread keeps), else through ATen's GEMM on the widened blocks.
at::Tensor many_rows_linear(Isa isa, bool tiles, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            const Fp8Scales& fp8);

/// RMSNorm of `rows` rows of d floats: y = x / sqrt(mean(x^2) + eps) * (w + offset); y may be x.
void rms_norm_rows(const float* x, int64_t rows, int64_t d, const float* w, float eps, float offset, float* y);

/// HF's rotate_half rotary of one row of d floats: y = x * cos + rotate_half(x) * sin, each
/// product rounded, then the sum (as ATen's ops compute it). y must not overlap x.
void rotary_row(const float* x, const float* cos, const float* sin, int64_t d, float* y);

/// y = silu(gate) * up over n floats (y may be gate or up), on the ATen threads.
void silu_mul(Isa isa, const float* gate, const float* up, float* y, int64_t n);

/// softmax(x * scale) of each of `rows` rows of n floats, in place (scale > 0), on the ATen threads.
void scaled_softmax(Isa isa, float* x, int64_t rows, int64_t n, float scale);

/// One query column per batch row over a KV cache laid out [row, kv_head, key, width] (width dim,
/// or dim + 4 bytes for FP8): for each of
/// `rows` rows and kv_heads KV heads, the `heads / kv_heads` query heads of the group attend over
/// keys [0, keys) of that row (key_real[row * keys + j] nonzero: a real key; query sees keys
/// j <= first_query_key). q and out are [rows, heads, dim]. On the ATen threads.
struct CacheAttention {
  const float* q;
  float* out;
  int64_t rows, heads, kv_heads, dim;
  const float* k;  // key j of (row, head) at k + row * row_stride + head * head_stride + j * dim
  const float* v;  // likewise
  int64_t row_stride, head_stride;
  const uint8_t* key_real;
  int64_t keys;
  int64_t first_query_key;
  float scale;
  const uint16_t* k16;  // a bfloat16 cache instead of k and v (null for float32), laid out alike
  const uint16_t* v16;
  /// An FP8 cache instead (rows of dim + 4 bytes, HeadGroupAttention::k8): strides in bytes.
  const uint8_t* k8 = nullptr;
  const uint8_t* v8 = nullptr;
};
void attend_cache(Isa isa, const CacheAttention& a);

/// One (batch row, KV head) group on the chosen path.
void run_attention(Isa isa, const raw::HeadGroupAttention& a);

}  // namespace vlmgen::kernels::internal
