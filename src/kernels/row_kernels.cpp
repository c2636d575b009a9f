// The row kernels of kernels_internal.h that are not a matrix product: RMSNorm, rotary, the
// gated activation, the scaled softmax and attention over a KV cache laid out by rows; and the buffers on whole cache
// lines (AlignedFloats, raw::input_scratch).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <new>
#include <vector>

#include "kernels_internal.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"

namespace vlmgen::kernels {

internal::AlignedFloats::~AlignedFloats() { std::free(data_); }

void internal::AlignedFloats::resize(size_t n) {
  if (n <= size_) return;
  std::free(data_);
  data_ = static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64));
  size_ = data_ != nullptr ? n : 0;
  if (data_ == nullptr) throw std::bad_alloc();
}

float* raw::input_scratch(int64_t n) {
  thread_local internal::AlignedFloats scratch;
  scratch.resize(static_cast<size_t>(std::max<int64_t>(n, 0)));
  return scratch.data();
}

namespace {

/// After a kernel wrote into x's storage: autograd's version counter moves on as for ATen's own
/// in-place ops (a node that saved x then refuses to run backward instead of using the new values).
void mark_written(at::Tensor& x) {
  if (!x.is_inference()) x.unsafeGetTensorImpl()->bump_version();
}

/// Float32 CPU gate and up of one shape that autograd does not record, the kernels enabled.
bool silu_mul_fits(const at::Tensor& gate, const at::Tensor& up) {
  return enabled() && gate.device().is_cpu() && up.device().is_cpu() && gate.scalar_type() == at::kFloat &&
         up.scalar_type() == at::kFloat && gate.sizes() == up.sizes() && !internal::needs_grad({&gate, &up});
}

}  // namespace

at::Tensor silu_mul_on(Isa isa, const at::Tensor& gate, const at::Tensor& up) {
  VLMGEN_CHECK(internal::cpu_has(isa), "kernels::silu_mul: this CPU cannot run the {} path", isa_name(isa));
  VLMGEN_CHECK(gate.device().is_cpu() && up.device().is_cpu() && gate.scalar_type() == at::kFloat &&
                   up.scalar_type() == at::kFloat && gate.sizes() == up.sizes() && !internal::needs_grad({&gate, &up}),
               "kernels::silu_mul: float32 CPU gate and up of one shape that autograd does not record, got {} {} and "
               "{} {}",
               at::toString(gate.scalar_type()), detail::shape_str(gate), at::toString(up.scalar_type()),
               detail::shape_str(up));
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor y = at::empty(g.sizes(), g.options());
  const int64_t n = g.numel();
  const float* gp = g.data_ptr<float>();
  const float* upp = u.data_ptr<float>();
  internal::silu_mul(isa, gp, upp, y.data_ptr<float>(), n);
  return y;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  if (!silu_mul_fits(gate, up)) return at::silu(gate) * up;
  return silu_mul_on(active_isa(), gate, up);
}

void silu_mul_into(at::Tensor& gate, const at::Tensor& up) {
  if (!silu_mul_fits(gate, up) || !gate.is_contiguous()) {
    gate = silu_mul(gate, up);
    return;
  }
  const at::Tensor u = up.contiguous();
  internal::silu_mul(active_isa(), gate.data_ptr<float>(), u.data_ptr<float>(), gate.data_ptr<float>(), gate.numel());
  mark_written(gate);
}

namespace {

/// A scale that is positive and finite as a float (the kernel's).
bool usable_scale(double scale) {
  const float f = static_cast<float>(scale);
  return f > 0 && std::isfinite(f);
}

/// A float32 CPU tensor autograd does not record, the kernels enabled, a usable scale.
bool softmax_fits(const at::Tensor& x, double scale) {
  return enabled() && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && usable_scale(scale) &&
         !internal::needs_grad({&x});
}

}  // namespace

at::Tensor scaled_softmax_on(Isa isa, const at::Tensor& x, double scale) {
  VLMGEN_CHECK(internal::cpu_has(isa), "kernels::scaled_softmax: this CPU cannot run the {} path", isa_name(isa));
  VLMGEN_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && !internal::needs_grad({&x}),
               "kernels::scaled_softmax: a float32 CPU tensor of at least one dimension that autograd does not "
               "record, got {} {} on {}{}",
               at::toString(x.scalar_type()), detail::shape_str(x), x.device().str(),
               x.requires_grad() ? " that requires grad" : "");
  VLMGEN_CHECK(usable_scale(scale), "kernels::scaled_softmax: a scale positive and finite as a float32, got {}", scale);
  at::Tensor y = x.clone(at::MemoryFormat::Contiguous);
  const int64_t n = x.size(-1);
  if (y.numel() > 0) internal::scaled_softmax(isa, y.data_ptr<float>(), y.numel() / n, n, static_cast<float>(scale));
  return y;
}

void scaled_softmax_into(at::Tensor& x, double scale) {
  if (!softmax_fits(x, scale) || !x.is_contiguous()) {
    x = at::softmax(x * scale, -1);
    return;
  }
  const int64_t n = x.size(-1);
  if (x.numel() > 0)
    internal::scaled_softmax(active_isa(), x.data_ptr<float>(), x.numel() / n, n, static_cast<float>(scale));
  mark_written(x);
}

}  // namespace vlmgen::kernels

namespace vlmgen::kernels::internal {

void rms_norm_rows(const float* x, int64_t rows, int64_t d, const float* w, float eps, float offset, float* y) {
  constexpr int kLanes = 8;  // independent partial sums: the loop vectorizes and pipelines
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    float part[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= d; i += kLanes)
      for (int l = 0; l < kLanes; ++l) part[l] += xr[i + l] * xr[i + l];
    float squares = 0;
    for (; i < d; ++i) squares += xr[i] * xr[i];
    for (float p : part) squares += p;
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(d) + eps);
    float* yr = y + r * d;
    for (int64_t j = 0; j < d; ++j) yr[j] = xr[j] * inv * (w[j] + offset);
  }
}

void rotary_row(const float* x, const float* cos, const float* sin, int64_t d, float* y) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j] * cos[j];
    const float b = -x[j + half] * sin[j];
    y[j] = a + b;
  }
  for (int64_t j = half; j < d; ++j) {
    const float a = x[j] * cos[j];
    const float b = x[j - half] * sin[j];
    y[j] = a + b;
  }
}

void silu_mul(Isa isa, const float* gate, const float* up, float* y, int64_t n) {
  at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
    switch (isa) {
      case Isa::kAvx512: return raw::silu_mul_avx512(gate + begin, up + begin, y + begin, end - begin);
      case Isa::kAvx2: return raw::silu_mul_avx2(gate + begin, up + begin, y + begin, end - begin);
      case Isa::kPortable: return raw::silu_mul_portable(gate + begin, up + begin, y + begin, end - begin);
    }
  });
}

void scaled_softmax(Isa isa, float* x, int64_t rows, int64_t n, float scale) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(n, 1)),
                   [&](int64_t begin, int64_t end) {
                     float* first = x + begin * n;
                     switch (isa) {
                       case Isa::kAvx512: return raw::scaled_softmax_avx512(first, end - begin, n, scale);
                       case Isa::kAvx2: return raw::scaled_softmax_avx2(first, end - begin, n, scale);
                       case Isa::kPortable: return raw::scaled_softmax_portable(first, end - begin, n, scale);
                     }
                   });
}

void attend_cache(Isa isa, const CacheAttention& a) {
  const int64_t groups = a.heads / a.kv_heads;
  at::parallel_for(0, a.rows * a.kv_heads, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>(std::max<int64_t>(1, groups * a.keys)));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / a.kv_heads, head = task % a.kv_heads;
      const int64_t q_offset = (row * a.heads + head * groups) * a.dim;
      const int64_t at = row * a.row_stride + head * a.head_stride;
      const bool plain = a.k16 == nullptr && a.k8 == nullptr;
      const raw::HeadGroupAttention h{a.q + q_offset,
                                      a.dim,
                                      plain ? a.k + at : nullptr,
                                      plain ? a.v + at : nullptr,
                                      a.k8 != nullptr ? a.dim + raw::kFp8RowScaleBytes : a.dim,
                                      a.key_real + row * a.keys,
                                      a.keys,
                                      groups,
                                      /*columns=*/1,
                                      a.first_query_key,
                                      a.dim,
                                      a.scale,
                                      a.out + q_offset,
                                      scratch.data(),
                                      a.k16 != nullptr ? a.k16 + at : nullptr,
                                      a.v16 != nullptr ? a.v16 + at : nullptr,
                                      a.k8 != nullptr ? a.k8 + at : nullptr,
                                      a.v8 != nullptr ? a.v8 + at : nullptr};
      run_attention(isa, h);
    }
  });
}

}  // namespace vlmgen::kernels::internal
