// The CPU elementwise and row-wise kernels (RMS norm, rotary, silu_mul, scaled softmax) on every
// path this machine can run, against float64 ATen on the same numbers.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "kernels_test_util.h"
#include "vlmgen/error.h"
#include "vlmgen/kernels/cpu.h"

namespace vlmgen {
namespace {

using kernels::Isa;
using kernels_test::relative_error;

TEST(CpuKernels, RmsNormMatchesFloat64WithAndWithoutGemmasWeightOffset) {
  at::manual_seed(11);
  // Widths with and without a tail after the 8-wide partial sums, rows of very different scales,
  // and a transposed (non-contiguous) input.
  for (int64_t d : {1, 7, 64, 768, 771}) {
    at::Tensor x = at::randn({3, 5, d}) * at::tensor({1e-3f, 1.0f, 300.0f}).view({3, 1, 1});
    at::Tensor w = at::randn({d});
    for (double offset : {0.0, 1.0}) {
      at::Tensor xd = x.to(at::kDouble);
      at::Tensor want = xd / (xd.pow(2).mean(-1, true) + 1e-6).sqrt() * (w.to(at::kDouble) + offset);
      at::Tensor got = kernels::rms_norm(x, w, 1e-6, offset);
      ASSERT_EQ(got.sizes(), x.sizes());
      ASSERT_EQ(got.scalar_type(), at::kFloat);
      // Each output is x_j * w_j / rms: a few float32 roundings of its own magnitude.
      EXPECT_LT(relative_error(got, want, want.abs()), 1e-5) << "d " << d << " offset " << offset;
    }
    at::Tensor xt = at::randn({d, 4}).t();  // [4, d], not contiguous
    at::Tensor td = xt.to(at::kDouble);
    at::Tensor want = td / (td.pow(2).mean(-1, true) + 1e-6).sqrt() * w.to(at::kDouble);
    EXPECT_LT(relative_error(kernels::rms_norm(xt, w, 1e-6), want, want.abs()), 1e-5) << "transposed, d " << d;
  }
  // A row of zeros is eps-scaled zeros, not NaN.
  EXPECT_EQ(kernels::rms_norm(at::zeros({2, 8}), at::ones({8}), 1e-6).abs().sum().item<float>(), 0.0f);
  // Float64 input and a recorded graph go through ATen, with the same formula and gradients.
  at::Tensor x64 = at::randn({2, 6}, at::kDouble), w64 = at::randn({6}, at::kDouble);
  EXPECT_TRUE(at::allclose(kernels::rms_norm(x64, w64, 1e-6), x64 * at::rsqrt(x64.pow(2).mean(-1, true) + 1e-6) * w64));
  at::Tensor wg = at::randn({6}).requires_grad_();
  at::Tensor y = kernels::rms_norm(at::randn({2, 6}), wg, 1e-6);
  ASSERT_TRUE(y.requires_grad());
  y.sum().backward();
  EXPECT_TRUE(wg.grad().defined());
}

/// x * cos + rotate_half(x) * sin in float64.
at::Tensor rotary_float64(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor xd = x.to(at::kDouble);
  const int64_t half = x.size(-1) / 2;
  const at::Tensor rotated = at::cat({-xd.narrow(-1, half, half), xd.narrow(-1, 0, half)}, -1);
  return xd * cos.to(at::kDouble) + rotated * sin.to(at::kDouble);
}

TEST(CpuKernels, RotaryMatchesFloat64OnTheLayoutsTheModelsUse) {
  at::manual_seed(12);
  // Text: q [B, heads, S, D] as a transposed view of [B, S, heads, D], cos/sin [B, 1, S, D].
  at::Tensor q = at::randn({2, 5, 3, 16}).transpose(1, 2);
  at::Tensor cos = at::randn({2, 1, 5, 16}), sin = at::randn({2, 1, 5, 16});
  at::Tensor want = rotary_float64(q, cos, sin);
  at::Tensor got = kernels::rotary(q, cos, sin);
  ASSERT_EQ(got.sizes(), q.sizes());
  // Two rounded products and a rounded sum: within a few float32 steps of the terms' size.
  at::Tensor scale = q.abs().to(at::kDouble) * cos.abs() + q.abs().roll(8, -1).to(at::kDouble) * sin.abs();
  EXPECT_LT(relative_error(got, want, scale), 3e-7);
  // And what ATen's ops give (the same roundings in the same order; identical here, where the
  // compiler does not fuse the multiply and the add).
  const at::Tensor rotated = at::cat({-q.narrow(-1, 8, 8), q.narrow(-1, 0, 8)}, -1);
  EXPECT_TRUE(at::allclose(got, q * cos + rotated * sin, 1e-6, 1e-7));
  // Vision: x [N, heads, D] with cos/sin [N, 1, D]; one cos row for every row ([1, 1, S, D]).
  at::Tensor xv = at::randn({7, 2, 8}), cv = at::randn({7, 1, 8}), sv = at::randn({7, 1, 8});
  EXPECT_TRUE(at::allclose(kernels::rotary(xv, cv, sv).to(at::kDouble), rotary_float64(xv, cv, sv), 1e-6, 1e-6));
  at::Tensor c1 = at::randn({1, 1, 5, 16}), s1 = at::randn({1, 1, 5, 16});
  EXPECT_TRUE(at::allclose(kernels::rotary(q, c1, s1).to(at::kDouble), rotary_float64(q, c1, s1), 1e-6, 1e-6));
  // Other ranks and a recorded graph go through ATen, gradients included.
  at::Tensor x2 = at::randn({4, 6}).requires_grad_();
  at::Tensor y = kernels::rotary(x2, at::randn({4, 6}), at::randn({1, 6}));
  ASSERT_TRUE(y.requires_grad());
  y.sum().backward();
  EXPECT_TRUE(x2.grad().defined());
}

TEST(CpuKernels, SiluMulMatchesFloat64OnEveryPathWithoutOverflowAndWhereverTheRangeIsSplit) {
  at::manual_seed(13);
  // Lengths with and without a partial last vector; gates from -120 to 120 (e^-g overflows float
  // for g < -88: the kernel never forms it), zeros of both signs, tiny and huge magnitudes.
  for (int64_t n : {1, 7, 16, 37, 4096 + 5}) {
    at::Tensor gate = at::randn({n}) * 6;
    at::Tensor up = at::randn({n});
    const std::vector<float> edges = {-120.0f, -88.5f, -20.0f, -0.0f, 0.0f, 1e-30f, -1e-30f, 20.0f, 120.0f};
    for (size_t i = 0; i < edges.size() && static_cast<int64_t>(i) < n; ++i) gate[static_cast<int64_t>(i)] = edges[i];
    const at::Tensor g = gate.to(at::kDouble), u = up.to(at::kDouble);
    const at::Tensor want = g / (1 + (-g).exp()) * u;
    for (Isa isa : kernels::supported_isas()) {
      SCOPED_TRACE(testing::Message() << kernels::isa_name(isa) << " n " << n);
      const at::Tensor got = kernels::silu_mul_on(isa, gate, up);
      ASSERT_EQ(got.sizes(), gate.sizes());
      ASSERT_FALSE(got.isnan().any().item<bool>());
      // Each output is a few float32 roundings of its own magnitude (measured up to 6e-8); below
      // g = -87 the exponential stops at e^-87, and silu's magnitude under 1.5e-36 is off by as much.
      EXPECT_LT(relative_error(got, want, want.abs() + 1e-28), 3e-7);
      // An element's result does not depend on where the range is split (the fused decode step
      // runs the whole row, silu_mul splits it over threads).
      if (n > 16) {
        const at::Tensor head = kernels::silu_mul_on(isa, gate.narrow(0, 0, 5), up.narrow(0, 0, 5));
        const at::Tensor rest = kernels::silu_mul_on(isa, gate.narrow(0, 5, n - 5), up.narrow(0, 5, n - 5));
        EXPECT_TRUE(at::equal(at::cat({head, rest}), got));
      }
    }
  }
  // silu_mul_into: the same bits, in the gate's own storage where it is contiguous float32; a
  // strided gate gets a tensor of its own with the same values.
  {
    const at::Tensor gate = at::randn({3, 4096 + 5}) * 6, up = at::randn({3, 4096 + 5});
    at::Tensor into = gate.clone();
    const void* storage = into.data_ptr();
    kernels::silu_mul_into(into, up);
    if (kernels::enabled()) {  // VLMGEN_CPU_ISA=aten: a new tensor
      EXPECT_EQ(into.data_ptr(), storage);
    }
    EXPECT_TRUE(at::equal(into, kernels::silu_mul(gate, up)));
    if (kernels::enabled()) {  // in place: a node that saved the gate refuses to run backward
      at::Tensor w = at::randn({3, 4096 + 5}).requires_grad_();
      at::Tensor saved = gate.clone();
      at::Tensor product = w * saved;
      kernels::silu_mul_into(saved, up);
      EXPECT_ANY_THROW(product.sum().backward());
    }
    at::Tensor strided = gate.clone().t();
    kernels::silu_mul_into(strided, up.t());
    EXPECT_TRUE(at::equal(strided, kernels::silu_mul(gate.t(), up.t())));
    at::Tensor g64 = gate.to(at::kDouble);
    kernels::silu_mul_into(g64, up.to(at::kDouble));
    EXPECT_TRUE(at::allclose(g64, at::silu(gate.to(at::kDouble)) * up.to(at::kDouble)));
  }
  // Other dtypes, mismatched shapes and a recorded graph go through ATen (silu(gate) * up).
  at::Tensor g64 = at::randn({5}, at::kDouble), u64 = at::randn({5}, at::kDouble);
  EXPECT_TRUE(at::allclose(kernels::silu_mul(g64, u64), at::silu(g64) * u64));
  at::Tensor gg = at::randn({4}).requires_grad_();
  at::Tensor y = kernels::silu_mul(gg, at::randn({4}));
  ASSERT_TRUE(y.requires_grad());
  y.sum().backward();
  EXPECT_TRUE(gg.grad().defined());
  EXPECT_THROW(kernels::silu_mul_on(kernels::supported_isas().front(), at::randn({4}), at::randn({5})), Error);
}

TEST(CpuKernels, ScaledSoftmaxMatchesFloat64OnEveryPathWithMaskedScoresAndEdgeRows) {
  at::manual_seed(17);
  // Row lengths with and without a partial last vector; scales of head_dim 64 (a power of two) and
  // 80; scores of standard deviation 18-20 after scaling (long rows span more than 87 below their
  // largest), some masked as the attention masks them (lowest float).
  for (int64_t n : {1, 7, 16, 37, 1024 + 5}) {
    for (double scale : {0.125, 1.0 / std::sqrt(80.0)}) {
      at::Tensor x = at::randn({5, n}) * 160;
      x.select(0, 1).narrow(0, 0, (n + 1) / 2).fill_(std::numeric_limits<float>::lowest());
      // ATen's two roundings (the product, its difference from the row's largest), then exact.
      const at::Tensor product = x * scale;
      const at::Tensor shifted = (product - std::get<0>(product.max(-1, true))).to(at::kDouble);
      const at::Tensor want = at::softmax(shifted, -1);
      for (Isa isa : kernels::supported_isas()) {
        SCOPED_TRACE(testing::Message() << kernels::isa_name(isa) << " n " << n << " scale " << scale);
        const at::Tensor got = kernels::scaled_softmax_on(isa, x, scale);
        ASSERT_EQ(got.sizes(), x.sizes());
        ASSERT_FALSE(got.isnan().any().item<bool>());
        // Probabilities whose exponent's argument is above -87 within 1e-6 relative; below, e^x is
        // under 1.7e-38 of the row's largest term and the kernel gives 0.
        const at::Tensor visible = shifted.ge(-87);
        EXPECT_LT(relative_error(got.to(at::kDouble).masked_select(visible), want.masked_select(visible),
                                 want.masked_select(visible)),
                  1e-6);
        EXPECT_TRUE(got.masked_select(visible.logical_not()).eq(0).all().item<bool>());
        EXPECT_TRUE(got.select(0, 1).narrow(0, 0, (n + 1) / 2).eq(0).all().item<bool>() || n == 1);
        EXPECT_TRUE(at::equal(kernels::scaled_softmax_on(isa, x.narrow(0, 3, 1), scale), got.narrow(0, 3, 1)));
      }
    }
  }
  // A row's result does not depend on the other rows or on where the rows split over threads (256
  // rows of 1029 split into tasks of 15 rows).
  {
    const at::Tensor x = at::randn({256, 1029}) * 30;
    for (Isa isa : kernels::supported_isas()) {
      const at::Tensor all = kernels::scaled_softmax_on(isa, x, 0.125);
      for (int64_t r : {0, 14, 15, 16, 200, 255})
        EXPECT_TRUE(at::equal(kernels::scaled_softmax_on(isa, x.narrow(0, r, 1), 0.125), all.narrow(0, r, 1)))
            << kernels::isa_name(isa) << " row " << r;
    }
  }
  for (Isa isa : kernels::supported_isas()) {
    SCOPED_TRACE(kernels::isa_name(isa));
    // Every key masked: a uniform row (not NaN), as ATen gives; with the scale of head_dim 80 the
    // rounded product of the masked score is the row's largest exactly, so its term is e^0.
    const at::Tensor masked = at::full({2, 21}, std::numeric_limits<float>::lowest());
    EXPECT_TRUE(at::equal(kernels::scaled_softmax_on(isa, masked, 1.0 / std::sqrt(80.0)), at::full({2, 21}, 1.0 / 21)));
    // A NaN or +inf score makes its row NaN (as ATen's softmax), the other rows untouched.
    at::Tensor odd = at::randn({3, 19});
    odd[0][5] = std::numeric_limits<float>::quiet_NaN();
    odd[1][18] = std::numeric_limits<float>::infinity();
    const at::Tensor got = kernels::scaled_softmax_on(isa, odd, 0.5);
    EXPECT_TRUE(got.narrow(0, 0, 2).isnan().all().item<bool>());
    EXPECT_TRUE(at::allclose(got.select(0, 2), at::softmax(odd.select(0, 2) * 0.5, -1), 1e-6, 1e-7));
  }
  // scaled_softmax_into: the active path's bits in x's own storage; a strided x, another dtype or a
  // recorded graph go through ATen.
  {
    const at::Tensor x = at::randn({6, 4, 37}) * 10;
    at::Tensor into = x.clone();
    const void* storage = into.data_ptr();
    kernels::scaled_softmax_into(into, 0.125);
    if (kernels::enabled()) {  // VLMGEN_CPU_ISA=aten: ATen's result
      EXPECT_EQ(into.data_ptr(), storage);
      EXPECT_TRUE(at::equal(into, kernels::scaled_softmax_on(kernels::active_isa(), x, 0.125)));
    }
    EXPECT_TRUE(at::allclose(into, at::softmax(x * 0.125, -1), 1e-6, 1e-7));
    at::Tensor strided = x.transpose(0, 2).contiguous().transpose(0, 2);
    ASSERT_FALSE(strided.is_contiguous());
    kernels::scaled_softmax_into(strided, 0.125);
    EXPECT_TRUE(at::allclose(strided, at::softmax(x * 0.125, -1), 1e-6, 1e-7));
    at::Tensor x64 = x.to(at::kDouble);
    kernels::scaled_softmax_into(x64, 0.125);
    EXPECT_TRUE(at::allclose(x64, at::softmax(x.to(at::kDouble) * 0.125, -1)));
    // Recorded by autograd: ATen's softmax, with its gradient.
    at::Tensor leaf = x.clone().requires_grad_(), reference = x.clone().requires_grad_();
    at::Tensor graph = leaf * 1.0;
    kernels::scaled_softmax_into(graph, 0.125);
    ASSERT_TRUE(graph.requires_grad());
    graph.select(-1, 0).sum().backward();
    at::softmax(reference * 1.0 * 0.125, -1).select(-1, 0).sum().backward();
    EXPECT_TRUE(at::equal(leaf.grad(), reference.grad()));
    // In place, autograd's version counter moves on: a node that saved the tensor refuses to run.
    if (kernels::enabled()) {
      at::Tensor w = at::randn({6, 4, 37}).requires_grad_();
      at::Tensor saved = x.clone();
      at::Tensor product = w * saved;  // saves `saved` for w's gradient
      kernels::scaled_softmax_into(saved, 0.125);
      EXPECT_ANY_THROW(product.sum().backward());
    }
  }
  EXPECT_THROW(kernels::scaled_softmax_on(kernels::supported_isas().front(), at::randn({4}), 0.0), Error);
  EXPECT_THROW(kernels::scaled_softmax_on(kernels::supported_isas().front(), at::randn({4}, at::kDouble), 1.0), Error);
}

}  // namespace
}  // namespace vlmgen
