// The fused CPU decode step of the Qwen-family decoder (see fused_decode.h).

#include "fused_decode.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../kernels/kernels_internal.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/kernels/cpu.h"

namespace vlmgen::detail {
namespace {

namespace ki = kernels::internal;

bool linear_fits(const qwen_vl::Linear& l, int64_t out, int64_t in, int64_t rows) {
  const at::Tensor& w = l.weight;
  return w.defined() && w.dim() == 2 && w.size(0) == out && w.size(1) == in &&
         rows <= kernels::max_fast_rows(w.scalar_type()) && ki::weight_fits(w, l.bias, l.fp8) &&
         !ki::needs_grad({&w, &l.bias}) && (!l.bias.defined() || (l.bias.is_contiguous() && l.bias.numel() == out)) &&
         (ki::checked_fp8_grid(w, l.fp8), true);  // a malformed scale grid throws before any cache write
}

bool norm_fits(const at::Tensor& w, int64_t d) {
  return w.defined() && w.dim() == 1 && w.size(0) == d && w.scalar_type() == at::kFloat && w.device().is_cpu() &&
         w.is_contiguous() && !ki::needs_grad({&w});
}

/// One linear of the step: y [rows, out] = x [rows, in] W^T (+ bias).
void run_linear(kernels::Isa isa, const qwen_vl::Linear& l, const float* x, int64_t rows, float* y) {
  const at::Tensor grid = ki::checked_fp8_grid(l.weight, l.fp8);
  ki::linear_rows(isa, x, l.weight.size(1), rows, l.weight, l.bias.defined() ? l.bias.data_ptr<float>() : nullptr, grid,
                  l.fp8, y, l.weight.size(0));
}

/// The step's working rows: every intermediate of one layer, reused by the next.
struct Buffers {
  ki::AlignedFloats h, q, k, v, kr, rotated, attended, out, gate, up;  // kr: one rotated key row
  void size(int64_t t, int64_t hidden, int64_t q_width, int64_t kv_width, int64_t inter) {
    auto fit = [](ki::AlignedFloats& b, int64_t n) { b.resize(static_cast<size_t>(n)); };
    fit(h, t * hidden);
    fit(q, t * q_width);
    fit(k, t * kv_width);
    fit(v, t * kv_width);
    fit(kr, kv_width);
    fit(rotated, t * q_width);
    fit(attended, t * q_width);
    fit(out, t * hidden);
    fit(gate, t * inter);
    fit(up, t * inter);
  }
};

/// The key or value row `src` of d floats into a cache row of the cache's dtype: float32 as is,
/// bfloat16 rounded to nearest even as ATen's conversion (what append_kv stores) does, FP8 as
/// append_kv encodes it.
void store_cache_row(const float* src, int64_t d, at::ScalarType dtype, void* dst) {
  if (dtype == at::kFloat) {
    std::memcpy(dst, src, static_cast<size_t>(d) * sizeof(float));
    return;
  }
  if (dtype == at::kByte) return encode_fp8_kv_row(src, d, static_cast<uint8_t*>(dst));
  auto* out = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < d; ++i) out[i] = c10::BFloat16(src[i]).x;
}

void add_rows(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

}  // namespace

bool fused_decode_fits(const qwen_vl::LanguageModel& lm, const QwenVlConfig& c, const at::Tensor& hidden,
                       const std::vector<FusedDecodeRows>& requests) {
  const char* setting = std::getenv("VLMGEN_FUSED_DECODE");  // "0": op by op (read per step, for comparisons)
  if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
  if (!kernels::enabled() || !hidden.device().is_cpu() || hidden.scalar_type() != at::kFloat || requests.empty() ||
      lm.layers.empty() || ki::needs_grad({&hidden}) || c.head_dim % 2 != 0)
    return false;
  const int64_t hs = c.hidden_size, d = c.head_dim, heads = c.num_attention_heads, kv = c.num_key_value_heads;
  if (hidden.dim() < 1 || hidden.size(-1) != hs || kv < 1 || heads % kv != 0) return false;
  const int64_t t = hidden.numel() / hs;
  int64_t next_row = 0;
  for (const FusedDecodeRows& r : requests) {
    const InferenceContext* ctx = r.context;
    if (ctx == nullptr || r.first_row != next_row || r.rows != ctx->batch_size() ||
        (ctx->spec().dtype != at::kFloat && ctx->spec().dtype != at::kBFloat16 && ctx->spec().dtype != at::kByte) ||
        !ctx->device().is_cpu() || ctx->spec().num_layers != static_cast<int64_t>(lm.layers.size()) ||
        ctx->spec().num_kv_heads != kv || ctx->spec().head_dim != d || ctx->length() + 1 > ctx->capacity() ||
        r.key_real.dim() != 2 || r.key_real.size(0) != r.rows || r.key_real.size(1) != ctx->length() + 1 ||
        r.key_real.element_size() != 1 || !r.key_real.device().is_cpu())
      return false;
    next_row += r.rows;
  }
  if (next_row != t) return false;
  for (const FusedDecodeRows& r : requests) {  // the layout fused_decode_layers writes into
    for (int64_t layer = 0; layer < r.context->num_layers(); ++layer) {
      const auto [keys, values] = r.context->layer_storage(layer);
      if (keys.stride(3) != 1 || keys.stride(2) != r.context->spec().row_width() || values.strides() != keys.strides())
        return false;
    }
  }
  for (const qwen_vl::DecoderLayer& w : lm.layers) {
    if (!norm_fits(w.input_layernorm, hs) || !norm_fits(w.post_attention_layernorm, hs) ||
        !linear_fits(w.q_proj, heads * d, hs, t) || !linear_fits(w.k_proj, kv * d, hs, t) ||
        !linear_fits(w.v_proj, kv * d, hs, t) || !linear_fits(w.o_proj, hs, heads * d, t) ||
        !linear_fits(w.gate_proj, c.intermediate_size, hs, t) || !linear_fits(w.up_proj, c.intermediate_size, hs, t) ||
        !linear_fits(w.down_proj, hs, c.intermediate_size, t) || w.q_norm.defined() != w.k_norm.defined() ||
        (w.q_norm.defined() && (!norm_fits(w.q_norm, d) || !norm_fits(w.k_norm, d))))
      return false;
  }
  return true;
}

at::Tensor fused_decode_layers(const qwen_vl::LanguageModel& lm, const QwenVlConfig& c, const at::Tensor& hidden,
                               const at::Tensor& cos, const at::Tensor& sin,
                               const std::vector<FusedDecodeRows>& requests) {
  const kernels::Isa isa = kernels::active_isa();
  const int64_t hs = c.hidden_size, d = c.head_dim, heads = c.num_attention_heads, kv = c.num_key_value_heads;
  const int64_t inter = c.intermediate_size, t = hidden.numel() / hs;
  const float eps = static_cast<float>(c.rms_norm_eps), scale = static_cast<float>(1.0 / std::sqrt(double(d)));
  VLMGEN_CHECK(cos.numel() == t * d && sin.numel() == t * d && cos.scalar_type() == at::kFloat &&
                   sin.scalar_type() == at::kFloat,
               "fused decode: rotary cos and sin must hold [{}, {}] floats, got {} and {}", t, d,
               detail::shape_str(cos), detail::shape_str(sin));
  at::Tensor x = hidden.reshape({t, hs}).clone(at::MemoryFormat::Contiguous);
  const at::Tensor cos_rows = cos.contiguous(), sin_rows = sin.contiguous();
  float* xp = x.data_ptr<float>();
  const float* cp = cos_rows.data_ptr<float>();
  const float* sp = sin_rows.data_ptr<float>();
  thread_local Buffers b;
  b.size(t, hs, heads * d, kv * d, inter);
  std::vector<at::Tensor> key_real;
  for (const FusedDecodeRows& r : requests) key_real.push_back(r.key_real.contiguous());

  for (size_t layer = 0; layer < lm.layers.size(); ++layer) {
    const qwen_vl::DecoderLayer& w = lm.layers[layer];
    ki::rms_norm_rows(xp, t, hs, w.input_layernorm.data_ptr<float>(), eps, 0.0f, b.h.data());
    run_linear(isa, w.q_proj, b.h.data(), t, b.q.data());
    run_linear(isa, w.k_proj, b.h.data(), t, b.k.data());
    run_linear(isa, w.v_proj, b.h.data(), t, b.v.data());
    if (w.q_norm.defined()) {  // Qwen3: RMSNorm over each head before the rotary
      ki::rms_norm_rows(b.q.data(), t * heads, d, w.q_norm.data_ptr<float>(), eps, 0.0f, b.q.data());
      ki::rms_norm_rows(b.k.data(), t * kv, d, w.k_norm.data_ptr<float>(), eps, 0.0f, b.k.data());
    }
    for (int64_t row = 0; row < t; ++row)
      for (int64_t head = 0; head < heads; ++head)
        ki::rotary_row(b.q.data() + (row * heads + head) * d, cp + row * d, sp + row * d, d,
                       b.rotated.data() + (row * heads + head) * d);
    for (size_t i = 0; i < requests.size(); ++i) {
      const FusedDecodeRows& r = requests[i];
      auto [keys, values] = r.context->layer_storage(static_cast<int64_t>(layer));
      const int64_t column = r.context->length();
      const at::ScalarType dtype = keys.scalar_type();
      const bool bf16 = dtype == at::kBFloat16, fp8 = dtype == at::kByte, plain = !bf16 && !fp8;
      const int64_t width = r.context->spec().row_width();
      auto* kp = static_cast<char*>(keys.data_ptr());
      auto* vp = static_cast<char*>(values.data_ptr());
      const auto element = static_cast<int64_t>(keys.element_size());
      for (int64_t row = 0; row < r.rows; ++row) {
        const int64_t at_row = r.first_row + row;
        for (int64_t head = 0; head < kv; ++head) {
          const int64_t slot = (row * keys.stride(0) + head * keys.stride(1) + column * width) * element;
          ki::rotary_row(b.k.data() + (at_row * kv + head) * d, cp + at_row * d, sp + at_row * d, d, b.kr.data());
          store_cache_row(b.kr.data(), d, dtype, kp + slot);
          store_cache_row(b.v.data() + (at_row * kv + head) * d, d, dtype, vp + slot);
        }
      }
      const ki::CacheAttention a{b.rotated.data() + r.first_row * heads * d,
                                 b.attended.data() + r.first_row * heads * d,
                                 r.rows,
                                 heads,
                                 kv,
                                 d,
                                 plain ? reinterpret_cast<const float*>(kp) : nullptr,
                                 plain ? reinterpret_cast<const float*>(vp) : nullptr,
                                 keys.stride(0),
                                 keys.stride(1),
                                 static_cast<const uint8_t*>(key_real[i].data_ptr()),
                                 column + 1,
                                 column,
                                 scale,
                                 bf16 ? reinterpret_cast<const uint16_t*>(kp) : nullptr,
                                 bf16 ? reinterpret_cast<const uint16_t*>(vp) : nullptr,
                                 fp8 ? reinterpret_cast<const uint8_t*>(kp) : nullptr,
                                 fp8 ? reinterpret_cast<const uint8_t*>(vp) : nullptr};
      ki::attend_cache(isa, a);
    }
    run_linear(isa, w.o_proj, b.attended.data(), t, b.out.data());
    add_rows(xp, b.out.data(), t * hs);
    ki::rms_norm_rows(xp, t, hs, w.post_attention_layernorm.data_ptr<float>(), eps, 0.0f, b.h.data());
    run_linear(isa, w.gate_proj, b.h.data(), t, b.gate.data());
    run_linear(isa, w.up_proj, b.h.data(), t, b.up.data());
    ki::silu_mul(isa, b.gate.data(), b.up.data(), b.gate.data(), t * inter);
    run_linear(isa, w.down_proj, b.gate.data(), t, b.out.data());
    add_rows(xp, b.out.data(), t * hs);
  }
  return x;
}

}  // namespace vlmgen::detail
