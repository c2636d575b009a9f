#pragma once

// The kernels on raw pointers, one set per instruction set. The files that define them are
// compiled with their instruction set enabled and include nothing but this header, the
// intrinsics, rows_impl.h (with kernels_impl.h), attention_impl.h and gemm_impl.h, so no inline function of another
// library is ever compiled there with instructions the running CPU may lack.

#include <cstdint>

namespace vlmgen::kernels::raw {

enum class WeightType { kF32, kBF16, kF16, kE4M3, kE5M2 };

/// The scales of an FP8 weight [out, in]: weight(o, i) = raw(o, i) * grid[(o / block_out) *
/// grid_cols + i / block_in] * factor, where raw is the byte read as a half (fp8_half_bits) and
/// factor 256 for E4M3, 1 for E5M2. block_in is a multiple of 16 (the widest vector), or
/// covers the whole row.
struct Fp8Scales {
  const float* grid = nullptr;
  int64_t grid_cols = 1;
  int64_t block_out = 1;
  int64_t block_in = 1;
  float factor = 1.0f;
};

/// y[r * ldy + o] = sum_i x[r * ldx + i] * W[o * in + i] (+ bias[o]) for r < rows and
/// o in [o_begin, o_end).
struct RowsLinear {
  const float* x;
  int64_t ldx;
  int64_t rows;
  const void* w;
  WeightType wtype;
  int64_t in;
  const float* bias;  // may be null
  float* y;
  int64_t ldy;
  int64_t out_end;          // outputs past this one are not this call's (no next tile fetched beyond them)
  Fp8Scales fp8;            // for kE4M3 / kE5M2 weights
  bool one_stream = false;  // the CPU reads few rows' weights faster as far-apart streams (AMD)
};

/// Widening weights to float32: `src` [rows, cols] of `type` into `dst`.
struct WidenArgs {
  const void* src;
  WeightType type;
  float* dst;  // holds the widened elements from dst_begin on
  int64_t cols;
  Fp8Scales fp8;
  int64_t dst_begin = 0;  // flat index (row x cols + col) of the weight that dst[0] receives
};

/// Attention for the query heads of one (batch row, KV head): q rows of `groups` heads x S
/// columns, K and V rows of `keys` keys, each `dim` floats.
struct HeadGroupAttention {
  const float* q;  // query (g, s) at q + (g * q_head_stride + s * dim)
  int64_t q_head_stride;
  const float* k;  // key j at k + j * kv_row_stride
  const float* v;
  int64_t kv_row_stride;
  const uint8_t* key_real;  // [keys], nonzero: a real key
  int64_t keys;
  int64_t groups;
  int64_t columns;          // S
  int64_t first_query_key;  // query column s sees keys j <= first_query_key + s
  int64_t dim;
  float scale;
  float* out;     // (g, s) at out + (g * q_head_stride + s * dim)
  float* scores;  // scratch of groups * keys floats
  /// A bfloat16 cache: keys and values as their bits, laid out as k and v (which are then unused).
  const uint16_t* k16;
  const uint16_t* v16;
  /// An FP8 cache: rows of dim E4M3 bytes and their float32 scale (encode_fp8_kv_row), key j at
  /// k8 + j * kv_row_stride (bytes); k, v, k16 and v16 are then unused.
  const uint8_t* k8 = nullptr;
  const uint8_t* v8 = nullptr;
};

/// Bytes after an FP8 cache row's dim bytes: its float32 scale.
constexpr int64_t kFp8RowScaleBytes = 4;

/// Whether the instruction-set files were compiled with their instructions (else they forward to
/// the portable code).
bool avx2_compiled();
bool avx512_compiled();

/// At least n floats of scratch for the calling thread, 64-byte aligned, valid until its next call
/// (kept between calls; defined outside the instruction-set files, whose inline code must not
/// reach other headers').
float* input_scratch(int64_t n);

void rows_linear_portable(const RowsLinear& a, int64_t o_begin, int64_t o_end);
void rows_linear_avx2(const RowsLinear& a, int64_t o_begin, int64_t o_end);
void rows_linear_avx512(const RowsLinear& a, int64_t o_begin, int64_t o_end);

/// Weight bytes per block of outputs that every row tile of gemm passes over: within the L2 of one
/// core (1 MiB on AMD Zen 4/5, 1.25-2 MiB on Intel since Ice Lake-SP, 256 KiB on older parts).
constexpr int64_t kGemmBlockBytes = int64_t{256} << 10;

/// Float32 weights only (a.wtype kF32), any row count: gemm_impl.h.
void gemm_portable(const RowsLinear& a, int64_t o_begin, int64_t o_end);
void gemm_avx2(const RowsLinear& a, int64_t o_begin, int64_t o_end);
void gemm_avx512(const RowsLinear& a, int64_t o_begin, int64_t o_end);

void widen_portable(const WidenArgs& a, int64_t begin, int64_t end);
void widen_avx2(const WidenArgs& a, int64_t begin, int64_t end);
void widen_avx512(const WidenArgs& a, int64_t begin, int64_t end);

/// y = silu(gate) * up over n floats (y may alias either input).
void silu_mul_portable(const float* gate, const float* up, float* y, int64_t n);
void silu_mul_avx2(const float* gate, const float* up, float* y, int64_t n);
void silu_mul_avx512(const float* gate, const float* up, float* y, int64_t n);

/// Each of `rows` rows of n floats at x = softmax(x * scale) in place (scale > 0).
void scaled_softmax_portable(float* x, int64_t rows, int64_t n, float scale);
void scaled_softmax_avx2(float* x, int64_t rows, int64_t n, float scale);
void scaled_softmax_avx512(float* x, int64_t rows, int64_t n, float scale);

void attention_portable(const HeadGroupAttention& a);
void attention_avx2(const HeadGroupAttention& a);
void attention_avx512(const HeadGroupAttention& a);

}  // namespace vlmgen::kernels::raw
