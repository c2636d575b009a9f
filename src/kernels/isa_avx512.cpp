// The kernels with AVX-512F and BW (16 floats a vector; BW for the 16-bit shifts that widen a
// cache line of FP8 weights). Compiled with -mavx512f -mavx512bw -mfma -mf16c; called only when
// the CPU reports AVX-512F and BW (every AVX-512 CPU since Skylake-SP, and AMD's).

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>

#include "attention_impl.h"
#include "gemm_impl.h"
#include "rows_impl.h"

namespace vlmgen::kernels::raw {
namespace {

struct Avx512 {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  static constexpr int kOutTile = 4;  // 4 x 4 accumulators + 4 inputs + 1 weight of 32 registers
  static constexpr int kRowTile = 4;
  // f32 (see row_tile): 4 x 6 accumulators + 6 inputs + 1 weight. The bench's 85 products, one
  // process alternating builds, medians of 15: 16 rows 30.4 -> 28.6 ms (passes 6 + 5 + 5, with
  // tile_sums), 12 rows 25.2 -> 23.5; 4 and 8 rows unchanged (one pass of 4, two of 4). 4 x 4
  // with tile_sums alone: 29.9 and 24.8.
  static constexpr int kF32RowTile = 6;
  static constexpr int kGemmOutTile = 6;  // 6 x 4 accumulators + 4 inputs + 1 weight of 32 registers
  static constexpr int kGemmRowTile = 4;
  // Products of up to this many rows read the weights as far-apart streams (streams_rows); the
  // 85 products of the bench's 100M model, interleaved, far streams vs adjacent tiles: 1 row f32
  // 11.7 / 15.5 ms, bf16 5.6 / 8.7, E4M3 4.2 / 4.9; 2 rows f32 13.0 / 17.6, bf16 6.2 / 8.9, E4M3
  // 5.0 / 5.1; 3 rows f32 15.4 / 18.4, bf16 9.2 / 8.7, E4M3 6.6 / 6.0; 4 rows slower for all
  // (streams without fetching ahead).
  // (1 row of E4M3 in 128 x 128 blocks, streaming across row blocks since: 3.0-3.1 / 3.3-3.6.)
  // float32 from 4 rows on streams too, fetching ahead in its streams (kStreamPrefetchRows):
  // faster than adjacent tiles with the next tile fetched (the numbers at kStreamPrefetchBytes).
  template <WeightType T>
  static constexpr int64_t kStreamRows = T == WeightType::kF32
                                             ? 16  // kMaxFastRows: every row count of the decode kernels
                                             : (T == WeightType::kBF16 || T == WeightType::kF16 ? 2 : 1);
  static V zero() { return _mm512_setzero_ps(); }
  // Keeps v in a register where the compiler would fold its load into each use (see tile_loop).
  static void in_register(V& v) { __asm__("" : "+v"(v)); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static constexpr bool kWholeLines = true;
  // A line's bits as load_line takes them apart: each part is then one or two operations away
  // (line_part), so a tile can hold its outputs' lines in fewer registers than their parts.
  // bfloat16: the line twice; E4M3: two vectors of bfloat16 (weights 4j and 4j + 2, then 4j + 1
  // and 4j + 3); E5M2: two vectors of halves. `fix`: E4M3 bytes with a zero exponent in the line
  // (see fix_zero_exponent), which line_part leaves unfixed.
  struct LineBits {
    __m512i even, odd;
    bool fix;
  };
  template <WeightType T>
  static LineBits line_bits(const void* p) {
    const __m512i w = _mm512_loadu_si512(p);
    if constexpr (T == WeightType::kBF16) {
      return {w, w, false};
    } else if constexpr (T == WeightType::kE4M3) {
      // Each byte, sign-extended to 16 bits and shifted left by 4, has its exponent and mantissa
      // in a bfloat16's low exponent bits and mantissa; keeping the sign and those bits and
      // setting exponent bits 4-6 (112, one ternary-logic op) gives 2^-8 times the byte's value
      // (the factor 256 of the scales, as for halves) wherever the byte's exponent is not zero.
      // Then a shift or a mask widens each bfloat16 to a float. 9 operations a line instead of 13
      // through halves (cvtph2ps is two); a decode step's FP8 products ran 8-10% faster in a
      // microbenchmark.
      const __m512i keep = _mm512_set1_epi16(static_cast<int16_t>(0x87f0));
      const __m512i bias = _mm512_set1_epi16(0x3800);
      const __m512i even = _mm512_ternarylogic_epi32(_mm512_srai_epi16(_mm512_slli_epi16(w, 8), 4), keep, bias, 0xea);
      const __m512i odd = _mm512_ternarylogic_epi32(_mm512_srai_epi16(w, 4), keep, bias, 0xea);  // (a & b) | c
      return {even, odd, _mm512_testn_epi8_mask(w, _mm512_set1_epi8(0x78)) != 0};
    } else {
      // Each byte as a half (see load_e5m2): the low byte of each 16-bit pair shifted to the top,
      // the high byte in place.
      return {_mm512_slli_epi16(w, 8), _mm512_and_si512(w, _mm512_set1_epi16(static_cast<int16_t>(0xff00))), false};
    }
  }
  // Part K of a line (see load_line), right where bits.fix is false.
  template <WeightType T, int K>
  static V line_part(const LineBits& b) {
    const __m512i half = K < kLineParts<T> / 2 ? b.even : b.odd;
    if constexpr (T == WeightType::kE5M2)
      return _mm512_cvtph_ps(K % 2 == 0 ? _mm512_castsi512_si256(half) : _mm512_extracti64x4_epi64(half, 1));
    return _mm512_castsi512_ps(K % 2 == 0
                                   ? _mm512_slli_epi32(half, 16)
                                   : _mm512_and_si512(half, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
  }
  // A line's parts: bfloat16, the even- then the odd-numbered of its 32 weights; E4M3, weights 4j,
  // 4j + 2, 4j + 1 and 4j + 3 (j < 16); E5M2, read as 32 pairs of bytes, the even-numbered bytes
  // of its first and second halves, then the odd-numbered of each. split_inputs<T> puts the
  // inputs in the same order.
  template <WeightType T>
  static void load_line(const void* p, V (&parts)[kLineParts<T>]) {
    const LineBits b = line_bits<T>(p);
    parts[0] = line_part<T, 0>(b);
    parts[1] = line_part<T, 1>(b);
    if constexpr (kLineParts<T> == 4) {
      parts[2] = line_part<T, 2>(b);
      parts[3] = line_part<T, 3>(b);
    }
    if (b.fix)
      for (V& x : parts) x = fix_zero_exponent(x);
  }
  // E4M3 bytes with a zero exponent (zero and the subnormals m * 2^-9) read in load_line as
  // +-(2^-15 + m * 2^-18) (the exponent field's 112 and an implicit 1): 2^-8 times their value is
  // +-m * 2^-17 = 2x -+ 2^-14, exact (a negative zero comes out +0, which no sum can tell).
  // Lines that hold one (rare in amax-scaled weights) take this.
  static V fix_zero_exponent(V x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __mmask16 zero_exponent = _mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x07800000));
    const __m512i offset = _mm512_ternarylogic_epi32(bits, _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)),
                                                     _mm512_set1_epi32(0x38800000), 0xea);  // 2^-14 with x's sign
    return _mm512_mask_fmsub_ps(x, zero_exponent, _mm512_set1_ps(2.0f), _mm512_castsi512_ps(offset));
  }
  template <WeightType T>
  static void split_inputs(const float* p, V (&parts)[kLineParts<T>]) {
    // Index 16 + k picks the second vector's element k: lane j gets element 2j (even) or 2j + 1.
    const __m512i even_index = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd_index = _mm512_add_epi32(even_index, _mm512_set1_epi32(1));
    if constexpr (T == WeightType::kE4M3) {  // the even- and odd-numbered of x[2i], then of x[2i + 1]
      const V a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16), c = _mm512_loadu_ps(p + 32),
              d = _mm512_loadu_ps(p + 48);
      const V even_low = _mm512_permutex2var_ps(a, even_index, b), even_high = _mm512_permutex2var_ps(c, even_index, d);
      const V odd_low = _mm512_permutex2var_ps(a, odd_index, b), odd_high = _mm512_permutex2var_ps(c, odd_index, d);
      parts[0] = _mm512_permutex2var_ps(even_low, even_index, even_high);
      parts[1] = _mm512_permutex2var_ps(even_low, odd_index, even_high);
      parts[2] = _mm512_permutex2var_ps(odd_low, even_index, odd_high);
      parts[3] = _mm512_permutex2var_ps(odd_low, odd_index, odd_high);
    } else {
      constexpr int N = kLineParts<T>;
      for (int half = 0; half < N / 2; ++half) {
        const V lo = _mm512_loadu_ps(p + 32 * half);
        const V hi = _mm512_loadu_ps(p + 32 * half + 16);
        parts[half] = _mm512_permutex2var_ps(lo, even_index, hi);
        parts[half + N / 2] = _mm512_permutex2var_ps(lo, odd_index, hi);
      }
    }
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
  static constexpr bool kLaneSums = true;
  // Lane j: sum(acc[j]) with _mm512_reduce_add_ps's additions (lane i + lane i + 8, then + 4, + 2,
  // + 1), four levels of pairs of vectors instead of 16 reductions: 31 shuffles and 15 adds.
  static V lane_sums(const V (&acc)[16]) {
    V halves[8];  // quarters: (i, i + 8) sums of acc[2n] (lanes 0-7), then of acc[2n + 1]
    for (int n = 0; n < 8; ++n)
      halves[n] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * n], acc[2 * n + 1], 0x44),
                                _mm512_shuffle_f32x4(acc[2 * n], acc[2 * n + 1], 0xee));
    V quarters[4];  // quarter m: the (i, i + 4) sums of acc[4n + m]
    for (int n = 0; n < 4; ++n)
      quarters[n] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * n], halves[2 * n + 1], 0x88),
                                  _mm512_shuffle_f32x4(halves[2 * n], halves[2 * n + 1], 0xdd));
    V pairs[2];  // quarter m: the (i, i + 2) sums of acc[8n + m], then of acc[8n + 4 + m]
    for (int n = 0; n < 2; ++n) {
      const __m512d a = _mm512_castps_pd(quarters[2 * n]), b = _mm512_castps_pd(quarters[2 * n + 1]);
      pairs[n] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    // Lane 4m + n: the sum of acc[4n + m].
    const V sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V exp(V x) {
    x = _mm512_max_ps(set1(kExpLowest), x);  // a NaN x stays NaN (max takes the second on NaN)
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(kLog2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V r = _mm512_fnmadd_ps(n, set1(kLn2Low), _mm512_fnmadd_ps(n, set1(kLn2High), x));
    return _mm512_scalef_ps(exp_reduced<Avx512>(r), n);
  }
  static V neg_abs(V v) {
    return _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(v), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
  }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V select_negative(V c, V a, V b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, zero(), _CMP_LT_OQ), b, a);
  }
};

}  // namespace

void rows_linear_avx512(const RowsLinear& a, int64_t o_begin, int64_t o_end) { rows_linear<Avx512>(a, o_begin, o_end); }
void attention_avx512(const HeadGroupAttention& a) { attention<Avx512>(a); }
void gemm_avx512(const RowsLinear& a, int64_t o_begin, int64_t o_end) { gemm<Avx512>(a, o_begin, o_end); }
void widen_avx512(const WidenArgs& a, int64_t begin, int64_t end) { widen<Avx512>(a, begin, end); }
void silu_mul_avx512(const float* gate, const float* up, float* y, int64_t n) { silu_mul<Avx512>(gate, up, y, n); }
void scaled_softmax_avx512(float* x, int64_t rows, int64_t n, float scale) {
  scaled_softmax<Avx512>(x, rows, n, scale);
}

bool avx512_compiled() { return true; }

}  // namespace vlmgen::kernels::raw

#else
#include "raw_kernels.h"
namespace vlmgen::kernels::raw {
void rows_linear_avx512(const RowsLinear& a, int64_t o_begin, int64_t o_end) {
  rows_linear_portable(a, o_begin, o_end);
}
void attention_avx512(const HeadGroupAttention& a) { attention_portable(a); }
void gemm_avx512(const RowsLinear& a, int64_t o_begin, int64_t o_end) { gemm_portable(a, o_begin, o_end); }
void widen_avx512(const WidenArgs& a, int64_t begin, int64_t end) { widen_portable(a, begin, end); }
void silu_mul_avx512(const float* gate, const float* up, float* y, int64_t n) { silu_mul_portable(gate, up, y, n); }
void scaled_softmax_avx512(float* x, int64_t rows, int64_t n, float scale) {
  scaled_softmax_portable(x, rows, n, scale);
}
bool avx512_compiled() { return false; }
}  // namespace vlmgen::kernels::raw
#endif
