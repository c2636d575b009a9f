// Choosing a kernel path, checking tensors, and spreading the work over ATen's threads.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "raw_kernels.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/kernels/cpu.h"

namespace vlmgen::kernels {
namespace {

bool cpu_has(Isa isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  switch (isa) {
    case Isa::kPortable: return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::kAvx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("f16c");
  }
  return false;
#else
  return isa == Isa::kPortable;
#endif
}

const char* isa_setting() {
  const char* cap = std::getenv("VLMGEN_CPU_ISA");
  return cap == nullptr ? "" : cap;
}

Isa choose_isa() {
  const std::vector<Isa> isas = supported_isas();
  Isa best = isas.back();
  const char* cap = isa_setting();
  if (*cap == '\0' || std::strcmp(cap, "aten") == 0) return best;
  for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512}) {
    if (std::strcmp(cap, isa_name(isa)) == 0) return std::min(best, isa);
  }
  VLMGEN_FAIL("VLMGEN_CPU_ISA must be portable, avx2, avx512 or aten, got '{}'", cap);
}

raw::WeightType weight_type(const at::Tensor& w) {
  switch (w.scalar_type()) {
    case at::kFloat: return raw::WeightType::kF32;
    case at::kBFloat16: return raw::WeightType::kBF16;
    case at::kHalf: return raw::WeightType::kF16;
    default:
      VLMGEN_FAIL("kernels::linear: weights must be float32, bfloat16 or float16, got {}",
                  at::toString(w.scalar_type()));
  }
}

void run_rows_linear(Isa isa, const raw::RowsLinear& a, int64_t begin, int64_t end) {
  switch (isa) {
    case Isa::kAvx512: return raw::rows_linear_avx512(a, begin, end);
    case Isa::kAvx2: return raw::rows_linear_avx2(a, begin, end);
    case Isa::kPortable: return raw::rows_linear_portable(a, begin, end);
  }
}

void run_widen(Isa isa, const void* src, raw::WeightType type, float* dst, int64_t begin, int64_t end) {
  switch (isa) {
    case Isa::kAvx512: return raw::widen_avx512(src, type, dst, begin, end);
    case Isa::kAvx2: return raw::widen_avx2(src, type, dst, begin, end);
    case Isa::kPortable: return raw::widen_portable(src, type, dst, begin, end);
  }
}

void run_attention(Isa isa, const raw::HeadGroupAttention& a) {
  switch (isa) {
    case Isa::kAvx512: return raw::attention_avx512(a);
    case Isa::kAvx2: return raw::attention_avx2(a);
    case Isa::kPortable: return raw::attention_portable(a);
  }
}

bool kernel_fits(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  return x.device().is_cpu() && weight.device().is_cpu() && x.scalar_type() == at::kFloat && weight.dim() == 2 &&
         weight.is_contiguous() &&
         (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16 ||
          weight.scalar_type() == at::kHalf) &&
         (!bias.defined() || (bias.scalar_type() == at::kFloat && bias.device().is_cpu()));
}

}  // namespace

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

at::Tensor linear_on(Isa isa, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  VLMGEN_CHECK(cpu_has(isa), "kernels::linear: this CPU cannot run the {} path", isa_name(isa));
  VLMGEN_CHECK(kernel_fits(x, weight, bias),
               "kernels::linear: needs float32 input, a contiguous 2-D float32/bfloat16/float16 weight and a float32 "
               "bias on the CPU, got input {} {}, weight {} {}",
               at::toString(x.scalar_type()), detail::shape_str(x), at::toString(weight.scalar_type()),
               detail::shape_str(weight));
  const int64_t in = weight.size(1);
  const int64_t out_features = weight.size(0);
  VLMGEN_CHECK(x.dim() >= 1 && x.size(-1) == in, "kernels::linear: input {} does not end in the weight's {} columns",
               detail::shape_str(x), in);
  VLMGEN_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == out_features),
               "kernels::linear: bias {} must be [{}]", detail::shape_str(bias), out_features);
  const int64_t rows = in == 0 ? 0 : x.numel() / in;
  at::Tensor flat = x.reshape({rows, in}).contiguous();
  at::Tensor b = bias.defined() ? bias.contiguous() : bias;
  at::Tensor y = at::empty({rows, out_features}, x.options());
  raw::RowsLinear a{flat.data_ptr<float>(),
                    in,
                    rows,
                    weight.data_ptr(),
                    weight_type(weight),
                    in,
                    b.defined() ? b.data_ptr<float>() : nullptr,
                    y.data_ptr<float>(),
                    out_features,
                    out_features};
  if (rows > 0 && out_features > 0) {
    // About 64 KiB of weights per task, in whole output tiles of 4.
    const int64_t row_bytes = std::max<int64_t>(1, in * static_cast<int64_t>(weight.element_size()));
    const int64_t grain = std::max<int64_t>(4, (65536 / row_bytes + 3) / 4 * 4);
    at::parallel_for(0, out_features, grain, [&](int64_t begin, int64_t end) {
      raw::RowsLinear part = a;
      part.out_end = end;
      run_rows_linear(isa, part, begin, end);
    });
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  return y.view(shape);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  const int64_t in = x.size(-1);
  const int64_t rows = in == 0 ? 0 : x.numel() / in;
  if (rows <= kMaxFastRows && kernel_fits(x, weight, bias) && enabled())
    return linear_on(active_isa(), x, weight, bias);
  if (x.scalar_type() == at::kFloat && kernel_fits(x, weight, bias) && weight.scalar_type() != at::kFloat &&
      enabled()) {
    return detail::linear(x, widen_on(active_isa(), weight), bias);  // ATen's own widening is ~10x slower
  }
  const at::Tensor w = weight.scalar_type() == x.scalar_type() ? weight : weight.to(x.scalar_type());
  return detail::linear(x, w, bias);
}

at::Tensor widen_on(Isa isa, const at::Tensor& weight) {
  VLMGEN_CHECK(cpu_has(isa), "kernels::widen: this CPU cannot run the {} path", isa_name(isa));
  VLMGEN_CHECK(weight.device().is_cpu() && weight.is_contiguous() &&
                   (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16 ||
                    weight.scalar_type() == at::kHalf),
               "kernels::widen: needs a contiguous float32/bfloat16/float16 CPU tensor, got {} {}",
               at::toString(weight.scalar_type()), detail::shape_str(weight));
  at::Tensor out = at::empty(weight.sizes(), weight.options().dtype(at::kFloat));
  const raw::WeightType type = weight_type(weight);
  const void* src = weight.data_ptr();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, weight.numel(), 1 << 16,
                   [&](int64_t begin, int64_t end) { run_widen(isa, src, type, dst, begin, end); });
  return out;
}

at::Tensor decode_attention_on(Isa isa, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& key_real, int64_t first_query_key, double scale) {
  VLMGEN_CHECK(cpu_has(isa), "kernels::decode_attention: this CPU cannot run the {} path", isa_name(isa));
  VLMGEN_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == k.size(0) &&
                   q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
               "kernels::decode_attention: q [B, heads, S, D] and k, v [B, kv_heads, K, D] with heads a multiple of "
               "kv_heads, got q {}, k {}, v {}",
               detail::shape_str(q), detail::shape_str(k), detail::shape_str(v));
  const int64_t b = q.size(0), heads = q.size(1), s = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1), keys = k.size(2);
  VLMGEN_CHECK(key_real.dim() == 2 && key_real.size(0) == b && key_real.size(1) == keys,
               "kernels::decode_attention: key_real must be [{}, {}], got {}", b, keys, detail::shape_str(key_real));
  VLMGEN_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                   q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
               "kernels::decode_attention: float32 CPU tensors expected, got q {}, k {}, v {}",
               at::toString(q.scalar_type()), at::toString(k.scalar_type()), at::toString(v.scalar_type()));
  // K and V are read in place when each row of D floats is contiguous and rows are evenly spaced.
  auto rows_in_place = [](const at::Tensor& t) {
    return t.stride(3) == 1 && (t.size(2) <= 1 || t.stride(2) >= t.size(3));
  };
  const at::Tensor kk = rows_in_place(k) ? k : k.contiguous();
  const at::Tensor vv = rows_in_place(v) && v.strides() == kk.strides() ? v : v.contiguous();
  const at::Tensor k2 = kk.strides() == vv.strides() ? kk : kk.contiguous();
  const at::Tensor qq = q.contiguous();
  const at::Tensor real = key_real.to(at::kByte).contiguous();
  at::Tensor out = at::empty({b, heads, s, dim}, q.options());
  const int64_t groups = heads / kv_heads;
  at::parallel_for(0, b * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(std::max<int64_t>(1, groups * keys)));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / kv_heads, head = task % kv_heads;
      const int64_t q_offset = (row * heads + head * groups) * s * dim;
      raw::HeadGroupAttention a{qq.data_ptr<float>() + q_offset,
                                s * dim,
                                k2.data_ptr<float>() + row * k2.stride(0) + head * k2.stride(1),
                                vv.data_ptr<float>() + row * vv.stride(0) + head * vv.stride(1),
                                k2.stride(2),
                                real.data_ptr<uint8_t>() + row * keys,
                                keys,
                                groups,
                                s,
                                first_query_key,
                                dim,
                                static_cast<float>(scale),
                                out.data_ptr<float>() + q_offset,
                                scratch.data()};
      run_attention(isa, a);
    }
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_real,
                            int64_t first_query_key, double scale) {
  return decode_attention_on(active_isa(), q, k, v, key_real, first_query_key, scale);
}

}  // namespace vlmgen::kernels
