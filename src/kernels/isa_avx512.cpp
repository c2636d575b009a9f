// The kernels with AVX-512F (16 floats a vector). Compiled with -mavx512f -mfma -mf16c; called
// only when the CPU reports AVX-512F.

#if defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>

#include "kernels_impl.h"

namespace vlmgen::kernels::raw {
namespace {

struct Avx512 {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  static constexpr int kOutTile = 4;  // 4 x 4 accumulators + 4 inputs + 1 weight of 32 registers
  static constexpr int kRowTile = 4;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static V load_e4m3(const uint8_t* p) {
    // Sign-extended to 16 bits and shifted left by 7, a byte lands with its exponent and mantissa
    // in a half's fields and its sign in bits 15 and 14; clearing bit 14 leaves the half whose
    // value is the E4M3 value times 2^-8 (fp8_half_bits, by two operations fewer).
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<int16_t>(0xbfff))));
  }
  static V load_e5m2(const uint8_t* p) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
  }
  static V fma(V a, V b, V acc) { return _mm512_fmadd_ps(a, b, acc); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V exp(V x) {
    x = _mm512_max_ps(set1(kExpLowest), x);  // a NaN x stays NaN (max takes the second on NaN)
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(kLog2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V r = _mm512_fnmadd_ps(n, set1(kLn2Low), _mm512_fnmadd_ps(n, set1(kLn2High), x));
    return _mm512_scalef_ps(exp_reduced<Avx512>(r), n);
  }
};

}  // namespace

void rows_linear_avx512(const RowsLinear& a, int64_t o_begin, int64_t o_end) { rows_linear<Avx512>(a, o_begin, o_end); }
void attention_avx512(const HeadGroupAttention& a) { attention<Avx512>(a); }
void widen_avx512(const WidenArgs& a, int64_t begin, int64_t end) { widen<Avx512>(a, begin, end); }

bool avx512_compiled() { return true; }

}  // namespace vlmgen::kernels::raw

#else
#include "raw_kernels.h"
namespace vlmgen::kernels::raw {
void rows_linear_avx512(const RowsLinear& a, int64_t o_begin, int64_t o_end) {
  rows_linear_portable(a, o_begin, o_end);
}
void attention_avx512(const HeadGroupAttention& a) { attention_portable(a); }
void widen_avx512(const WidenArgs& a, int64_t begin, int64_t end) { widen_portable(a, begin, end); }
bool avx512_compiled() { return false; }
}  // namespace vlmgen::kernels::raw
#endif
