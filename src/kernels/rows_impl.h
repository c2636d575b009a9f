#pragma once

// The row products' drivers over the tiles of kernels_impl.h (which inputs are prepared, in what
// order a call's outputs go) and the widening of weights to float32. Included only by the
// instruction-set files, like kernels_impl.h, and with its rule: no inline function of another
// header.

#include "kernels_impl.h"

namespace vlmgen::kernels::raw {
// Internal linkage: each instruction-set file gets its own copy, compiled with its own flags.
namespace {

/// FP8 row blocks narrower than this keep splitting and scaling the inputs in every tile (a run
/// per block would prepare the inputs too often).
constexpr int64_t kMinPreparedBlock = 16;
/// At most this many floats of prepared inputs per thread (1 MiB; more rows or wider rows split
/// and scale in every tile, as before): the scratch a thread keeps stays small.
constexpr int64_t kMaxPreparedFloats = int64_t{1} << 18;

/// Whether a line-wise product prepares its inputs once per run of tiles instead of in every tile:
/// 16-bit-to-float lines of bfloat16 or FP8 on an instruction set with whole lines, FP8 scales
/// per tensor or channel, or blocks whose lines never straddle a column block and whose row blocks
/// are wide enough.
template <class Vec, WeightType T>
bool prepares_inputs(const RowsLinear& a) {
  if constexpr (!Vec::kWholeLines || !(T == WeightType::kBF16 || is_fp8(T))) {
    return false;
  } else {
    constexpr int64_t line = kLineParts<T> * Vec::kLanes;
    if (a.in < line || a.rows * (a.in - a.in % line) > kMaxPreparedFloats) return false;
    if constexpr (is_fp8(T)) {
      if (a.fp8.block_in < a.in) return a.fp8.block_in % line == 0 && a.fp8.block_out >= kMinPreparedBlock;
    }
    return true;
  }
}

/// Each row's whole lines split into the line order (Vec::split_inputs) once, and for FP8 blocks
/// narrower than the row times the scales of output o's row block (as kToInput does per tile, the
/// same roundings), into `buffer` (returned): row r at buffer + r * line_end.
/// This takes the split's permutes (E4M3: 8 a line, bf16: 2, E5M2: 4) and FP8's 4 multiplies of
/// block scales per line and input row out of every tile of 4 outputs, about a fifth of an E4M3
/// tile's vector operations: the 85 products of the bench's 100M model with FP8 weights on 4 rows
/// went from 13.4 to 11.9 ms, on 1 row within the noise (memory-bound there). Runs stop at row
/// blocks' edges (rows_linear_runs, prepared or not), so no tile straddles one (such tiles scaled
/// their weights instead, and rounded differently from the rest of their blocks, depending on
/// where a thread's range began).
template <class Vec, WeightType T>
const float* prepare_inputs(const RowsLinear& a, int64_t o, float* buffer) {
  if constexpr (!Vec::kWholeLines || !(T == WeightType::kBF16 || is_fp8(T))) {
    return nullptr;  // not called (prepares_inputs)
  } else {
    constexpr int N = kLineParts<T>;
    constexpr int64_t step = N * Vec::kLanes;
    const int64_t line_end = a.in - a.in % step;
    bool scaled = false;
    if constexpr (is_fp8(T)) scaled = a.fp8.block_in < a.in;
    for (int64_t r = 0; r < a.rows; ++r) {
      for (int64_t i = 0; i < line_end; i += step) {
        typename Vec::V parts[N];
        Vec::template split_inputs<T>(a.x + r * a.ldx + i, parts);
        if (scaled) {
          const typename Vec::V scale = Vec::set1(fp8_scale_at(a.fp8, o, i));
          for (int k = 0; k < N; ++k) parts[k] = Vec::fma(parts[k], scale, Vec::zero());
        }
        for (int k = 0; k < N; ++k) Vec::store(buffer + r * line_end + i + k * Vec::kLanes, parts[k]);
      }
    }
    return buffer;
  }
}

/// Floats of one set of prepared inputs: the rows' whole lines.
template <class Vec, WeightType T>
int64_t prepared_floats(const RowsLinear& a) {
  constexpr int64_t line = kLineParts<T> * Vec::kLanes;
  return a.rows * (a.in - a.in % line);
}

/// Outputs [o_begin, o_end) in runs (an FP8 row block each where the scales are per block, else
/// the whole range) that share their prepared inputs, each run in tiles of OT outputs (adjacent,
/// or `far`: see rows_linear_typed), then one output at a time. No tile straddles a row block, so
/// every output of a block scales its inputs alike (kToInput) wherever a tile or a thread's range
/// begins.
template <class Vec, WeightType T>
void rows_linear_runs(const RowsLinear& a, int64_t o_begin, int64_t o_end, bool far) {
  constexpr int OT = Vec::kOutTile;
  const bool prepare = prepares_inputs<Vec, T>(a);
  const bool per_block = is_fp8(T) && a.fp8.block_in < a.in;
  int64_t o = o_begin;
  while (o < o_end) {
    int64_t run_end = o_end;
    if (per_block) {
      const int64_t block_end = (o / a.fp8.block_out + 1) * a.fp8.block_out;
      if (block_end < o_end) run_end = block_end;
    }
    const float* prepared = prepare ? prepare_inputs<Vec, T>(a, o, input_scratch(prepared_floats<Vec, T>(a))) : nullptr;
    if (far) {
      const int64_t per = (run_end - o) / OT;
      for (int64_t k = 0; k < per; ++k) linear_outputs<Vec, T, OT>(a, TileOutputs{o + k, per, prepared});
      o += OT * per;
    } else {
      for (; o + OT <= run_end; o += OT) linear_outputs<Vec, T, OT>(a, TileOutputs{o, 1, prepared});
    }
    for (; o < run_end; ++o) linear_outputs<Vec, T, 1>(a, TileOutputs{o, 1, prepared});
  }
}

/// Outputs o[0..OT) of one input row from FP8 weights with block scales, the outputs in row blocks
/// of their own; `x`: the row's whole lines split (not scaled), up to line_end. Each output's
/// inputs are scaled here, line by line, by its own block's scale (Vec::fma(x, scale, 0), as
/// prepare_inputs does), and the rest is the arithmetic of a tile of adjacent outputs over prepared
/// inputs (tile_loop_lines, then tile_loop with kToInput past the lines, store_tile), output by
/// output: the same bits. The bench's 85 products (128 x 128 blocks, 1 row, interleaved medians
/// of 15): 3.0-3.1 ms, against 3.9-4.0 for streams within row blocks, 3.3-3.6 for adjacent tiles,
/// 2.8 with one scale per tensor. Inputs prepared for each output's block instead (4 distinct input
/// lines per weight line) made the loop wait on its loads: 4.5-5.2 ms.
template <class Vec, WeightType T>
void far_block_tile(const RowsLinear& a, const int64_t (&o)[Vec::kOutTile], const float* x, int64_t line_end) {
  using V = typename Vec::V;
  constexpr int OT = Vec::kOutTile;
  constexpr int N = kLineParts<T>;
  constexpr int64_t step = N * Vec::kLanes;
  const auto* w = static_cast<const WeightElement<T>*>(a.w);
  const float* grid_rows[OT];
  for (int s = 0; s < OT; ++s) grid_rows[s] = a.fp8.grid + (o[s] / a.fp8.block_out) * a.fp8.grid_cols;
  V acc[OT][1];
  V scales[OT];
  for (int s = 0; s < OT; ++s) acc[s][0] = scales[s] = Vec::zero();
  int64_t column = -1, next = 0;
  for (int64_t i = 0; i < line_end; i += step) {
    if (i == next) {  // block_in is a multiple of the line (rows_linear_typed)
      ++column;
      next += a.fp8.block_in;
      for (int s = 0; s < OT; ++s) scales[s] = Vec::set1(grid_rows[s][column] * a.fp8.factor);  // fp8_scale_at
    }
    V xs[N];
    for (int k = 0; k < N; ++k) xs[k] = Vec::load(x + i + k * Vec::kLanes);
    for (int s = 0; s < OT; ++s) {
      V ws[N];
      Vec::template load_line<T>(w + o[s] * a.in + i, ws);
      for (int k = 0; k < N; ++k) acc[s][0] = Vec::fma(ws[k], Vec::fma(xs[k], scales[s], Vec::zero()), acc[s][0]);
    }
  }
  const int64_t vector_end = a.in - a.in % Vec::kLanes;
  for (int s = 0; s < OT; ++s) {
    const TileOutputs t{o[s], 1, nullptr};
    V one[1][1] = {{acc[s][0]}};
    TilePrefetch none;
    if (line_end < vector_end)
      tile_loop<Vec, T, 1, 1, ScaleMode::kToInput, false>(a, t, 0, line_end, vector_end, one, none);
    store_tile<Vec, T, 1, 1>(a, t, 0, ScaleMode::kToInput, vector_end, one);
  }
}

/// One input row's FP8 products with block scales over outputs [o_begin, o_end) as OT far streams
/// that cross row blocks (rows_linear_typed): streams within a row block (rows_linear_runs) are a
/// quarter of a block long (32 rows for 128-row blocks) and the prefetcher starts each one again;
/// across blocks they run the whole range, as with one scale per tensor. The inputs are split once;
/// the outputs left over go one at a time.
template <class Vec, WeightType T>
void far_across_blocks(const RowsLinear& a, int64_t o_begin, int64_t o_end) {
  constexpr int OT = Vec::kOutTile;
  constexpr int N = kLineParts<T>;
  constexpr int64_t step = N * Vec::kLanes;
  const int64_t line_end = a.in - a.in % step;
  float* x = input_scratch(line_end);
  for (int64_t i = 0; i < line_end; i += step) {
    typename Vec::V parts[N];
    Vec::template split_inputs<T>(a.x + i, parts);
    for (int k = 0; k < N; ++k) Vec::store(x + i + k * Vec::kLanes, parts[k]);
  }
  const int64_t per = (o_end - o_begin) / OT;
  for (int64_t k = 0; k < per; ++k) {
    int64_t o[OT];
    for (int s = 0; s < OT; ++s) o[s] = o_begin + k + s * per;
    far_block_tile<Vec, T>(a, o, x, line_end);
  }
  for (int64_t o = o_begin + OT * per; o < o_end; ++o) rows_linear_runs<Vec, T>(a, o, o + 1, false);
}

/// Products that stream their weights (streams_rows) read them as OT streams far apart: a tile
/// takes outputs o + k + s * per (s < OT, per a quarter of the run on AVX-512), so each stream moves
/// forward row by row through its own part of the matrix, without software prefetch (from
/// kStreamPrefetchRows rows on, fetching 1 KB ahead in each stream: TilePrefetch::in_streams). An AMD
/// EPYC's hardware prefetcher keeps several such streams going where it followed the OT adjacent
/// rows of a tile, or one row at a time, badly. A standalone read of the 85 products of the
/// bench's 100M model, 1 row, cold, medians of 11 interleaved runs: f32 1 stream 12.1-13.9 ms, 4
/// streams 8.7-11.0; bf16 8.1-8.6 -> 4.6-6.4; E4M3 in adjacent tiles with prefetch 5.0, 4 streams
/// 2.8-2.9 (2 streams in between, 8 slower than 4). The outputs' arithmetic is that of adjacent
/// tiles (a run's tiles share its prepared inputs), so the bits are the same either way. One row
/// of FP8 with block scales, in whole lines, streams across row blocks (far_across_blocks).
template <class Vec, WeightType T>
void rows_linear_typed(const RowsLinear& a, int64_t o_begin, int64_t o_end) {
  const bool far = streams_rows<Vec, T>(a);
  if constexpr (is_fp8(T) && Vec::kWholeLines) {
    constexpr int64_t line = kLineParts<T> * Vec::kLanes;
    if (far && a.rows == 1 && a.in >= line && a.in - a.in % line <= kMaxPreparedFloats && a.fp8.block_in < a.in &&
        a.fp8.block_in % line == 0 && o_end - o_begin >= Vec::kOutTile)
      return far_across_blocks<Vec, T>(a, o_begin, o_end);
  }
  rows_linear_runs<Vec, T>(a, o_begin, o_end, far);
}

template <class Vec>
void rows_linear(const RowsLinear& a, int64_t o_begin, int64_t o_end) {
  switch (a.wtype) {
    case WeightType::kF32: return rows_linear_typed<Vec, WeightType::kF32>(a, o_begin, o_end);
    case WeightType::kBF16: return rows_linear_typed<Vec, WeightType::kBF16>(a, o_begin, o_end);
    case WeightType::kF16: return rows_linear_typed<Vec, WeightType::kF16>(a, o_begin, o_end);
    case WeightType::kE4M3: return rows_linear_typed<Vec, WeightType::kE4M3>(a, o_begin, o_end);
    case WeightType::kE5M2: return rows_linear_typed<Vec, WeightType::kE5M2>(a, o_begin, o_end);
  }
}

template <class Vec, WeightType T>
void widen_typed(const WidenArgs& a, int64_t begin, int64_t end) {
  constexpr int64_t L = Vec::kLanes;
  if constexpr (is_fp8(T)) {  // row by row: [begin, end) counts rows of a.cols weights
    for (int64_t row = begin; row < end; ++row) {
      const int64_t base = row * a.cols;
      float* dst = a.dst + (base - a.dst_begin);
      int64_t i = 0;
      for (; i + L <= a.cols; i += L) {  // block_in is a multiple of L
        const typename Vec::V w = load_weights<Vec, T>(a.src, base + i);
        Vec::store(dst + i, Vec::fma(w, Vec::set1(fp8_scale_at(a.fp8, row, i)), Vec::zero()));
      }
      for (; i < a.cols; ++i) dst[i] = weight_at<T>(a.src, base + i) * fp8_scale_at(a.fp8, row, i);
    }
  } else {                                       // [begin, end) counts elements
    float* dst = a.dst + (begin - a.dst_begin);  // dst[i - begin] receives element i
    int64_t i = begin;
    for (; i + L <= end; i += L) Vec::store(dst + (i - begin), load_weights<Vec, T>(a.src, i));
    for (; i < end; ++i) dst[i - begin] = weight_at<T>(a.src, i);
  }
}

/// a.dst = the weights of a.src as float32 (FP8: times their scales), over [begin, end): elements,
/// or rows for FP8.
template <class Vec>
void widen(const WidenArgs& a, int64_t begin, int64_t end) {
  switch (a.type) {
    case WeightType::kF32: return widen_typed<Vec, WeightType::kF32>(a, begin, end);
    case WeightType::kBF16: return widen_typed<Vec, WeightType::kBF16>(a, begin, end);
    case WeightType::kF16: return widen_typed<Vec, WeightType::kF16>(a, begin, end);
    case WeightType::kE4M3: return widen_typed<Vec, WeightType::kE4M3>(a, begin, end);
    case WeightType::kE5M2: return widen_typed<Vec, WeightType::kE5M2>(a, begin, end);
  }
}

}  // namespace
}  // namespace vlmgen::kernels::raw
