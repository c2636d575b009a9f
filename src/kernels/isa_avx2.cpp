// The kernels with AVX2, FMA and F16C (8 floats a vector). Compiled with -mavx2 -mfma -mf16c;
// called only when the CPU reports all three.

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "attention_impl.h"
#include "gemm_impl.h"
#include "rows_impl.h"

namespace vlmgen::kernels::raw {
namespace {

struct Avx2 {
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr int kOutTile = 4;  // 4 x 2 accumulators + 2 inputs + 1 weight of 16 registers
  static constexpr int kRowTile = 2;
  static constexpr int kF32RowTile = 2;
  static constexpr int kGemmOutTile = 3;  // 3 x 3 accumulators + 3 inputs + 1 weight of 16 registers
  static constexpr int kGemmRowTile = 3;
  // Products of up to this many rows read the weights as far-apart streams (streams_rows): 1 row
  // of f32/bf16/f16 ran 1.6x faster so on an AMD EPYC (85 products, interleaved: f32 17.8 -> 10.6
  // ms, bf16 9.1 -> 5.6), 2 rows and FP8 slower.
  template <WeightType T>
  static constexpr int64_t kStreamRows = T == WeightType::kE4M3 || T == WeightType::kE5M2 ? 0 : 1;
  static constexpr bool kWholeLines = false;
  static constexpr bool kLaneSums = false;  // no lane_sums(): decode attention sums key by key
  static V zero() { return _mm256_setzero_ps(); }
  static void in_register(V& v) { __asm__("" : "+x"(v)); }  // see isa_avx512.cpp
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static V load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V load_e4m3(const uint8_t* p) {  // as in the AVX-512 file: sign-extend, shift, clear bit 14
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<int16_t>(0xbfff))));
  }
  static V load_e5m2(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8));
  }
  static V fma(V a, V b, V acc) { return _mm256_fmadd_ps(a, b, acc); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V exp(V x) {
    x = _mm256_max_ps(set1(kExpLowest), x);  // a NaN x stays NaN (max takes the second on NaN)
    const V n = _mm256_round_ps(_mm256_mul_ps(x, set1(kLog2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V r = _mm256_fnmadd_ps(n, set1(kLn2Low), _mm256_fnmadd_ps(n, set1(kLn2High), x));
    // 2^n built in the exponent field: n >= -126 after the clamp, and n <= 0 for x <= 0.
    const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(exp_reduced<Avx2>(r), _mm256_castsi256_ps(exponent));
  }
  static V neg_abs(V v) { return _mm256_or_ps(v, _mm256_set1_ps(-0.0f)); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V select_negative(V c, V a, V b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(c, zero(), _CMP_LT_OQ)); }
};

}  // namespace

void rows_linear_avx2(const RowsLinear& a, int64_t o_begin, int64_t o_end) { rows_linear<Avx2>(a, o_begin, o_end); }
void attention_avx2(const HeadGroupAttention& a) { attention<Avx2>(a); }
void gemm_avx2(const RowsLinear& a, int64_t o_begin, int64_t o_end) { gemm<Avx2>(a, o_begin, o_end); }
void widen_avx2(const WidenArgs& a, int64_t begin, int64_t end) { widen<Avx2>(a, begin, end); }
void silu_mul_avx2(const float* gate, const float* up, float* y, int64_t n) { silu_mul<Avx2>(gate, up, y, n); }
void scaled_softmax_avx2(float* x, int64_t rows, int64_t n, float scale) { scaled_softmax<Avx2>(x, rows, n, scale); }

bool avx2_compiled() { return true; }

}  // namespace vlmgen::kernels::raw

#else
#include "raw_kernels.h"
namespace vlmgen::kernels::raw {
void rows_linear_avx2(const RowsLinear& a, int64_t o_begin, int64_t o_end) { rows_linear_portable(a, o_begin, o_end); }
void attention_avx2(const HeadGroupAttention& a) { attention_portable(a); }
void gemm_avx2(const RowsLinear& a, int64_t o_begin, int64_t o_end) { gemm_portable(a, o_begin, o_end); }
void widen_avx2(const WidenArgs& a, int64_t begin, int64_t end) { widen_portable(a, begin, end); }
void silu_mul_avx2(const float* gate, const float* up, float* y, int64_t n) { silu_mul_portable(gate, up, y, n); }
void scaled_softmax_avx2(float* x, int64_t rows, int64_t n, float scale) { scaled_softmax_portable(x, rows, n, scale); }
bool avx2_compiled() { return false; }
}  // namespace vlmgen::kernels::raw
#endif
