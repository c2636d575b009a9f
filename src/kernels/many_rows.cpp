// Products of more rows than the decode kernels take (a prefill's, the vision tower's): the GEMM
// tiles of gemm_impl.h on AVX2 and AVX-512, ATen's GEMM on the portable path and with the
// kernels off. And FP8 products of many rows within the decode kernels' range, over weights
// widened once per call.

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "kernels_internal.h"

namespace vlmgen::kernels::internal {
namespace {

void run_gemm(Isa isa, const raw::RowsLinear& a, int64_t begin, int64_t end) {
  switch (isa) {
    case Isa::kAvx512: return raw::gemm_avx512(a, begin, end);
    case Isa::kAvx2: return raw::gemm_avx2(a, begin, end);
    case Isa::kPortable: return raw::gemm_portable(a, begin, end);
  }
}

/// y[r * ldy + o] = x[r, :] . w[o, :] (+ bias[o]) for rows x [rows, in] and a float32 weight
/// w [n, in], on the ATen threads: each takes whole blocks of outputs (kGemmBlockBytes of weights).
void gemm_rows(Isa isa, const float* x, int64_t rows, int64_t in, const float* w, int64_t n, const float* bias,
               float* y, int64_t ldy) {
  const raw::RowsLinear a{x, in, rows, w, raw::WeightType::kF32, in, bias, y, ldy, n, {}};
  // Whole blocks, in whole tiles of every path (6, 3 or 4 outputs): no task ends in one-output tiles.
  const int64_t grain = std::max<int64_t>(12, raw::kGemmBlockBytes / std::max<int64_t>(1, in * 4) / 12 * 12);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { run_gemm(isa, a, begin, end); });
}

/// Floats of widened FP8 weights per chunk: 64 KiB, whole rows of 4 outputs.
constexpr int64_t kFp8ChunkFloats = 16384;

/// Output rows per widened block of a weight with `in` inputs, in whole tiles of every path (12
/// outputs): on the GEMM tiles one GEMM block's worth (kGemmBlockBytes) per ATen thread, at least
/// 4 and at most 16 (4 MiB) of them; ATen's GEMM (`tiles` false) always takes 16, so how it rounds
/// a block does not follow the thread count. Against 4 MiB whatever the threads: a 512-token FP8
/// prefill of the bench's 100M model on one thread peaked 2 MB lower (the buffer is the thread's
/// to keep), its time within the noise.
int64_t widen_block_rows(bool tiles, int64_t in) {
  const int64_t blocks = tiles ? std::clamp<int64_t>(at::get_num_threads(), 4, 16) : 16;
  const int64_t floats = blocks * raw::kGemmBlockBytes / static_cast<int64_t>(sizeof(float));
  return std::max<int64_t>(12, floats / std::max<int64_t>(1, in) / 12 * 12);
}

}  // namespace

/// The FP8 product of many rows over weights widened a chunk of outputs at a time into a buffer
/// each thread keeps (in L2), then read as float32: each weight is decoded once per call instead
/// of once per tile of 4 rows. The MLPs of the bench's 100M model's 12 layers, one thread, AMD
/// EPYC, two interleaved runs: 32 rows 46.4 / 47.4 -> 39.7 / 41.4 ms, 64 rows 91.8 / 95.0 -> 62.5 /
/// 64.9 ms (bf16 weights 45.6-49.7, f32 55.6-58.2); 16 rows 23.6 / 24.1 -> 28.8 / 30.1 ms (the
/// widening then costs more than the repeated decoding), hence the threshold.
void fp8_rows_widened(Isa isa, const raw::RowsLinear& a, const at::Tensor& weight, const at::Tensor& grid,
                      const Fp8Scales& fp8) {
  const int64_t out_features = weight.size(0), in = a.in;
  const int64_t chunk = std::max<int64_t>(4, kFp8ChunkFloats / std::max<int64_t>(1, in) / 4 * 4);
  at::parallel_for(0, out_features, chunk, [&](int64_t begin, int64_t end) {
    thread_local AlignedFloats widened;
    widened.resize(static_cast<size_t>(chunk * in));
    for (int64_t o = begin; o < end; o += chunk) {
      const int64_t n = std::min(chunk, end - o);
      const raw::WidenArgs w{
          weight.data_ptr(), weight_type(weight, fp8), widened.data(), in, raw_scales(grid, fp8), o * in};
      run_widen(isa, w, o, o + n);  // FP8: by rows
      const raw::RowsLinear part{a.x,
                                 a.ldx,
                                 a.rows,
                                 widened.data(),
                                 raw::WeightType::kF32,
                                 in,
                                 a.bias == nullptr ? nullptr : a.bias + o,
                                 a.y + o,
                                 a.ldy,
                                 n,
                                 {}};
      run_rows_linear(isa, part, 0, n);
    }
  });
}

/// A 16-bit or FP8 weight is widened a block of output rows at a time into one buffer that each
/// thread keeps: a prefill allocates no float32 copy of each matrix per call (those
/// multi-megabyte allocations are what moves glibc's mmap threshold and slows later decoding).
at::Tensor many_rows_linear(Isa isa, bool tiles, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                            const Fp8Scales& fp8) {
  const at::Tensor grid = checked_fp8_grid(weight, fp8);
  const int64_t out_features = weight.size(0), in = weight.size(1);
  const int64_t rows = leading_rows(x);
  const at::Tensor flat = x.reshape({rows, in}).contiguous();
  const at::Tensor b = bias.defined() ? bias.contiguous() : bias;
  const float* bias_data = tiles && b.defined() ? b.data_ptr<float>() : nullptr;  // else added after
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows > 0 && out_features > 0) {
    if (tiles && weight.scalar_type() == at::kFloat && !fp8.defined()) {
      gemm_rows(isa, flat.data_ptr<float>(), rows, in, weight.data_ptr<float>(), out_features, bias_data,
                y.data_ptr<float>(), out_features);
    } else {
      const int64_t block = widen_block_rows(tiles, in);
      thread_local AlignedFloats buffer;  // grown to the largest block asked for, no spare capacity
      buffer.resize(static_cast<size_t>(std::min(block, out_features) * in));
      for (int64_t first = 0; first < out_features; first += block) {
        const int64_t n = std::min(block, out_features - first);
        widen_rows(isa, weight, fp8, grid, first, first + n, buffer.data());
        if (tiles) {
          gemm_rows(isa, flat.data_ptr<float>(), rows, in, buffer.data(), n,
                    bias_data == nullptr ? nullptr : bias_data + first, y.data_ptr<float>() + first, out_features);
        } else {
          const at::Tensor w = at::from_blob(buffer.data(), {n, in}, at::TensorOptions().dtype(at::kFloat));
          at::Tensor part = y.narrow(1, first, n);
          at::mm_out(part, flat, w.t());
        }
      }
    }
  }
  if (!tiles && b.defined()) y.add_(b);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  return y.view(shape);
}

}  // namespace vlmgen::kernels::internal
