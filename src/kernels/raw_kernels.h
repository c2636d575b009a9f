#pragma once

// The kernels on raw pointers, one set per instruction set. The files that define them are
// compiled with their instruction set enabled and include nothing but this header, the
// intrinsics and kernels_impl.h, so no inline function of another library is ever compiled there
// with instructions the running CPU may lack.

#include <cstdint>

namespace vlmgen::kernels::raw {

enum class WeightType { kF32, kBF16, kF16 };

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
  int64_t out_end;  // outputs past this one are not this call's (no prefetch beyond them)
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
  float* scores;  // scratch of `keys` floats
};

void rows_linear_portable(const RowsLinear& a, int64_t o_begin, int64_t o_end);
void rows_linear_avx2(const RowsLinear& a, int64_t o_begin, int64_t o_end);
void rows_linear_avx512(const RowsLinear& a, int64_t o_begin, int64_t o_end);

void widen_portable(const void* src, WeightType type, float* dst, int64_t begin, int64_t end);
void widen_avx2(const void* src, WeightType type, float* dst, int64_t begin, int64_t end);
void widen_avx512(const void* src, WeightType type, float* dst, int64_t begin, int64_t end);

void attention_portable(const HeadGroupAttention& a);
void attention_avx2(const HeadGroupAttention& a);
void attention_avx512(const HeadGroupAttention& a);

}  // namespace vlmgen::kernels::raw
