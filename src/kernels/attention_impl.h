#pragma once

// The kernels that are not matrix products, over the same `Vec` as kernels_impl.h (see there):
// exp, the gated activation, the scaled softmax and decode attention. Included only by the
// instruction-set files, before their Vec (whose exp() uses exp_reduced and the constants here);
// like kernels_impl.h it uses no inline function of another header.

#include <math.h>
#include <stdint.h>

#include "raw_kernels.h"

namespace vlmgen::kernels::raw {
namespace {

/// e^r for |r| <= ln(2) / 2 by its Taylor polynomial of degree 7 (error below 1e-8 relative):
/// the part of exp() after the range reduction e^x = 2^n e^r.
template <class Vec>
typename Vec::V exp_reduced(typename Vec::V r) {
  const float coefficients[] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
  typename Vec::V p = Vec::set1(1.0f / 5040.0f);
  for (float c : coefficients) p = Vec::fma(p, r, Vec::set1(c));
  return p;
}

/// y = silu(g) * u = g * sigmoid(g) * u over n floats, the sigmoid from e = e^-|g| (Vec::exp of a
/// non-positive argument): 1 / (1 + e) for g >= 0, e / (1 + e) below, so no e^x overflows. The
/// last partial vector goes through a padded copy: an element's result never depends on where
/// a caller splits the range.
template <class Vec>
void silu_mul(const float* g, const float* u, float* y, int64_t n) {
  using V = typename Vec::V;
  constexpr int64_t L = Vec::kLanes;
  const V one = Vec::set1(1.0f);
  auto gated = [&](const float* gp, const float* up, float* yp) {
    const V gv = Vec::load(gp);
    const V e = Vec::exp(Vec::neg_abs(gv));
    const V sigmoid = Vec::div(Vec::select_negative(gv, e, one), Vec::fma(e, one, one));
    Vec::store(yp, Vec::fma(Vec::fma(gv, sigmoid, Vec::zero()), Vec::load(up), Vec::zero()));
  };
  int64_t i = 0;
  for (; i + L <= n; i += L) gated(g + i, u + i, y + i);
  if (i == n) return;
  float gt[L] = {}, ut[L] = {}, yt[L];
  for (int64_t k = i; k < n; ++k) gt[k - i] = g[k], ut[k - i] = u[k];
  gated(gt, ut, yt);
  for (int64_t k = i; k < n; ++k) y[k] = yt[k - i];
}

/// ln 2 = kLn2High + kLn2Low, kLn2High with few mantissa bits so n * kLn2High is exact.
constexpr float kLn2High = 0.693359375f;
constexpr float kLn2Low = -2.12194440e-4f;
constexpr float kLog2E = 1.44269504088896341f;
/// Below this e^x is under the smallest normal float; inputs are clamped to it.
constexpr float kExpLowest = -87.0f;

/// Each of `rows` rows of n floats (in place): softmax(x * scale) = e^(p - top) / total with p
/// each rounded product x * scale and top the largest (scale > 0: scale * max(x), rounded), the
/// same two roundings as ATen's softmax of x * scale, so a row's largest term is exactly e^0 (a
/// row of equal scores, every key masked, is uniform). Arguments below kExpLowest (e^x under the
/// smallest normal float: masked scores) give exact zeros. A NaN or +inf anywhere makes the row NaN
/// (through the sum; Vec::max passes NaNs by). The last partial vector goes through a copy padded
/// with -inf (exp 0), so a row's results do not depend on n's remainder.
template <class Vec>
void scaled_softmax(float* x, int64_t rows, int64_t n, float scale) {
  using V = typename Vec::V;
  constexpr int64_t L = Vec::kLanes;
  const V one = Vec::set1(1.0f), factor = Vec::set1(scale), floor_offset = Vec::set1(-kExpLowest);
  const int64_t full = n - n % L;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = x + r * n;
    float tail[L];
    for (int64_t k = 0; k < L; ++k) tail[k] = full + k < n ? row[full + k] : -INFINITY;
    V top_v = Vec::set1(-INFINITY);
    for (int64_t j = 0; j < full; j += L) top_v = Vec::max(Vec::load(row + j), top_v);
    if (full < n) top_v = Vec::max(Vec::load(tail), top_v);
    float lanes[L];
    Vec::store(lanes, top_v);
    float top = -INFINITY;
    for (float v : lanes) top = v > top ? v : top;
    const V shift = Vec::set1(-(top * scale));
    V sums = Vec::zero();
    auto exponent = [&](const float* in, float* out) {
      const V t = Vec::fma(Vec::fma(Vec::load(in), factor, Vec::zero()), one, shift);
      const V e = Vec::select_negative(Vec::fma(t, one, floor_offset), Vec::zero(), Vec::exp(t));  // t < -87: 0
      Vec::store(out, e);
      sums = Vec::fma(e, one, sums);
    };
    for (int64_t j = 0; j < full; j += L) exponent(row + j, row + j);
    if (full < n) exponent(tail, tail);
    const V inv = Vec::set1(1.0f / Vec::sum(sums));
    for (int64_t j = 0; j < full; j += L) Vec::store(row + j, Vec::fma(Vec::load(row + j), inv, Vec::zero()));
    if (full < n) {
      Vec::store(tail, Vec::fma(Vec::load(tail), inv, Vec::zero()));
      for (int64_t k = full; k < n; ++k) row[k] = tail[k - full];
    }
  }
}

/// A KV cache's keys and values as stored: float32, or bfloat16 bits (uint16_t) widened exactly as
/// they are read, so the arithmetic after the load is the same for both; or FP8 rows (uint8_t,
/// HeadGroupAttention::k8), read as 2^-8 times their E4M3 values (Vec::load_e4m3), the row's
/// scale times 2^8 (row_factor) applied to what a row contributes: to a key's score after its dot
/// product, to a value row's softmax weight.
template <class Vec>
typename Vec::V load_kv(const float* p) {
  return Vec::load(p);
}
template <class Vec>
typename Vec::V load_kv(const uint16_t* p) {
  return Vec::load_bf16(p);
}
template <class Vec>
typename Vec::V load_kv(const uint8_t* p) {
  return Vec::load_e4m3(p);
}
inline float kv_value(float x) { return x; }
inline float kv_value(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}
/// 2^-8 times the E4M3 byte's value (as Vec::load_e4m3): (8 + m) 2^(e - 10) for exponents e >= 1,
/// m 2^-9 (subnormal) for e = 0, each times 2^-8.
inline float kv_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float magnitude = __builtin_ldexpf(static_cast<float>(e != 0 ? 8 + m : m), (e != 0 ? e : 1) - 18);
  return (b & 0x80) != 0 ? -magnitude : magnitude;
}
/// What a cache row's elements as read are multiplied by: 1, or for an FP8 row its scale times 2^8
/// (exact), the scale stored after the row's dim bytes.
template <class T>
float row_factor(const T* row, int64_t dim) {
  if constexpr (sizeof(T) == 1) {
    float scale;
    __builtin_memcpy(&scale, row + dim, sizeof scale);
    return scale * 256.0f;
  } else {
    return 1.0f;
  }
}
/// The cache's keys (or values) as stored: float32, bfloat16 bits (HeadGroupAttention::k16) or FP8
/// rows (k8).
template <class T>
const T* cache_rows(const HeadGroupAttention& a, bool values);
template <>
inline const float* cache_rows<float>(const HeadGroupAttention& a, bool values) {
  return values ? a.v : a.k;
}
template <>
inline const uint16_t* cache_rows<uint16_t>(const HeadGroupAttention& a, bool values) {
  return values ? a.v16 : a.k16;
}
template <>
inline const uint8_t* cache_rows<uint8_t>(const HeadGroupAttention& a, bool values) {
  return values ? a.v8 : a.k8;
}

template <class Vec, class T>
float dot(const float* a, const T* b, int64_t n) {
  constexpr int64_t L = Vec::kLanes;
  typename Vec::V acc = Vec::zero();
  int64_t i = 0;
  for (; i + L <= n; i += L) acc = Vec::fma(Vec::load(a + i), load_kv<Vec>(b + i), acc);
  float s = Vec::sum(acc);
  for (; i < n; ++i) s = __builtin_fmaf(a[i], kv_value(b[i]), s);  // one rounding, whatever the compiler fuses
  if constexpr (sizeof(T) == 1) s *= row_factor(b, n);
  return s;
}

/// A block of kLanes keys as score_block reads them: rows of dim float32 or bfloat16 elements
/// `stride` apart (the cache's own rows, or an FP8 block widened to floats once for all the group's
/// heads, with each row's factor; else null).
template <class R>
struct KeyBlock {
  const R* rows;
  int64_t stride;
  const float* factors;
};

/// The widest head dim whose FP8 key blocks are widened once per group (on the stack); wider heads
/// score key by key.
constexpr int64_t kWideBlockDim = 256;

/// The kLanes key rows at `keys` (`stride` elements apart) as floats: dim floats a row at `wide`.
template <class Vec, class T>
void widen_key_block(const T* keys, int64_t stride, int64_t dim, float* wide) {
  for (int64_t kk = 0; kk < Vec::kLanes; ++kk)
    for (int64_t i = 0; i < dim; i += Vec::kLanes)
      Vec::store(wide + kk * dim + i, load_kv<Vec>(keys + kk * stride + i));
}

/// The scores of every query head of the group in column s for keys [j, j + kLanes) in `block`:
/// q . k * scale, -inf for keys that are not real; as dot() per key, bit for bit (but +0 where
/// dot() * scale gives -0, which no softmax can tell), with the horizontal sums of a whole block of
/// keys done together (dim a positive multiple of kLanes; used where Vec::lane_sums does them at
/// once). `all_real`: every key the column sees is real (no test per key). The heads go one after
/// another in one call over the block's rows, each head's sums started by its first products (the
/// same bits as from zeros): with one call per head, its sums zeroed through memory first, the
/// calls spent more on that and on finding the rows than on the products (dim 64: 4 steps of 16).
/// The decode step's attention, 12 layers of the bench's model, caches cold, medians of 21: 16
/// rows of 130 keys 2.99 -> 2.86 ms, 1 row of 2048 keys 4.00 -> 3.69 (warm, 128 keys: 0.100 -> 0.083).
template <class Vec, class R>
void score_block(const HeadGroupAttention& a, int64_t s, int64_t j, const KeyBlock<R>& block, bool all_real) {
  using V = typename Vec::V;
  constexpr int64_t L = Vec::kLanes;
  const V scale = Vec::set1(a.scale);
  for (int64_t g = 0; g < a.groups; ++g) {
    const float* q = a.q + g * a.q_head_stride + s * a.dim;
    V acc[L];
    const V q0 = Vec::load(q);
    for (int64_t kk = 0; kk < L; ++kk)
      acc[kk] = Vec::fma(q0, load_kv<Vec>(block.rows + kk * block.stride), Vec::zero());
    for (int64_t i = L; i < a.dim; i += L) {  // each query vector loaded once for the block's keys
      const V qv = Vec::load(q + i);
      for (int64_t kk = 0; kk < L; ++kk)
        acc[kk] = Vec::fma(qv, load_kv<Vec>(block.rows + kk * block.stride + i), acc[kk]);
    }
    float* out = a.scores + g * a.keys + j;
    V sums = Vec::lane_sums(acc);
    if (block.factors != nullptr) sums = Vec::fma(sums, Vec::load(block.factors), Vec::zero());
    Vec::store(out, Vec::fma(sums, scale, Vec::zero()));
    if (all_real) continue;  // the usual case: no key byte to test
    for (int64_t kk = 0; kk < L; ++kk)
      if (a.key_real[j + kk] == 0) out[kk] = -INFINITY;
  }
}

/// y += alpha * x over n floats (x a row as the cache stores it).
template <class Vec, class T>
void axpy(float alpha, const T* x, float* y, int64_t n) {
  constexpr int64_t L = Vec::kLanes;
  alpha *= row_factor(x, n);
  const typename Vec::V al = Vec::set1(alpha);
  int64_t i = 0;
  for (; i + L <= n; i += L) Vec::store(y + i, Vec::fma(al, load_kv<Vec>(x + i), Vec::load(y + i)));
  for (; i < n; ++i) y[i] = __builtin_fmaf(alpha, kv_value(x[i]), y[i]);
}

/// out(g, s) += the sum over visible keys j in [j0, j1) of p(g, j) * v_j, for g in [g0, g0 + gn)
/// and columns [d0, d0 + DN * L) of the value rows: the GC x DN partial sums kept in registers
/// while the value rows stream by once.
template <class Vec, class T, int DN, int GC>
void value_chunk(const HeadGroupAttention& a, const float* p, int64_t s, int64_t j0, int64_t j1, int64_t g0, int64_t gn,
                 int64_t d0) {
  using V = typename Vec::V;
  constexpr int64_t L = Vec::kLanes;
  V acc[GC][DN];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < DN; ++c)
      acc[g][c] = g < gn ? Vec::load(a.out + (g0 + g) * a.q_head_stride + s * a.dim + d0 + c * L) : Vec::zero();
  for (int64_t j = j0; j < j1; ++j) {
    if (a.key_real[j] == 0) continue;
    const T* row = cache_rows<T>(a, true) + j * a.kv_row_stride;
    const T* vj = row + d0;
    const float factor = row_factor(row, a.dim);
    V vv[DN];
    for (int c = 0; c < DN; ++c) vv[c] = load_kv<Vec>(vj + c * L);
    for (int g = 0; g < GC; ++g) {
      if (g >= gn) break;
      const V w = Vec::set1(sizeof(T) == 1 ? p[(g0 + g) * a.keys + j] * factor : p[(g0 + g) * a.keys + j]);
      for (int c = 0; c < DN; ++c) acc[g][c] = Vec::fma(w, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GC && g < gn; ++g)
    for (int c = 0; c < DN; ++c) Vec::store(a.out + (g0 + g) * a.q_head_stride + s * a.dim + d0 + c * L, acc[g][c]);
}

/// The values of keys [j0, j1) added to column s's output of every head of the group:
/// register-blocked chunks of the vector-aligned columns, one key at a time for any columns past
/// them.
template <class Vec, class T>
void value_pass(const HeadGroupAttention& a, const float* p, int64_t s, int64_t j0, int64_t j1) {
  constexpr int64_t L = Vec::kLanes;
  const int64_t aligned = a.dim - a.dim % L;
  int64_t d0 = 0;
  for (; d0 + 4 * L <= aligned; d0 += 4 * L)
    for (int64_t g0 = 0; g0 < a.groups; g0 += 3) value_chunk<Vec, T, 4, 3>(a, p, s, j0, j1, g0, a.groups - g0, d0);
  for (; d0 + L <= aligned; d0 += L)
    for (int64_t g0 = 0; g0 < a.groups; g0 += 8) value_chunk<Vec, T, 1, 8>(a, p, s, j0, j1, g0, a.groups - g0, d0);
  if (aligned == a.dim) return;
  for (int64_t g = 0; g < a.groups; ++g) {
    float* out = a.out + g * a.q_head_stride + s * a.dim;
    for (int64_t j = j0; j < j1; ++j) {
      if (a.key_real[j] == 0) continue;
      const T* vj = cache_rows<T>(a, true) + j * a.kv_row_stride;
      const float w = p[g * a.keys + j] * row_factor(vj, a.dim);
      for (int64_t d = aligned; d < a.dim; ++d) out[d] = __builtin_fmaf(w, kv_value(vj[d]), out[d]);
    }
  }
}

/// The running softmax of one query head brought over n more scores `sc` (keys that are not real
/// hold -inf): top, the largest score so far, and total, the sum of e^(score - top) so far, are
/// updated, and sc becomes e^(score - top) (0 for keys that are not real). Returns the factor
/// e^(old top - new top) by which the sums made so far (total, the output's) shrink: 1 where the
/// top did not grow.
template <class Vec>
float softmax_block(float* sc, const uint8_t* real, int64_t n, bool all_real, float& top, float& total) {
  constexpr int64_t L = Vec::kLanes;
  typename Vec::V top_v = Vec::set1(-INFINITY);
  int64_t k = 0;
  for (; k + L <= n; k += L) top_v = Vec::max(Vec::load(sc + k), top_v);
  float lanes[L];
  Vec::store(lanes, top_v);
  float block_top = -INFINITY;
  for (float v : lanes) block_top = v > block_top ? v : block_top;
  for (; k < n; ++k) block_top = sc[k] > block_top ? sc[k] : block_top;
  float factor = 1.0f;
  if (block_top > top) {
    factor = expf(top - block_top);  // 0 from a top of -inf
    top = block_top;
  }
  if (top == -INFINITY) {  // no visible key yet, or only NaN scores (the max passes NaNs by)
    for (int64_t j = 0; j < n; ++j) {
      if (sc[j] != sc[j]) total = NAN;  // a real key's NaN score makes the column NaN, as softmax does
      sc[j] = 0.0f;
    }
    return factor;
  }
  const typename Vec::V shift = Vec::set1(-top);
  const typename Vec::V one = Vec::set1(1.0f);
  typename Vec::V sums = Vec::zero();
  int64_t j = 0;
  for (; j + L <= n; j += L) {
    const typename Vec::V e = Vec::exp(Vec::fma(Vec::load(sc + j), one, shift));
    Vec::store(sc + j, e);
    sums = Vec::fma(e, one, sums);
  }
  float added = Vec::sum(sums);
  for (; j < n; ++j) {
    sc[j] = expf(sc[j] - top);
    added += sc[j];
  }
  if (!all_real) {  // Vec::exp of -inf is about 1e-38, not 0: take those terms back out
    for (int64_t i = 0; i < n; ++i) {
      if (real[i] == 0) {
        added -= sc[i];
        sc[i] = 0.0f;
      }
    }
  }
  total = total * factor + added;
  return factor;
}

/// The KV cache is fetched ahead in blocks of kFetchBlock keys: the keys kFetchAhead keys past the
/// block being scored, and the values of that block (added in after the key block's scores, see
/// kKeyBlock). A decode step reads each layer's cache once, from memory (every weight has
/// streamed through the caches since the layer's last step), and the hardware prefetcher alone left
/// those reads far below the weights' rate. The bench's 100M model, context 2048, one thread,
/// decode step medians of 3 interleaved A/B runs: bf16 weights and cache 15.84 -> 15.02 ms, FP8
/// weights and a bf16 cache 10.94 -> 10.17 ms; a float32 cache within the noise (27.1 -> 26.6).
/// 128 or 512 keys ahead, or no value fetches for a float32 cache: within the noise of 256; with
/// one pass (kKeyBlock), fetching the values 64 to 256 keys ahead or into L2 only was slower.
constexpr int64_t kFetchBlock = 16;
constexpr int64_t kFetchAhead = 256;

/// Rows [first, min(first + kFetchBlock, limit)) of a cache's keys or values. Inlined by force:
/// a prefetch has no effect the compiler can see, so a call it did not inline early was found to
/// be "pure" and dropped with all its prefetches.
template <class T>
[[gnu::always_inline]] inline void fetch_rows(const T* base, int64_t stride, int64_t row_bytes, int64_t first,
                                              int64_t limit) {
  const int64_t end = first + kFetchBlock < limit ? first + kFetchBlock : limit;
  for (int64_t r = first; r < end; ++r) {
    const char* p = reinterpret_cast<const char*>(base + r * stride);
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
  }
}

/// The fetches due at key j (a multiple of kFetchBlock) of a column that sees keys below limit.
template <class T>
[[gnu::always_inline]] inline void fetch_ahead(const HeadGroupAttention& a, int64_t j, int64_t limit) {
  const int64_t row_bytes = a.dim * static_cast<int64_t>(sizeof(T)) + (sizeof(T) == 1 ? kFp8RowScaleBytes : 0);
  fetch_rows(cache_rows<T>(a, false), a.kv_row_stride, row_bytes, j + kFetchAhead, limit);
  fetch_rows(cache_rows<T>(a, true), a.kv_row_stride, row_bytes, j, limit);
}

/// The scores of keys [j0, j1) for every head of the group in column s, into a.scores (head g's
/// key j at g * keys + j), -inf for keys that are not real; blocks of kLanes keys where the
/// instruction set sums lanes together (j0 a multiple of kLanes), then key by key.
template <class Vec, class T>
void score_keys(const HeadGroupAttention& a, int64_t s, int64_t j0, int64_t j1, int64_t limit, bool all_real) {
  const int64_t dim = a.dim;
  int64_t j = j0;
  if constexpr (Vec::kLaneSums) {
    constexpr int64_t L = Vec::kLanes;
    if (dim >= L && dim % L == 0 && (sizeof(T) != 1 || dim <= kWideBlockDim)) {
      // An FP8 block is widened once for the group's heads (its bytes take 4 more operations a
      // vector than bfloat16's): 12 layers of 2048 FP8 keys, 3 heads a group, from 2.48-2.54 to
      // 1.93-2.15 ms (bfloat16 blocks widened so: 1.97-2.04 -> 2.14-2.24 ms, so they are not).
      // Widening FP8 a 64-byte line at a time (Vec::load_line, 9 operations instead of 24, the
      // queries split to match) measured the same as this and was left out.
      alignas(64) float wide[sizeof(T) == 1 ? L * kWideBlockDim : L];
      float factors[L];
      for (; j + L <= j1; j += L) {
        fetch_ahead<T>(a, j, limit);
        const T* keys = cache_rows<T>(a, false) + j * a.kv_row_stride;
        if constexpr (sizeof(T) == 1) {
          widen_key_block<Vec>(keys, a.kv_row_stride, dim, wide);
          for (int64_t kk = 0; kk < L; ++kk) factors[kk] = row_factor(keys + kk * a.kv_row_stride, dim);
          score_block<Vec>(a, s, j, KeyBlock<float>{wide, dim, factors}, all_real);
        } else {
          score_block<Vec>(a, s, j, KeyBlock<T>{keys, a.kv_row_stride, nullptr}, all_real);
        }
      }
    }
  }
  for (; j < j1; ++j) {
    if (j % kFetchBlock == 0) fetch_ahead<T>(a, j, limit);
    const T* key = cache_rows<T>(a, false) + j * a.kv_row_stride;
    for (int64_t g = 0; g < a.groups; ++g)
      a.scores[g * a.keys + j] =
          a.key_real[j] != 0 ? dot<Vec>(a.q + g * a.q_head_stride + s * dim, key, dim) * a.scale : -INFINITY;
  }
}

/// Keys a column takes at a time in one pass over the cache: their scores for every head of the
/// group, each head's running softmax brought up to date (what was summed so far shrinks where the
/// top score grew), then their values added in while those rows are still in the caches. Two
/// passes (every score, then every value) left the values' reads out of step with the work: 12
/// layers of the bench's 100M model (4 KV heads, 3 query heads each, dim 64), a float32 cache cold
/// from memory, one thread, medians of 21 interleaved runs: 2048 keys 3.14-4.48 -> 2.76-3.73 ms
/// (8-20% less; a plain read of the same bytes takes 1.6-1.9 ms), 512 keys 0.85 -> 0.82 ms, 128
/// keys 0.198 -> 0.215 ms. Blocks of 32 were slower, 128 the same, 256 slower.
constexpr int64_t kKeyBlock = 64;
/// Heads a group takes at a time (each head's running top and total on the stack; see attention).
constexpr int64_t kMaxGroups = 64;

/// Column s over every visible key, for all `groups` query heads of a column (groups <=
/// kMaxGroups). `scores` holds groups * keys floats.
template <class Vec, class T>
void attend_column(const HeadGroupAttention& a, int64_t s, int64_t limit, bool all_real) {
  const int64_t dim = a.dim;
  float top[kMaxGroups], total[kMaxGroups];
  for (int64_t g = 0; g < a.groups; ++g) top[g] = -INFINITY, total[g] = 0.0f;
  for (int64_t j0 = 0; j0 < limit; j0 += kKeyBlock) {
    const int64_t j1 = j0 + kKeyBlock < limit ? j0 + kKeyBlock : limit;
    score_keys<Vec, T>(a, s, j0, j1, limit, all_real);
    for (int64_t g = 0; g < a.groups; ++g) {
      const float factor =
          softmax_block<Vec>(a.scores + g * a.keys + j0, a.key_real + j0, j1 - j0, all_real, top[g], total[g]);
      if (factor != 1.0f) {
        float* out = a.out + g * a.q_head_stride + s * dim;
        for (int64_t d = 0; d < dim; ++d) out[d] *= factor;
      }
    }
    value_pass<Vec, T>(a, a.scores, s, j0, j1);
  }
  for (int64_t g = 0; g < a.groups; ++g) {
    const float inv = 1.0f / total[g];
    float* out = a.out + g * a.q_head_stride + s * dim;
    for (int64_t d = 0; d < dim; ++d) out[d] *= inv;
  }
}

/// Each query column of a head group over the keys it sees, in one pass (attend_column).
template <class Vec, class T>
void attention_of(const HeadGroupAttention& a) {
  const int64_t dim = a.dim;
  for (int64_t s = 0; s < a.columns; ++s) {
    const int64_t limit = a.first_query_key + s + 1 < a.keys ? a.first_query_key + s + 1 : a.keys;
    int64_t real_keys = 0;
    for (int64_t j = 0; j < limit; ++j) real_keys += a.key_real[j] != 0 ? 1 : 0;
    for (int64_t g = 0; g < a.groups; ++g)
      __builtin_memset(a.out + g * a.q_head_stride + s * dim, 0, dim * sizeof(float));
    if (real_keys == 0) {  // every key blocked: the uniform average of all values
      const float w = a.keys > 0 ? 1.0f / static_cast<float>(a.keys) : 0.0f;
      for (int64_t j = 0; j < a.keys; ++j)
        for (int64_t g = 0; g < a.groups; ++g)
          axpy<Vec>(w, cache_rows<T>(a, true) + j * a.kv_row_stride, a.out + g * a.q_head_stride + s * dim, dim);
      continue;
    }
    attend_column<Vec, T>(a, s, limit, real_keys == limit);
  }
}

/// attention_of over a float32, a bfloat16 (HeadGroupAttention::k16 set) or an FP8 cache (k8).
/// Groups of more than kMaxGroups heads go kMaxGroups heads at a time.
template <class Vec>
void attention(const HeadGroupAttention& a) {
  for (int64_t g0 = 0; g0 < a.groups; g0 += kMaxGroups) {
    HeadGroupAttention part = a;
    part.q += g0 * a.q_head_stride;
    part.out += g0 * a.q_head_stride;
    part.groups = a.groups - g0 < kMaxGroups ? a.groups - g0 : kMaxGroups;
    if (a.k8 != nullptr)
      attention_of<Vec, uint8_t>(part);
    else if (a.k16 != nullptr)
      attention_of<Vec, uint16_t>(part);
    else
      attention_of<Vec, float>(part);
  }
}

}  // namespace
}  // namespace vlmgen::kernels::raw
