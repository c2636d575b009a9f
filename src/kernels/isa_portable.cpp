// The kernels in plain C++ (8-float blocks the compiler may vectorize with the baseline
// instruction set): the path for CPUs without AVX2 and the reference the other paths are
// compared with.

#include "attention_impl.h"
#include "gemm_impl.h"
#include "rows_impl.h"

namespace vlmgen::kernels::raw {
namespace {

struct Portable {
  struct V {
    float lane[8];
  };
  static constexpr int64_t kLanes = 8;
  static constexpr int kOutTile = 4;
  static constexpr int kRowTile = 2;
  static constexpr int kF32RowTile = 2;
  static constexpr int kGemmOutTile = 4;
  static constexpr int kGemmRowTile = 2;
  template <WeightType T>
  static constexpr int64_t kStreamRows = 0;  // tiles of kOutTile outputs always
  static constexpr bool kWholeLines = false;
  static constexpr bool kLaneSums = false;  // no lane_sums(): decode attention sums key by key
  static V zero() { return V{}; }
  static void in_register(V&) {}  // see isa_avx512.cpp
  static V set1(float f) {
    V v;
    for (float& x : v.lane) x = f;
    return v;
  }
  static V load(const float* p) {
    V v;
    for (int i = 0; i < 8; ++i) v.lane[i] = p[i];
    return v;
  }
  static V load_bf16(const uint16_t* p) {
    V v;
    for (int i = 0; i < 8; ++i) v.lane[i] = bf16_to_float(p[i]);
    return v;
  }
  static V load_f16(const uint16_t* p) {
    V v;
    for (int i = 0; i < 8; ++i) v.lane[i] = f16_to_float(p[i]);
    return v;
  }
  static V load_e4m3(const uint8_t* p) {
    V v;
    for (int i = 0; i < 8; ++i) v.lane[i] = f16_to_float(fp8_half_bits(p[i], WeightType::kE4M3));
    return v;
  }
  static V load_e5m2(const uint8_t* p) {
    V v;
    for (int i = 0; i < 8; ++i) v.lane[i] = f16_to_float(fp8_half_bits(p[i], WeightType::kE5M2));
    return v;
  }
  static V fma(V a, V b, V acc) {
    for (int i = 0; i < 8; ++i) acc.lane[i] += a.lane[i] * b.lane[i];
    return acc;
  }
  static float sum(V v) {
    float s = 0.0f;
    for (float x : v.lane) s += x;
    return s;
  }
  static void store(float* p, V v) {
    for (int i = 0; i < 8; ++i) p[i] = v.lane[i];
  }
  static V exp(V v) {
    for (float& x : v.lane) x = expf(x < kExpLowest ? kExpLowest : x);
    return v;
  }
  static V neg_abs(V v) {
    for (float& x : v.lane) x = -fabsf(x);
    return v;
  }
  static V div(V a, V b) {
    for (int i = 0; i < 8; ++i) a.lane[i] /= b.lane[i];
    return a;
  }
  static V max(V a, V b) {  // as maxps: b where either is NaN
    for (int i = 0; i < 8; ++i) a.lane[i] = a.lane[i] > b.lane[i] ? a.lane[i] : b.lane[i];
    return a;
  }
  static V select_negative(V c, V a, V b) {
    for (int i = 0; i < 8; ++i) b.lane[i] = c.lane[i] < 0 ? a.lane[i] : b.lane[i];
    return b;
  }
};

}  // namespace

void rows_linear_portable(const RowsLinear& a, int64_t o_begin, int64_t o_end) {
  rows_linear<Portable>(a, o_begin, o_end);
}
void attention_portable(const HeadGroupAttention& a) { attention<Portable>(a); }
void gemm_portable(const RowsLinear& a, int64_t o_begin, int64_t o_end) { gemm<Portable>(a, o_begin, o_end); }
void widen_portable(const WidenArgs& a, int64_t begin, int64_t end) { widen<Portable>(a, begin, end); }
void silu_mul_portable(const float* gate, const float* up, float* y, int64_t n) { silu_mul<Portable>(gate, up, y, n); }
void scaled_softmax_portable(float* x, int64_t rows, int64_t n, float scale) {
  scaled_softmax<Portable>(x, rows, n, scale);
}

}  // namespace vlmgen::kernels::raw
