#pragma once

// Products of many rows by a float32 weight (a prefill's, the vision tower's; 16-bit and FP8
// weights are widened a block of output rows at a time first): y = x W^T + b with W [out, in]
// read in place, as ATen's GEMM would compute it but on tiles of this project's own. A tile holds
// Vec::kGemmOutTile outputs of Vec::kGemmRowTile rows in registers (AVX-512: 6 x 4 = 24
// accumulators; each step loads 4 input vectors and 6 weight vectors for 24 fused multiply-adds),
// and the outputs are taken in blocks whose weight rows stay in the core's L2 cache while every
// row tile passes over them. Each output is the same function of its row and weight row wherever
// it falls: vector partial sums along `in` in order, their sum (Vec::sum), the scalar tail, the
// bias. So a row's result does not depend on the other rows of the call, nor on the thread that
// computed it (kernels::linear sends calls of few rows to the decode kernels instead, which round
// differently).
//
// Included only by the instruction-set files (see raw_kernels.h).

#include <stdint.h>

#include "raw_kernels.h"

namespace vlmgen::kernels::raw {
namespace {  // each instruction-set file has its own copy (see kernels_impl.h)

/// Outputs [o, o + OT) of rows [r, r + RT) (a.wtype is kF32).
template <class Vec, int OT, int RT>
inline void gemm_tile(const RowsLinear& a, int64_t o, int64_t r) {
  using V = typename Vec::V;
  constexpr int64_t L = Vec::kLanes;
  const int64_t in = a.in, vector_end = in - in % L;
  const float* w = static_cast<const float*>(a.w) + o * in;
  const float* x = a.x + r * a.ldx;
  V acc[OT][RT];
  for (int oo = 0; oo < OT; ++oo)
    for (int rr = 0; rr < RT; ++rr) acc[oo][rr] = Vec::zero();
  for (int64_t i = 0; i < vector_end; i += L) {
    V xs[RT];
    for (int rr = 0; rr < RT; ++rr) xs[rr] = Vec::load(x + rr * a.ldx + i);
    for (int oo = 0; oo < OT; ++oo) {
      const V wv = Vec::load(w + oo * in + i);
      for (int rr = 0; rr < RT; ++rr) acc[oo][rr] = Vec::fma(wv, xs[rr], acc[oo][rr]);
    }
  }
  for (int oo = 0; oo < OT; ++oo) {
    for (int rr = 0; rr < RT; ++rr) {
      float s = Vec::sum(acc[oo][rr]);
      for (int64_t i = vector_end; i < in; ++i) s += w[oo * in + i] * x[rr * a.ldx + i];
      if (a.bias != nullptr) s += a.bias[o + oo];
      a.y[(r + rr) * a.ldy + o + oo] = s;
    }
  }
}

/// Outputs [o_begin, o_end) of rows [r, r + RT).
template <class Vec, int RT>
inline void gemm_outputs(const RowsLinear& a, int64_t o_begin, int64_t o_end, int64_t r) {
  constexpr int OT = Vec::kGemmOutTile;
  int64_t o = o_begin;
  for (; o + OT <= o_end; o += OT) gemm_tile<Vec, OT, RT>(a, o, r);
  for (; o < o_end; ++o) gemm_tile<Vec, 1, RT>(a, o, r);
}

/// Every row of a for outputs [o_begin, o_end), in blocks of outputs that stay in L2.
template <class Vec>
void gemm(const RowsLinear& a, int64_t o_begin, int64_t o_end) {
  constexpr int OT = Vec::kGemmOutTile, RT = Vec::kGemmRowTile;
  static_assert(RT >= 1 && RT <= 4, "row tiles of 1 to 4 rows");
  // No std::min / std::max here: inline functions of other headers must not be compiled with
  // this file's instructions (see raw_kernels.h).
  const int64_t row_bytes = a.in > 0 ? a.in * static_cast<int64_t>(sizeof(float)) : 1;
  const int64_t fitting = kGemmBlockBytes / row_bytes / OT * OT;
  const int64_t block = fitting > OT ? fitting : OT;
  for (int64_t first = o_begin; first < o_end; first += block) {
    const int64_t last = first + block < o_end ? first + block : o_end;
    int64_t r = 0;
    for (; r + RT <= a.rows; r += RT) gemm_outputs<Vec, RT>(a, first, last, r);
    switch (a.rows - r) {
      case 3:
        if constexpr (RT > 3) gemm_outputs<Vec, 3>(a, first, last, r);
        break;
      case 2:
        if constexpr (RT > 2) gemm_outputs<Vec, 2>(a, first, last, r);
        break;
      case 1:
        if constexpr (RT > 1) gemm_outputs<Vec, 1>(a, first, last, r);
        break;
      default: break;
    }
  }
}

}  // namespace
}  // namespace vlmgen::kernels::raw
