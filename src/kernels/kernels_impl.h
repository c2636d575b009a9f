#pragma once

// The matrix-product tiles once (rows_impl.h: the drivers over them; attention_impl.h: the rest),
// over a vector type `Vec` that
// each instruction-set file defines:
//   V, kLanes, kOutTile, kRowTile, kF32RowTile, zero(), in_register(v) (keeps v in a register: an
//   empty asm, or nothing), set1(f), load(const float*), load_bf16(const uint16_t*),
//   load_f16(const uint16_t*), fma(a, b, acc) (a * b + acc), sum(v), store(float*, v),
//   exp(v) (e^v for v <= 0, relative error below 2e-7; inputs below -87 give about 1e-38),
//   neg_abs(v) (-|v|), div(a, b), max(a, b) (maxps: b where either is NaN), select_negative(c, a, b)
//   (a where c < 0, else b),
//   kWholeLines and, where it is true, load_line<T>(p, parts) (a 64-byte line of bfloat16 or FP8
//   weights widened to kLineParts<T> vectors in an order of its own), the same in two stages
//   (LineBits, line_bits<T>(p), line_part<T, K>(bits): part K, without load_line's fix of E4M3
//   zero exponents, which LineBits::fix asks for) and split_inputs<T>(p, parts)
//   (as many floats split into the same order); kLaneSums and, where it is true, lane_sums(acc)
//   (lane j: sum(acc[j]) for kLanes vectors, the same bits); kStreamRows<T> (see streams_rows).
// Included only by those files (see raw_kernels.h); it uses no inline function of another
// header (a copy compiled with wider instructions could be picked by the linker for every caller).

#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "raw_kernels.h"

namespace vlmgen::kernels::raw {
// Internal linkage: each instruction-set file gets its own copy, compiled with its own flags.
namespace {

/// bfloat16 bits to float: the upper half of a float32.
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

/// IEEE half bits to float, subnormals, infinities and NaN included.
inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
    __builtin_memcpy(&bits, &magnitude, sizeof bits);
    bits |= sign;
  }
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr bool is_fp8(WeightType t) { return t == WeightType::kE4M3 || t == WeightType::kE5M2; }

template <WeightType T>
using WeightElement = typename std::conditional<T == WeightType::kF32, float,
                                                typename std::conditional<is_fp8(T), uint8_t, uint16_t>::type>::type;

/// An FP8 byte as the half-precision value with the same bits in place: E5M2 is exactly the top
/// byte of an IEEE half; E4M3 (bias 7, 3 mantissa bits) shifted into a half's exponent and
/// mantissa fields reads as its value times 2^-8 (normal and subnormal alike). The 2^8 goes into
/// the scale (kE4M3Factor). E4M3's NaN bytes (0x7f, 0xff) are refused when weights are loaded.
inline uint16_t fp8_half_bits(uint8_t b, WeightType t) {
  if (t == WeightType::kE5M2) return static_cast<uint16_t>(b << 8);
  return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
}

template <WeightType T>
inline float weight_at(const void* w, int64_t index) {
  if constexpr (T == WeightType::kF32) return static_cast<const float*>(w)[index];
  if constexpr (T == WeightType::kBF16) return bf16_to_float(static_cast<const uint16_t*>(w)[index]);
  if constexpr (T == WeightType::kF16) return f16_to_float(static_cast<const uint16_t*>(w)[index]);
  if constexpr (is_fp8(T)) return f16_to_float(fp8_half_bits(static_cast<const uint8_t*>(w)[index], T));
}

template <class Vec, WeightType T>
inline typename Vec::V load_weights(const void* w, int64_t index) {
  if constexpr (T == WeightType::kF32) return Vec::load(static_cast<const float*>(w) + index);
  if constexpr (T == WeightType::kBF16) return Vec::load_bf16(static_cast<const uint16_t*>(w) + index);
  if constexpr (T == WeightType::kF16) return Vec::load_f16(static_cast<const uint16_t*>(w) + index);
  if constexpr (T == WeightType::kE4M3) return Vec::load_e4m3(static_cast<const uint8_t*>(w) + index);
  if constexpr (T == WeightType::kE5M2) return Vec::load_e5m2(static_cast<const uint8_t*>(w) + index);
}

/// The multiplier of an FP8 weight's raw value at (row o, column i): its block's scale.
inline float fp8_scale_at(const Fp8Scales& q, int64_t o, int64_t i) {
  return q.grid[(o / q.block_out) * q.grid_cols + i / q.block_in] * q.factor;
}

/// Where an FP8 tile applies its scales. kAtEnd: one column block (per tensor or per output
/// channel), each output's sum is scaled once. kToInput: the tile's outputs share a row block, so
/// the input vectors are scaled per column block (RT multiplies per step, not OT): every tile lies
/// within one row block (rows_linear_runs and far_across_blocks make no other). kNone: not FP8.
enum class ScaleMode { kNone, kAtEnd, kToInput };

/// How many vectors one 64-byte cache line of T's weights widens to: 2 for 16-bit, 4 for FP8.
template <WeightType T>
constexpr int kLineParts = 4 / static_cast<int>(sizeof(WeightElement<T>));

/// Input rows a tile of the decode kernels takes at once: Vec::kF32RowTile for f32 weights (more
/// accumulators: no widening needs registers), Vec::kRowTile for the rest.
template <class Vec, WeightType T>
constexpr int row_tile = T == WeightType::kF32 ? Vec::kF32RowTile : Vec::kRowTile;

/// Fetches the next tile's weight rows (the bytes that follow this tile's) into the caches while this tile
/// computes (the hardware prefetcher alone leaves a single thread well below the machine's read
/// bandwidth). With one row pass (up to row_tile<Vec, T> input rows) each step fetches the line at the
/// offset it reads in each row, as the tile reads them. With several passes the next tile's bytes
/// are fetched in address order, per_step lines a step over the steps of every pass (a whole
/// number: where the tile has fewer lines than steps, such as 8 or more passes on AVX-512 or 16-bit
/// weights on AVX2, the fetches end before the last passes): fetching all of them in the first pass
/// stalled that pass on the memory system (the prefetches wait for free miss buffers) and left the
/// other passes with no transfer in flight. An exact even schedule (a line whenever its share of
/// the steps is due) made 8 rows of f32 12% slower, 16 rows unchanged. The bench's 85 products
/// through kernels::linear, 16 rows: f32 40.4 -> 36.4 ms, bf16 30.4 -> 26.3 ms (1 and 4 rows, one
/// pass: unchanged). The fetches in address order go into L2 (prefetcht1: with prefetcht0 the
/// bench's f32 decode step, then on adjacent tiles, took 24.2 ms instead of 22.9 at batch 1); the
/// fetches of one pass and of far streams into L1 (see prefetch_step). Copied into the tile loops
/// (a local kept in registers) and back.
struct TilePrefetch {
  const char* next = nullptr;  // null: no next tile in this call's range
  int64_t row_bytes = 0;
  int64_t per_step = 0;  // several passes: lines a step; 0: one pass
  int64_t pos = 0;       // several passes: the next byte to fetch
  int64_t end = 0;       // several passes: the next tile's bytes

  TilePrefetch() = default;  // none

  /// Far streams (rows_linear_typed) of products of kStreamPrefetchRows rows or more: each step
  /// fetches the line kStreamPrefetchBytes ahead of the one it reads in each of the tile's rows,
  /// which runs on into the stream's next row (none for fewer rows: the hardware prefetcher
  /// alone keeps up with them). `stride`: the tile's outputs apart.
  static TilePrefetch in_streams(const void* w, int64_t o, int64_t stride, int64_t row_bytes, int64_t rows);

  /// A tile of `tile_rows` weight rows of `row_bytes` at `w`, in row pass `pass` of `passes`,
  /// `steps` steps a pass.
  TilePrefetch(const RowsLinear& a, const void* w, int64_t o, int tile_rows, int64_t row_bytes, int64_t pass,
               int64_t passes, int64_t steps)
      : row_bytes(row_bytes) {
    if (o + 2 * tile_rows > a.out_end || steps == 0) return;
    next = static_cast<const char*>(w) + (o + tile_rows) * row_bytes;
    if (passes == 1) return;
    end = tile_rows * row_bytes;
    per_step = ((end + 63) / 64 + passes * steps - 1) / (passes * steps);
    pos = pass * steps * per_step * 64;
  }
};

/// Products of this many rows or more that read their weights as far streams fetch ahead in them
/// (TilePrefetch::in_streams), this many bytes ahead. The bench's 85 float32 products, weights on
/// huge pages, medians of 15 in alternated runs (ms; adjacent tiles with the next tile fetched /
/// far streams, none fetched / far streams fetching 512, 1024, 1536 bytes ahead): 4 rows 15.3-15.7
/// / 16.5-17.1 / 15.8-16.5, 14.0-14.6, 14.1-14.5; 16 rows 32.2-32.9 / - / 31.4, 29.4-29.8,
/// 30.9-31.3. With 2 rows the fetches made far streams slower (10.3-10.6 -> 12.5), with 1 and 3
/// within the noise: they keep streaming without. With the fetches into L1 (prefetch_step),
/// 2048 bytes ahead against 1024 and 3072 (medians of 15 in one process, 4 KiB pages): 4 rows
/// 13.5 (13.5, 13.8) ms, 6 rows 14.2 (14.8, 14.8), 8 rows 17.3 (18.5, 16.7), 12 rows 22.3 (22.8,
/// 22.2), 16 rows 27.1 (28.0, 27.1).
constexpr int64_t kStreamPrefetchRows = 4;
constexpr int64_t kStreamPrefetchBytes = 2048;

inline TilePrefetch TilePrefetch::in_streams(const void* w, int64_t o, int64_t stride, int64_t row_bytes,
                                             int64_t rows) {
  TilePrefetch p;
  if (rows < kStreamPrefetchRows) return p;
  // Integers, not pointer arithmetic: the last stream's fetches pass the end of the weights (and
  // a stream's may pass the end of a thread's outputs), which a prefetch may do, but a pointer
  // may not.
  p.next = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w) +
                                         static_cast<uintptr_t>(o * row_bytes + kStreamPrefetchBytes));
  p.row_bytes = stride * row_bytes;
  return p;
}

/// One step's fetches: with several passes (kInOrder) per_step lines in address order, with one
/// pass the line at byte `offset` of each row. kInOrder is a template parameter so that the single
/// pass keeps the tile's registers as they were (FP8 on 4 rows ran 2-4% slower with the mode read
/// in the loop).
template <int OT, bool kInOrder>
inline void prefetch_step(TilePrefetch& p, int64_t offset) {
  if (p.next == nullptr) return;
  if constexpr (kInOrder) {
    for (int64_t k = 0; k < p.per_step && p.pos < p.end; ++k, p.pos += 64) __builtin_prefetch(p.next + p.pos, 0, 2);
  } else if (offset % 64 == 0) {  // once per cache line of each row (integers: see in_streams)
    // Into L1 (prefetcht0): the bench's 85 float32 products on far streams, one process
    // alternating the builds, medians of 15, against prefetcht1 1024 bytes ahead: 4 rows 15.6 ->
    // 13.9 ms, 6 rows 20.8 -> 18.5, 8 rows 19.7 -> 17.6, 12 rows 30.5 -> 28.5, 16 rows 31.6 -> 28.8
    // (now 2048 bytes ahead, kStreamPrefetchBytes; the same bits); bf16 and E4M3 tiles of one pass
    // (2 to 4 rows) within 2% either way. The decode step from a checkpoint: batch 4 15.6 -> 14.4
    // ms, batch 16 32.1 -> 30.1.
    const uintptr_t line = reinterpret_cast<uintptr_t>(p.next) + static_cast<uintptr_t>(offset);
    for (int oo = 0; oo < OT; ++oo)
      __builtin_prefetch(reinterpret_cast<const char*>(line + static_cast<uintptr_t>(oo * p.row_bytes)), 0, 3);
  }
}

/// A tile's outputs o, o + stride, ..., o + (OT - 1) * stride (stride 1: adjacent weight rows; see
/// rows_linear_typed) and their inputs' whole lines from prepare_inputs (null: none).
struct TileOutputs {
  int64_t o;
  int64_t stride;
  const float* prepared;
  int64_t at(int oo) const { return o + oo * stride; }
};

/// f(std::integral_constant<int, K>) for K = 0, ..., N - 1, in order (a line's parts).
template <int N, int K = 0, class F>
[[gnu::always_inline]] inline void for_parts(F&& f) {
  if constexpr (K < N) {
    f(std::integral_constant<int, K>());
    for_parts<N, K + 1>(f);
  }
}

/// The part of a tile over i < line_end (a multiple of the line's elements, whole scale blocks for
/// FP8) a whole cache line of each weight row per step: one load gives kLineParts<T> vectors of
/// weights in an interleaved order (Vec::load_line: shifts and masks, fewer shuffles), and each
/// input row is split into the same order once for the OT rows (Vec::split_inputs), or read so
/// split (and scaled) from the tile's prepared inputs (then M is kNone). A 64-byte
/// load is a whole cache line where a row's bytes are a multiple of 64. bf16 decode ran 6-8%
/// faster this way than widening half a line at a time; FP8 through halves showed no measurable
/// change, E4M3 through bfloat16 (Vec::load_line) gains 8-10%. With prepared inputs a step takes
/// the lines' parts one at a time over the tile (Vec::line_bits, line_part; each sum still adds
/// the parts in order, the same bits): the OT lines' bits (two vectors each), one part's RT inputs
/// and the OT x RT sums fit in the 32 registers, where one line's N parts, all RT x N inputs and
/// the sums (36 for E4M3 on 4 rows) did not. 4 rows of E4M3 in 128 x 128 blocks,
/// weights in L2, medians of 5 alternated runs: 6.78-7.33 -> 6.41-6.51 ms per 88M weights; the
/// bench model's FP8 decode step at batch 4, 4 alternations: 9.5-11.3 -> 8.7-9.9 ms; bf16 within
/// the noise. Lines with E4M3 zero exponents (see Vec::load_line) take load_line. Scales as in
/// tile_loop.
template <class Vec, WeightType T, int OT, int RT, ScaleMode M, bool kInOrder>
void tile_loop_lines(const RowsLinear& a, const TileOutputs& t, int64_t r, int64_t line_end,
                     typename Vec::V (&acc)[OT][RT], TilePrefetch& prefetch_state) {
  using V = typename Vec::V;
  constexpr int N = kLineParts<T>;
  constexpr int64_t step = N * Vec::kLanes;
  const int64_t in = a.in;
  const auto* w = static_cast<const WeightElement<T>*>(a.w);
  [[maybe_unused]] V input_scale = Vec::zero();
  TilePrefetch prefetch = prefetch_state;
  for (int64_t i = 0; i < line_end; i += step) {
    prefetch_step<OT, kInOrder>(prefetch, i * static_cast<int64_t>(sizeof(WeightElement<T>)));
    if constexpr (M == ScaleMode::kToInput) {
      if (i % a.fp8.block_in == 0)
        input_scale = Vec::set1(fp8_scale_at(a.fp8, t.o, i));  // a line never crosses a block
    }
    if (t.prepared != nullptr) {  // split (and scaled) once for the run (M is kNone)
      typename Vec::LineBits bits[OT];
      bool fix = false;
      for (int oo = 0; oo < OT; ++oo) {
        bits[oo] = Vec::template line_bits<T>(w + t.at(oo) * in + i);
        fix = fix || bits[oo].fix;
      }
      const float* x = t.prepared + r * line_end + i;
      if (!fix) {  // part by part: the OT lines' bits in registers, one part's inputs at a time
        for_parts<N>([&](auto part) {
          constexpr int k = decltype(part)::value;
          V xk[RT];
          for (int rr = 0; rr < RT; ++rr) xk[rr] = Vec::load(x + rr * line_end + k * Vec::kLanes);
          for (int oo = 0; oo < OT; ++oo) {
            const V wk = Vec::template line_part<T, k>(bits[oo]);
            for (int rr = 0; rr < RT; ++rr) acc[oo][rr] = Vec::fma(wk, xk[rr], acc[oo][rr]);
          }
        });
        continue;
      }
      for (int oo = 0; oo < OT; ++oo) {  // E4M3 with a zero exponent in a line: load_line fixes them
        V ws[N];
        Vec::template load_line<T>(w + t.at(oo) * in + i, ws);
        for (int k = 0; k < N; ++k)
          for (int rr = 0; rr < RT; ++rr)
            acc[oo][rr] = Vec::fma(ws[k], Vec::load(x + rr * line_end + k * Vec::kLanes), acc[oo][rr]);
      }
      continue;
    }
    V xs[RT][N];
    for (int rr = 0; rr < RT; ++rr) {
      Vec::template split_inputs<T>(a.x + (r + rr) * a.ldx + i, xs[rr]);
      if constexpr (M == ScaleMode::kToInput)
        for (int k = 0; k < N; ++k) xs[rr][k] = Vec::fma(xs[rr][k], input_scale, Vec::zero());
    }
    for (int oo = 0; oo < OT; ++oo) {
      V ws[N];
      Vec::template load_line<T>(w + t.at(oo) * in + i, ws);
      for (int k = 0; k < N; ++k)
        for (int rr = 0; rr < RT; ++rr) acc[oo][rr] = Vec::fma(ws[k], xs[rr][k], acc[oo][rr]);
    }
  }
  prefetch_state = prefetch;
}

/// The vector part of a tile: acc[oo][rr] += w(o + oo, i) * x(r + rr, i) over begin <= i <
/// vector_end (begin: where tile_loop_lines stopped, 0 without it).
template <class Vec, WeightType T, int OT, int RT, ScaleMode M, bool kInOrder>
void tile_loop(const RowsLinear& a, const TileOutputs& t, int64_t r, int64_t begin, int64_t vector_end,
               typename Vec::V (&acc)[OT][RT], TilePrefetch& prefetch_state) {
  using V = typename Vec::V;
  constexpr int64_t L = Vec::kLanes;
  const int64_t in = a.in;
  [[maybe_unused]] V input_scale = Vec::zero();  // kToInput: the tile's scale in the current block
  [[maybe_unused]] int64_t next_block = 0;       // FP8: where the next column block of scales starts
  TilePrefetch prefetch = prefetch_state;
  // The rows' starts, so that a step adds i to each: computed in the loop from t.at(oo) * in, they
  // took a stack load every step (registers ran out). With only that, the compiler loaded each
  // weight vector once per row at 2 rows (12.7 -> 13.3 ms below), so it is kept in a register
  // for the RT rows (Vec::in_register). The bench's 85 float32 products, one process alternating
  // the builds, medians of 15: 1 row 11.8 -> 10.9 ms, 3 rows 15.1 -> 14.3, 6 rows 17.1 -> 16.0,
  // 16 rows 31.4 -> 30.7, 2 rows 12.4 -> 12.5; the same bits.
  const WeightElement<T>* w_rows[OT];
  for (int oo = 0; oo < OT; ++oo) w_rows[oo] = static_cast<const WeightElement<T>*>(a.w) + t.at(oo) * in;
  const float* x_rows[RT];
  for (int rr = 0; rr < RT; ++rr) x_rows[rr] = a.x + (r + rr) * a.ldx;
  for (int64_t i = begin; i < vector_end; i += L) {
    prefetch_step<OT, kInOrder>(prefetch, i * static_cast<int64_t>(sizeof(WeightElement<T>)));
    // block_in is a multiple of L: a block boundary starts a vector.
    if constexpr (M == ScaleMode::kToInput) {
      if (i >= next_block) {  // at begin (maybe inside a block) and at each block's start
        input_scale = Vec::set1(fp8_scale_at(a.fp8, t.o, i));
        next_block = (i / a.fp8.block_in + 1) * a.fp8.block_in;
      }
    }
    V xv[RT];
    for (int rr = 0; rr < RT; ++rr) {
      xv[rr] = Vec::load(x_rows[rr] + i);
      if constexpr (M == ScaleMode::kToInput) xv[rr] = Vec::fma(xv[rr], input_scale, Vec::zero());
    }
    for (int oo = 0; oo < OT; ++oo) {
      V w = load_weights<Vec, T>(w_rows[oo], i);
      if constexpr (RT > 1) Vec::in_register(w);  // one load for the RT rows, not one each
      for (int rr = 0; rr < RT; ++rr) acc[oo][rr] = Vec::fma(w, xv[rr], acc[oo][rr]);
    }
  }
  prefetch_state = prefetch;
}

/// The vector part of a tile: whole lines where the instruction set has them (from `begin` on the
/// vectors, see linear_tile), then vectors.
template <class Vec, WeightType T, int OT, int RT, bool kInOrder>
void tile_loops(const RowsLinear& a, const TileOutputs& t, int64_t r, int64_t begin, int64_t vector_end, ScaleMode mode,
                typename Vec::V (&acc)[OT][RT], TilePrefetch& prefetch) {
  if constexpr (T != WeightType::kF32 && T != WeightType::kF16 && Vec::kWholeLines) {
    const ScaleMode line_mode = t.prepared != nullptr ? ScaleMode::kNone : mode;  // prepared: scaled already
    switch (line_mode) {
      case ScaleMode::kNone:
      case ScaleMode::kAtEnd:
        tile_loop_lines<Vec, T, OT, RT, ScaleMode::kNone, kInOrder>(a, t, r, begin, acc, prefetch);
        break;
      case ScaleMode::kToInput:
        tile_loop_lines<Vec, T, OT, RT, ScaleMode::kToInput, kInOrder>(a, t, r, begin, acc, prefetch);
        break;
    }
  }
  switch (mode) {
    case ScaleMode::kNone:
      tile_loop<Vec, T, OT, RT, ScaleMode::kNone, kInOrder>(a, t, r, begin, vector_end, acc, prefetch);
      break;
    case ScaleMode::kAtEnd:
      tile_loop<Vec, T, OT, RT, ScaleMode::kAtEnd, kInOrder>(a, t, r, begin, vector_end, acc, prefetch);
      break;
    case ScaleMode::kToInput:
      tile_loop<Vec, T, OT, RT, ScaleMode::kToInput, kInOrder>(a, t, r, begin, vector_end, acc, prefetch);
      break;
  }
}

/// Whether a product reads its weight rows as a few streams far apart (rows_linear_typed: tiles of
/// outputs a quarter of the range apart, no software prefetch below kStreamPrefetchRows rows, then
/// fetching ahead in each stream (TilePrefetch::in_streams); the same bits, since a tile adds
/// each output's terms in one order wherever its other outputs are).
template <class Vec, WeightType T>
bool streams_rows(const RowsLinear& a) {
  return a.one_stream && a.rows <= Vec::template kStreamRows<T>;
}

/// sums[oo * RT + rr] = Vec::sum(acc[oo][rr]), 16 at a time through Vec::lane_sums where the
/// instruction set has it (the same bits; zeros fill a last group of 8 or more). A tile of 4 x 4
/// f32 sums over the bench's 768 inputs, weights in L2: 16 reductions took about 8% of the tile.
template <class Vec, int OT, int RT>
[[gnu::always_inline]] inline void tile_sums(typename Vec::V (&acc)[OT][RT], float (&sums)[OT * RT]) {
  constexpr int n = OT * RT;
  int k = 0;
  if constexpr (Vec::kLaneSums) {
    for (; n - k >= 8; k += 16) {
      typename Vec::V group[16];
      for (int j = 0; j < 16; ++j) group[j] = k + j < n ? acc[(k + j) / RT][(k + j) % RT] : Vec::zero();
      float lanes[16];
      Vec::store(lanes, Vec::lane_sums(group));
      for (int j = 0; j < 16 && k + j < n; ++j) sums[k + j] = lanes[j];
    }
  }
  for (; k < n; ++k) sums[k] = Vec::sum(acc[k / RT][k % RT]);
}

/// A tile's sums: the vector accumulators' lanes added, the scalar tail (i >= vector_end) with its
/// scales, the bias; into a.y.
template <class Vec, WeightType T, int OT, int RT>
void store_tile(const RowsLinear& a, const TileOutputs& t, int64_t r, ScaleMode mode, int64_t vector_end,
                typename Vec::V (&acc)[OT][RT]) {
  const int64_t in = a.in;
  float sums[OT * RT];
  tile_sums<Vec, OT, RT>(acc, sums);
  for (int oo = 0; oo < OT; ++oo) {
    const int64_t o = t.at(oo);
    for (int rr = 0; rr < RT; ++rr) {
      float s = sums[oo * RT + rr];
      const float* x = a.x + (r + rr) * a.ldx;
      if (mode == ScaleMode::kAtEnd) {  // one scale for the whole row
        for (int64_t i = vector_end; i < in; ++i) s += weight_at<T>(a.w, o * in + i) * x[i];
        s *= fp8_scale_at(a.fp8, o, 0);
      } else {
        for (int64_t i = vector_end; i < in; ++i) {
          float w = weight_at<T>(a.w, o * in + i);
          if (mode != ScaleMode::kNone) w *= fp8_scale_at(a.fp8, o, i);
          s += w * x[i];
        }
      }
      if (a.bias != nullptr) s += a.bias[o];
      a.y[(r + rr) * a.ldy + o] = s;
    }
  }
}

/// Outputs t.at(0..OT) of rows [r, r + RT), row pass `pass` of `passes`: each weight vector is
/// loaded once for the RT rows.
template <class Vec, WeightType T, int OT, int RT>
void linear_tile(const RowsLinear& a, const TileOutputs& t, int64_t r, int64_t pass, int64_t passes) {
  using V = typename Vec::V;
  constexpr int64_t L = Vec::kLanes;
  const int64_t in = a.in;
  const int64_t vector_end = in - in % L;
  V acc[OT][RT];
  for (int oo = 0; oo < OT; ++oo)
    for (int rr = 0; rr < RT; ++rr) acc[oo][rr] = Vec::zero();
  ScaleMode mode = ScaleMode::kNone;
  if constexpr (is_fp8(T)) mode = a.fp8.block_in >= in ? ScaleMode::kAtEnd : ScaleMode::kToInput;  // one row block
  // Whole cache lines first where the instruction set has them (for FP8 only where a line never
  // straddles two scale blocks), then vectors, then scalars.
  constexpr bool kLines = T != WeightType::kF32 && T != WeightType::kF16 && Vec::kWholeLines;
  constexpr int64_t line = kLineParts<T> * L;
  int64_t begin = 0;
  if constexpr (kLines)
    if (mode == ScaleMode::kNone || mode == ScaleMode::kAtEnd || a.fp8.block_in % line == 0) begin = in - in % line;
  const int64_t row_bytes = in * static_cast<int64_t>(sizeof(WeightElement<T>));
  const bool streams = streams_rows<Vec, T>(a);
  const int64_t steps = streams ? 0 : begin / line + (vector_end - begin) / L;  // 0: no next tile fetched
  TilePrefetch prefetch = streams ? TilePrefetch::in_streams(a.w, t.o, t.stride, row_bytes, a.rows)
                                  : TilePrefetch(a, a.w, t.o, OT, row_bytes, pass, passes, steps);
  if (prefetch.per_step != 0)
    tile_loops<Vec, T, OT, RT, true>(a, t, r, begin, vector_end, mode, acc, prefetch);
  else
    tile_loops<Vec, T, OT, RT, false>(a, t, r, begin, vector_end, mode, acc, prefetch);
  store_tile<Vec, T, OT, RT>(a, t, r, mode, vector_end, acc);
}

/// Rows [r, r + rows) for the tile's outputs, 1 <= rows <= RT (a template per row count).
template <class Vec, WeightType T, int OT, int RT>
void linear_pass(const RowsLinear& a, const TileOutputs& t, int64_t r, int64_t rows, int64_t pass, int64_t passes) {
  if constexpr (RT > 1) {
    if (rows < RT) return linear_pass<Vec, T, OT, RT - 1>(a, t, r, rows, pass, passes);
  }
  linear_tile<Vec, T, OT, RT>(a, t, r, pass, passes);
}

/// Every row for the tile's outputs, in as few passes of at most row_tile<Vec, T> rows as there
/// can be, their rows as even as they can be (16 rows of f32 on AVX-512: 6, 5, 5).
template <class Vec, WeightType T, int OT>
void linear_outputs(const RowsLinear& a, const TileOutputs& t) {
  constexpr int RT = row_tile<Vec, T>;
  static_assert(RT >= 1 && RT <= 6, "row tiles of 1 to 6 rows (OT x RT accumulators and RT inputs in registers)");
  const int64_t passes = (a.rows + RT - 1) / RT;
  int64_t r = 0;
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t left = passes - pass, rows = (a.rows - r + left - 1) / left;
    linear_pass<Vec, T, OT, RT>(a, t, r, rows, pass, passes);
    r += rows;
  }
}

}  // namespace
}  // namespace vlmgen::kernels::raw
