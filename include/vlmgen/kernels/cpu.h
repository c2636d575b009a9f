#pragma once

// CPU kernels of the decode step: a linear for a few rows that reads each weight once for all
// of them (f32, bf16 or f16 weights, f32 accumulation), and attention of a few query columns over
// a KV cache in one pass over its keys and values per KV head (blocks of 64 keys, a running
// softmax; grouped query heads share the pass);
// and the row kernels prefill uses too (RMSNorm, SwiGLU's product, rotary, the scaled softmax).
// Each has an AVX-512, an AVX2 (+FMA, F16C) and a portable path, chosen at run time from what the
// CPU supports; VLMGEN_CPU_ISA=portable|avx2|avx512 caps the choice, and VLMGEN_CPU_ISA=aten
// turns the kernels off (every product and attention through ATen, for comparisons).
// A decode step of the Qwen-family decoders on the CPU runs its layers fused (one pass over
// buffers of its own, no tensor per operation) on these kernels; VLMGEN_FUSED_DECODE=0 runs the
// same kernels op by op instead (the results are the same bit for bit).
//
//   at::Tensor y = vlmgen::kernels::linear(x, weight, bias);   // like at::linear, any row count
//
// More rows (a prefill's, the vision tower's) run on GEMM tiles of the same paths (AVX2, AVX-512;
// a 16-bit or FP8 weight widened a block at a time); on the portable path, other devices and
// other dtypes they go to ATen. Among calls of more than max_fast_rows rows on one path, and
// among calls of at most max_row_invariant_rows, a row's result is the same whatever other rows
// it comes with (the path a call takes depends on its row count, and the decode kernels and the
// tiles round differently).

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace vlmgen::kernels {

enum class Isa { kPortable, kAvx2, kAvx512 };

/// "portable", "avx2" or "avx512".
const char* isa_name(Isa isa);
/// The paths this CPU can run, portable first.
std::vector<Isa> supported_isas();
/// The path the kernels use: the best supported one, capped by VLMGEN_CPU_ISA when set (an unknown
/// value is a vlmgen::Error naming the accepted ones, raised at the first use of the kernels).
Isa active_isa();

/// False when VLMGEN_CPU_ISA=aten: linear() and the models' decode attention use ATen only.
bool enabled();

/// Whether products of few rows (on AVX-512 every row count up to max_fast_rows with float32
/// weights, 1 to 2 with 16-bit and 1 with FP8 ones; on AVX2 1 row with float32 or 16-bit weights)
/// read their weight rows as four streams far apart (a tile's outputs a quarter of a thread's range apart; for FP8 with
/// several column blocks of scales that are not whole 64-weight lines, or rows of more than 2^18
/// weights, a quarter of the range's part of a row block; from 4 float32 rows on fetching 1 KB ahead
/// in each stream) instead of tiles of adjacent rows with software prefetch of the next tile. The
/// results have the same bits either way; only the
/// speed differs. On by default on AMD CPUs (whose hardware prefetcher keeps several streams going
/// but follows adjacent rows badly: one row's 85 products of the bench's model ran 1.2-1.6x faster),
/// off elsewhere; for all threads.
bool streams_weight_rows();
void set_streams_weight_rows(bool on);

/// The scales of FP8 weights kept as their bytes (uint8 [out, in], E4M3 or E5M2): weight(o, i) =
/// value(byte) * grid[o / block_out][i / block_in]. Per tensor: one block of the whole weight;
/// per output channel: blocks of one row. block_in must be a multiple of 16 or cover the row.
struct Fp8Scales {
  at::Tensor grid;  ///< [ceil(out / block_out), ceil(in / block_in)], float32, on the CPU
  int64_t block_out = 1;
  int64_t block_in = 1;
  bool e5m2 = false;  ///< false: E4M3
  bool defined() const { return grid.defined(); }
};

/// Products with at most this many rows run on the decode kernels, which read each weight once
/// for all rows (float32 weights; 16-bit and FP8 weights up to kMaxFastRowsNarrow); more run on
/// the GEMM tiles (AVX2, AVX-512) or ATen's GEMM (portable). Calls that autograd would record
/// (GradMode on and an input requiring grad) always go to ATen.
constexpr int64_t kMaxFastRows = 16;
constexpr int64_t kMaxFastRowsNarrow = 64;
/// The most rows linear() runs on the kernels for a weight stored as `weight_dtype` (uint8: FP8
/// bytes).
constexpr int64_t max_fast_rows(at::ScalarType weight_dtype) {
  return weight_dtype == at::kFloat ? kMaxFastRows : kMaxFastRowsNarrow;
}
/// FP8 products of this many rows or more on the decode kernels widen the weights once per call
/// and multiply float32 weights (each weight times its scale, rounded), where fewer rows scale the
/// inputs: other roundings.
constexpr int64_t kFp8WidenedRows = 24;
/// The most rows a call of linear() may have for each of its rows to get the bits that row gets
/// alone (on the kernels): max_fast_rows, and below kFp8WidenedRows for FP8 bytes.
constexpr int64_t max_row_invariant_rows(at::ScalarType weight_dtype) {
  return weight_dtype == at::kByte ? kFp8WidenedRows - 1 : max_fast_rows(weight_dtype);
}

/// x [..., in] (float32) times weight [out, in] (float32, bfloat16 or float16, contiguous; or FP8
/// bytes with `fp8` scales) transposed, plus bias [out] (float32) when defined: [..., out],
/// float32. When enabled(): the decode kernels for up to max_fast_rows rows, the GEMM tiles for
/// more (ATen's GEMM on the portable path, on the weights widened to float32); with the kernels
/// off, ATen. On other devices a 16-bit weight computes in its dtype.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {},
                  const Fp8Scales& fp8 = {});
/// The same on a given path (tests compare the paths); every row count runs on the kernels (the
/// GEMM tiles above max_fast_rows, the portable path's too).
at::Tensor linear_on(Isa isa, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {},
                     const Fp8Scales& fp8 = {});

/// `weight` (contiguous float32, bfloat16 or float16 on the CPU, or FP8 bytes with `fp8` scales)
/// as a new float32 tensor.
at::Tensor widen_on(Isa isa, const at::Tensor& weight, const Fp8Scales& fp8 = {});

/// Attention of the window's query columns over keys, for a few query columns (decode):
///   q [B, heads, S, D], k and v [B, kv_heads, K, D] (float32, or both bfloat16: a bfloat16 KV
///   cache, widened as read; or both uint8 [B, kv_heads, K, D + 4]: an FP8 cache's rows,
///   encode_fp8_kv_row; last dim contiguous; a narrowed KV cache is read in place), key_real [B, K]
///   (bool or integer: the key is not padding).
/// Query column s sees key j when j <= first_query_key + s and key_real[b, j]; a query with no
/// visible key averages all K values (what a softmax over equally blocked scores gives).
/// Query head h uses KV head h / (heads / kv_heads). Returns [B, heads, S, D], float32.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_real,
                            int64_t first_query_key, double scale);
at::Tensor decode_attention_on(Isa isa, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& key_real, int64_t first_query_key, double scale);

/// RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * (weight + weight_offset)
/// (weight_offset 1: Gemma's (1 + w)). Float32 x and weight [x.size(-1)] on the CPU run in one
/// pass per row (float accumulation, like ATen's); anything else, calls autograd would record, and
/// VLMGEN_CPU_ISA=aten go through ATen's ops with the same formula.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double weight_offset = 0);

/// SwiGLU's gated product silu(gate) * up = gate * sigmoid(gate) * up, elementwise. Float32 CPU
/// tensors of one shape run on the kernels (the sigmoid from e^-|gate|: within 3e-7 relative of
/// float64 for gate >= -87; below, where silu's magnitude is under 1.5e-36, within 2e-36
/// absolute); anything else, calls autograd would record, and VLMGEN_CPU_ISA=aten compute
/// at::silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);
/// The same on a given path (float32 CPU tensors of one shape).
at::Tensor silu_mul_on(Isa isa, const at::Tensor& gate, const at::Tensor& up);
/// gate = silu_mul(gate, up), the same values, written into gate's own storage where the kernels
/// take it (a contiguous float32 CPU gate; a prefill's [tokens, intermediate] activation then
/// needs no third tensor of that size; autograd's version counter of gate moves on); otherwise gate
/// is rebound to silu_mul's result.
void silu_mul_into(at::Tensor& gate, const at::Tensor& up);

/// x = softmax(x * scale) over the last dimension (attention's scores times the model's scale,
/// 1 / sqrt(head_dim) for most), in x's own storage where the kernels take it: a contiguous float32
/// CPU tensor autograd does not record, scale positive and finite as a float32 (autograd's version
/// counter of x moves on, as for ATen's in-place ops). The same two roundings as ATen's softmax of
/// x * scale (each product, then its difference from the row's largest) and one exponential
/// (within 2e-7 relative; arguments below -87, masked scores, give exact zeros); measured within
/// 1e-6 relative of float64's per probability on rows of up to a thousand keys (the sum's rounding
/// grows slowly with the row). A row whose scores are all equal (every key masked with one
/// finite value) comes out uniform. Anything else, and VLMGEN_CPU_ISA=aten: x is rebound to
/// at::softmax(x * scale, -1).
void scaled_softmax_into(at::Tensor& x, double scale);
/// The same on a given path, into a new tensor (float32 CPU).
at::Tensor scaled_softmax_on(Isa isa, const at::Tensor& x, double scale);

/// Rotary embedding in HF's rotate_half convention: x * cos + rotate_half(x) * sin, where
/// rotate_half maps the last dimension's halves (x1, x2) to (-x2, x1). cos and sin have x's rank
/// and broadcast to it (e.g. x [B, heads, S, D] with [B, 1, S, D]). Float32 CPU tensors run in one
/// pass per row (each product rounded, then the sum, as ATen's ops compute it); anything else,
/// calls autograd would record, and VLMGEN_CPU_ISA=aten go through ATen's ops.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace vlmgen::kernels
