// Choosing a kernel path, checking tensors, and spreading the work over ATen's threads.

#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "kernels_internal.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/kernels/cpu.h"

namespace vlmgen::kernels {
namespace {

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/// F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c". The
/// AVX2 and AVX-512 checks that go with it cover the OS's saving of the vector registers.
bool has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & (1u << 29)) != 0;
}
#endif

/// The CPU reports the path's instructions and this build compiled the path with them (a
/// compiler without the per-file flags builds the portable code under every name).
bool cpu_reports(Isa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  switch (isa) {
    case Isa::kPortable: return true;
    case Isa::kAvx2:
      return raw::avx2_compiled() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    case Isa::kAvx512:
      return raw::avx512_compiled() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             has_f16c();
  }
  return false;
#else
  return isa == Isa::kPortable;
#endif
}

/// An AMD CPU: CPUID leaf 0's vendor "AuthenticAMD" (EBX, EDX, ECX).
bool amd_cpu() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(0, &eax, &ebx, &ecx, &edx) != 0 && ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;
#else
  return false;
#endif
}

std::atomic<bool>& streams_rows_setting() {
  static std::atomic<bool> on{amd_cpu()};
  return on;
}

}  // namespace

namespace internal {

/// cpu_reports, asked once per path: CPUID traps to the hypervisor in a virtual machine (about
/// 7% of a bf16 decode step's time when every linear asked it).
bool cpu_has(Isa isa) {
  static const bool has[] = {cpu_reports(Isa::kPortable), cpu_reports(Isa::kAvx2), cpu_reports(Isa::kAvx512)};
  return has[static_cast<int>(isa)];
}

/// True when autograd would record an operation on any of `tensors`: the kernels keep no graph,
/// so such calls go through ATen.
bool needs_grad(std::initializer_list<const at::Tensor*> tensors) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : tensors)
    if (t->defined() && t->requires_grad()) return true;
  return false;
}

}  // namespace internal

namespace {
using internal::cpu_has;
using internal::needs_grad;

const char* isa_setting() {
  const char* cap = std::getenv("VLMGEN_CPU_ISA");
  return cap == nullptr ? "" : cap;
}

Isa choose_isa() {
  const std::vector<Isa> isas = supported_isas();
  Isa best = isas.back();
  const char* cap = isa_setting();
  if (*cap == '\0' || std::strcmp(cap, "aten") == 0) return best;
  for (Isa limit : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512}) {
    if (std::strcmp(cap, isa_name(limit)) != 0) continue;
    Isa chosen = Isa::kPortable;  // the best supported path at or below the cap
    for (Isa isa : isas)
      if (isa <= limit) chosen = isa;
    if (chosen != limit)
      std::fprintf(stderr, "vlmgen: VLMGEN_CPU_ISA=%s, but this CPU or build runs %s at most; using %s\n", cap,
                   isa_name(best), isa_name(chosen));
    return chosen;
  }
  VLMGEN_FAIL("VLMGEN_CPU_ISA must be portable, avx2, avx512 or aten, got '{}'", cap);
}

bool weight_dtype_ok(const at::Tensor& w, const Fp8Scales& fp8) {
  if (fp8.defined()) return w.scalar_type() == at::kByte && w.dim() == 2;
  return w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf;
}

}  // namespace

raw::WeightType internal::weight_type(const at::Tensor& w, const Fp8Scales& fp8) {
  if (fp8.defined()) return fp8.e5m2 ? raw::WeightType::kE5M2 : raw::WeightType::kE4M3;
  switch (w.scalar_type()) {
    case at::kFloat: return raw::WeightType::kF32;
    case at::kBFloat16: return raw::WeightType::kBF16;
    case at::kHalf: return raw::WeightType::kF16;
    default:
      VLMGEN_FAIL("kernels: weights must be float32, bfloat16 or float16 (or FP8 bytes with scales), got {}",
                  at::toString(w.scalar_type()));
  }
}

at::Tensor internal::checked_fp8_grid(const at::Tensor& w, const Fp8Scales& fp8) {
  if (!fp8.defined()) return {};
  const int64_t out = w.size(0), in = w.size(1);
  VLMGEN_CHECK(fp8.block_out >= 1 && fp8.block_in >= 1 && (fp8.block_in % 16 == 0 || fp8.block_in >= in),
               "kernels: FP8 scale blocks must be >= 1 and the input block a multiple of 16 or the whole row, got {} x "
               "{} for weight {}",
               fp8.block_out, fp8.block_in, detail::shape_str(w));
  const int64_t want[] = {(out + fp8.block_out - 1) / fp8.block_out, (in + fp8.block_in - 1) / fp8.block_in};
  VLMGEN_CHECK(fp8.grid.dim() == 2 && fp8.grid.size(0) == want[0] && fp8.grid.size(1) == want[1] &&
                   fp8.grid.scalar_type() == at::kFloat && fp8.grid.device().is_cpu(),
               "kernels: the FP8 scale grid of weight {} in blocks of {} x {} must be float32 [{}, {}], got {} {}",
               detail::shape_str(w), fp8.block_out, fp8.block_in, want[0], want[1],
               at::toString(fp8.grid.scalar_type()), detail::shape_str(fp8.grid));
  return fp8.grid.contiguous();
}

raw::Fp8Scales internal::raw_scales(const at::Tensor& grid, const Fp8Scales& fp8) {
  raw::Fp8Scales r;
  if (!grid.defined()) return r;
  r.grid = grid.data_ptr<float>();
  r.grid_cols = grid.size(1);
  r.block_out = fp8.block_out;
  r.block_in = fp8.block_in;
  r.factor = fp8.e5m2 ? 1.0f : 256.0f;  // E4M3 bytes read as halves are 2^-8 of their value
  return r;
}

using internal::raw_scales;
using internal::run_rows_linear;
using internal::run_widen;
using internal::weight_type;

void internal::run_rows_linear(Isa isa, const raw::RowsLinear& a, int64_t begin, int64_t end) {
  switch (isa) {
    case Isa::kAvx512: return raw::rows_linear_avx512(a, begin, end);
    case Isa::kAvx2: return raw::rows_linear_avx2(a, begin, end);
    case Isa::kPortable: return raw::rows_linear_portable(a, begin, end);
  }
}

void internal::run_widen(Isa isa, const raw::WidenArgs& a, int64_t begin, int64_t end) {
  switch (isa) {
    case Isa::kAvx512: return raw::widen_avx512(a, begin, end);
    case Isa::kAvx2: return raw::widen_avx2(a, begin, end);
    case Isa::kPortable: return raw::widen_portable(a, begin, end);
  }
}

void internal::widen_rows(Isa isa, const at::Tensor& weight, const Fp8Scales& fp8, const at::Tensor& grid,
                          int64_t first, int64_t last, float* dst) {
  const int64_t cols = weight.dim() == 2 ? weight.size(1) : 1;
  raw::WidenArgs a{weight.data_ptr(), weight_type(weight, fp8), dst, cols, raw_scales(grid, fp8), first * cols};
  if (fp8.defined()) {  // by rows
    at::parallel_for(first, last, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, cols)),
                     [&](int64_t begin, int64_t end) { run_widen(isa, a, begin, end); });
  } else {
    at::parallel_for(first * cols, last * cols, 1 << 16,
                     [&](int64_t begin, int64_t end) { run_widen(isa, a, begin, end); });
  }
}

void internal::run_attention(Isa isa, const raw::HeadGroupAttention& a) {
  switch (isa) {
    case Isa::kAvx512: return raw::attention_avx512(a);
    case Isa::kAvx2: return raw::attention_avx2(a);
    case Isa::kPortable: return raw::attention_portable(a);
  }
}

bool internal::weight_fits(const at::Tensor& weight, const at::Tensor& bias, const Fp8Scales& fp8) {
  return weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() && weight_dtype_ok(weight, fp8) &&
         (!bias.defined() || (bias.scalar_type() == at::kFloat && bias.device().is_cpu()));
}

bool internal::kernel_fits(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                           const Fp8Scales& fp8) {
  return x.device().is_cpu() && x.scalar_type() == at::kFloat && weight_fits(weight, bias, fp8);
}

void internal::linear_rows(Isa isa, const float* x, int64_t ldx, int64_t rows, const at::Tensor& weight,
                           const float* bias, const at::Tensor& grid, const Fp8Scales& fp8, float* y, int64_t ldy) {
  const int64_t out_features = weight.size(0), in = weight.size(1);
  if (rows <= 0 || out_features <= 0) return;
  const raw::RowsLinear a{x,    ldx, rows, weight.data_ptr(), weight_type(weight, fp8), in,
                          bias, y,   ldy,  out_features,      raw_scales(grid, fp8),    streams_weight_rows()};
  if (fp8.defined() && rows >= kFp8WidenedRows && in > 0) return internal::fp8_rows_widened(isa, a, weight, grid, fp8);
  // About 64 KiB of weights per task, in whole output tiles of 4.
  const int64_t row_bytes = std::max<int64_t>(1, in * static_cast<int64_t>(weight.element_size()));
  const int64_t grain = std::max<int64_t>(4, (65536 / row_bytes + 3) / 4 * 4);
  at::parallel_for(0, out_features, grain, [&](int64_t begin, int64_t end) {
    raw::RowsLinear part = a;
    part.out_end = end;
    run_rows_linear(isa, part, begin, end);
  });
}

using internal::checked_fp8_grid;
using internal::kernel_fits;
using internal::run_attention;
using internal::widen_rows;

bool streams_weight_rows() { return streams_rows_setting().load(std::memory_order_relaxed); }

void set_streams_weight_rows(bool on) { streams_rows_setting().store(on, std::memory_order_relaxed); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kPortable: return "portable";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512})
    if (cpu_has(isa)) out.push_back(isa);
  return out;
}

Isa active_isa() {
  static const Isa isa = choose_isa();
  return isa;
}

bool enabled() {
  static const bool on = (active_isa(), std::strcmp(isa_setting(), "aten") != 0);
  return on;
}

namespace {

/// x [..., in] against weight [out, in] and bias [out] or none: a vlmgen::Error naming them
/// otherwise, before any work.
void check_linear_shapes(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t in = weight.size(1), out_features = weight.size(0);
  VLMGEN_CHECK(x.dim() >= 1 && x.size(-1) == in, "kernels::linear: input {} does not end in the weight's {} columns",
               detail::shape_str(x), in);
  VLMGEN_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == out_features),
               "kernels::linear: bias {} must be [{}]", detail::shape_str(bias), out_features);
}

}  // namespace

int64_t internal::leading_rows(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

at::Tensor linear_on(Isa isa, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                     const Fp8Scales& fp8) {
  VLMGEN_CHECK(cpu_has(isa), "kernels::linear: this CPU cannot run the {} path", isa_name(isa));
  VLMGEN_CHECK(!needs_grad({&x, &weight, &bias}),
               "kernels::linear_on keeps no autograd graph, but an input requires grad (use kernels::linear, or "
               "run under at::NoGradGuard / c10::InferenceMode)");
  VLMGEN_CHECK(kernel_fits(x, weight, bias, fp8),
               "kernels::linear: needs float32 input, a contiguous 2-D float32/bfloat16/float16 weight (or uint8 FP8 "
               "bytes with their scales) and a float32 bias on the CPU, got input {} {}, weight {} {}{}",
               at::toString(x.scalar_type()), detail::shape_str(x), at::toString(weight.scalar_type()),
               detail::shape_str(weight), fp8.defined() ? " with FP8 scales" : "");
  check_linear_shapes(x, weight, bias);
  const int64_t in = weight.size(1);
  const int64_t out_features = weight.size(0);
  const int64_t rows = internal::leading_rows(x);
  if (rows > max_fast_rows(weight.scalar_type())) return internal::many_rows_linear(isa, true, x, weight, bias, fp8);
  const at::Tensor grid = checked_fp8_grid(weight, fp8);
  const at::Tensor flat = x.reshape({rows, in}).contiguous();
  const at::Tensor b = bias.defined() ? bias.contiguous() : bias;
  at::Tensor y = at::empty({rows, out_features}, x.options());
  internal::linear_rows(isa, flat.data_ptr<float>(), in, rows, weight, b.defined() ? b.data_ptr<float>() : nullptr,
                        grid, fp8, y.data_ptr<float>(), out_features);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  return y.view(shape);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const Fp8Scales& fp8) {
  VLMGEN_CHECK(x.dim() >= 1, "kernels::linear: the input must have a feature dimension, got {}", detail::shape_str(x));
  if (weight.dim() == 2) check_linear_shapes(x, weight, bias);  // every path, before any work
  const int64_t rows = internal::leading_rows(x);
  const bool fits = kernel_fits(x, weight, bias, fp8) && !needs_grad({&x, &weight, &bias});
  // 16-bit and FP8 weights stay on the kernel for more rows: widening them costs a pass over the
  // matrix, which a few more rows of kernel work pays for.
  const int64_t max_rows = max_fast_rows(weight.scalar_type());
  if (rows <= max_rows && fits && enabled()) return linear_on(active_isa(), x, weight, bias, fp8);
  // Many rows: the GEMM tiles on AVX2 and AVX-512, else ATen's GEMM on float32 weights (16-bit and
  // FP8 weights widened here: ATen's own bfloat16 widening is ~10x slower, and it cannot read FP8).
  const bool tiles = fits && enabled() && active_isa() != Isa::kPortable;
  if (tiles || (fits && (fp8.defined() || (weight.scalar_type() != at::kFloat && enabled())))) {
    return internal::many_rows_linear(active_isa(), tiles, x, weight, bias, fp8);
  }
  VLMGEN_CHECK(!fp8.defined(), "kernels::linear: FP8 weights need float32 input on the CPU, got {} on {}",
               at::toString(x.scalar_type()), x.device().str());
  if (!x.device().is_cpu() && weight.scalar_type() != x.scalar_type() && at::isFloatingType(weight.scalar_type())) {
    // A 16-bit model on an accelerator computes in its weights' dtype (no per-call widened copy).
    const at::Tensor b = bias.defined() ? bias.to(weight.scalar_type()) : bias;
    return detail::linear(x.to(weight.scalar_type()), weight, b).to(x.scalar_type());
  }
  VLMGEN_CHECK(at::isFloatingType(weight.scalar_type()),
               "kernels::linear: a {} weight is FP8 bytes only with its scales (Fp8Scales), got none",
               at::toString(weight.scalar_type()));
  const at::Tensor w = weight.scalar_type() == x.scalar_type() ? weight : weight.to(x.scalar_type());
  return detail::linear(x, w, bias);
}

at::Tensor widen_on(Isa isa, const at::Tensor& weight, const Fp8Scales& fp8) {
  VLMGEN_CHECK(cpu_has(isa), "kernels::widen: this CPU cannot run the {} path", isa_name(isa));
  VLMGEN_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight_dtype_ok(weight, fp8),
               "kernels::widen: needs a contiguous float32/bfloat16/float16 CPU tensor (or 2-D uint8 FP8 bytes with "
               "their scales), got {} {}",
               at::toString(weight.scalar_type()), detail::shape_str(weight));
  const at::Tensor grid = checked_fp8_grid(weight, fp8);
  at::Tensor out = at::empty(weight.sizes(), weight.options().dtype(at::kFloat));
  if (out.numel() > 0)
    widen_rows(isa, weight, fp8, grid, 0, weight.dim() == 2 ? weight.size(0) : weight.numel(), out.data_ptr<float>());
  return out;
}

at::Tensor decode_attention_on(Isa isa, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& key_real, int64_t first_query_key, double scale) {
  VLMGEN_CHECK(cpu_has(isa), "kernels::decode_attention: this CPU cannot run the {} path", isa_name(isa));
  VLMGEN_CHECK(!needs_grad({&q, &k, &v}),
               "kernels::decode_attention keeps no autograd graph, but q, k or v requires grad (run under "
               "at::NoGradGuard / c10::InferenceMode)");
  const bool bf16 = k.scalar_type() == at::kBFloat16, fp8 = k.scalar_type() == at::kByte;
  const int64_t extra = fp8 ? raw::kFp8RowScaleBytes : 0;  // an FP8 row's scale
  VLMGEN_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                   q.size(3) + extra == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
               "kernels::decode_attention: q [B, heads, S, D] and k, v [B, kv_heads, K, D{}] with heads a multiple of "
               "kv_heads, got q {}, k {}, v {}",
               fp8 ? " + 4 (FP8 rows)" : "", detail::shape_str(q), detail::shape_str(k), detail::shape_str(v));
  const int64_t b = q.size(0), heads = q.size(1), s = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1), keys = k.size(2);
  VLMGEN_CHECK(key_real.dim() == 2 && key_real.size(0) == b && key_real.size(1) == keys && key_real.device().is_cpu(),
               "kernels::decode_attention: key_real must be [{}, {}] on the CPU, got {} on {}", b, keys,
               detail::shape_str(key_real), key_real.device().str());
  VLMGEN_CHECK(q.scalar_type() == at::kFloat && (k.scalar_type() == at::kFloat || bf16 || fp8) &&
                   v.scalar_type() == k.scalar_type() && q.device().is_cpu() && k.device().is_cpu() &&
                   v.device().is_cpu(),
               "kernels::decode_attention: CPU tensors, q float32 and k, v both float32, bfloat16 or uint8 (FP8) "
               "expected, got q {} on {}, k {} on {}, v {} on {}",
               at::toString(q.scalar_type()), q.device().str(), at::toString(k.scalar_type()), k.device().str(),
               at::toString(v.scalar_type()), v.device().str());
  // K and V are read in place when each row of D floats is contiguous and rows are evenly spaced.
  auto rows_in_place = [](const at::Tensor& t) {
    return t.stride(3) == 1 && (t.size(2) <= 1 || t.stride(2) >= t.size(3));
  };
  const at::Tensor kk = rows_in_place(k) ? k : k.contiguous();
  const at::Tensor vv = rows_in_place(v) && v.strides() == kk.strides() ? v : v.contiguous();
  const at::Tensor k2 = kk.strides() == vv.strides() ? kk : kk.contiguous();
  const at::Tensor qq = q.contiguous();
  const at::Tensor real = key_real.ne(0).to(at::kByte).contiguous();
  at::Tensor out = at::empty({b, heads, s, dim}, q.options());
  const int64_t groups = heads / kv_heads;
  at::parallel_for(0, b * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(std::max<int64_t>(1, groups * keys)));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, head = task % kv_heads;
      const int64_t q_offset = (row * heads + head * groups) * s * dim;
      const int64_t k_at = row * k2.stride(0) + head * k2.stride(1), v_at = row * vv.stride(0) + head * vv.stride(1);
      const bool plain = !bf16 && !fp8;
      raw::HeadGroupAttention a{qq.data_ptr<float>() + q_offset,
                                s * dim,
                                plain ? k2.data_ptr<float>() + k_at : nullptr,
                                plain ? vv.data_ptr<float>() + v_at : nullptr,
                                k2.stride(2),
                                real.data_ptr<uint8_t>() + row * keys,
                                keys,
                                groups,
                                s,
                                first_query_key,
                                dim,
                                static_cast<float>(scale),
                                out.data_ptr<float>() + q_offset,
                                scratch.data(),
                                bf16 ? static_cast<const uint16_t*>(k2.data_ptr()) + k_at : nullptr,
                                bf16 ? static_cast<const uint16_t*>(vv.data_ptr()) + v_at : nullptr,
                                fp8 ? k2.data_ptr<uint8_t>() + k_at : nullptr,
                                fp8 ? vv.data_ptr<uint8_t>() + v_at : nullptr};
      run_attention(isa, a);
    }
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_real,
                            int64_t first_query_key, double scale) {
  return decode_attention_on(active_isa(), q, k, v, key_real, first_query_key, scale);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double weight_offset) {
  const bool fits = enabled() && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 &&
                    weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                    weight.size(0) == x.size(-1) && !needs_grad({&x, &weight});
  if (!fits) {  // ATen, the same formula
    const at::Tensor scaled = x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return weight_offset == 0 ? scaled * weight : scaled * (weight + weight_offset);
  }
  const at::Tensor xx = x.contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty(xx.sizes(), xx.options());
  const int64_t d = x.size(-1);
  const int64_t rows = d == 0 ? 0 : xx.numel() / d;
  const float offset = static_cast<float>(weight_offset), epsilon = static_cast<float>(eps);
  const float* in = xx.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    internal::rms_norm_rows(in + begin * d, end - begin, d, wp, epsilon, offset, out + begin * d);
  });
  return y;
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  auto same_kind = [&](const at::Tensor& t) {
    return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == x.dim();
  };
  bool fits = enabled() && same_kind(x) && same_kind(cos) && same_kind(sin) && x.dim() >= 1 && x.size(-1) % 2 == 0 &&
              !needs_grad({&x, &cos, &sin});
  for (int64_t i = 0; fits && i < x.dim(); ++i)  // cos and sin broadcast to x, never x to them
    fits = (cos.size(i) == x.size(i) || cos.size(i) == 1) && (sin.size(i) == x.size(i) || sin.size(i) == 1);
  if (!fits) {  // ATen, the same formula
    const int64_t half = x.size(-1) / 2;
    return x * cos + at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1) * sin;
  }
  // Every operand as a [rows, D] walk over x's shape: the expanded cos and sin have stride 0 on
  // their broadcast dimensions, so one row offset formula serves all three.
  const at::Tensor xs = x.stride(-1) == 1 ? x : x.contiguous();
  const at::Tensor c = cos.contiguous().expand(x.sizes()), sn = sin.contiguous().expand(x.sizes());
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t d = x.size(-1), dims = x.dim();
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  const float* xp = xs.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      int64_t rest = r, xo = 0, co = 0, so = 0;
      for (int64_t i = dims - 2; i >= 0; --i) {
        const int64_t at_i = rest % x.size(i);
        rest /= x.size(i);
        xo += at_i * xs.stride(i);
        co += at_i * c.stride(i);
        so += at_i * sn.stride(i);
      }
      internal::rotary_row(xp + xo, cp + co, sp + so, d, yp + r * d);
    }
  });
  return y;
}

}  // namespace vlmgen::kernels
