// The CPU kernels on every path this machine can run, against float64 ATen on the same numbers:
// the products (linear over float32, 16-bit and FP8 weights) and widening. Attention is in
// kernels_attention_test.cpp, the elementwise and row-wise kernels in kernels_elementwise_test.cpp.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels_test_util.h"
#include "vlmgen/error.h"
#include "vlmgen/io/fp8.h"
#include "vlmgen/kernels/cpu.h"

namespace vlmgen {
namespace {

using kernels::Isa;
using kernels_test::relative_error;

TEST(CpuKernels, LinearMatchesFloat64OnEveryPathWeightTypeAndRowCount) {
  ASSERT_FALSE(kernels::supported_isas().empty());
  at::manual_seed(3);
  // Widths that are and are not multiples of the vector length (87: two vectors of 32 bfloat16
  // pairs, one of 16, 7 scalars); outputs not a multiple of 4.
  for (auto [out, in] : std::vector<std::pair<int64_t, int64_t>>{{13, 37}, {9, 87}, {64, 768}, {130, 2048}}) {
    for (at::ScalarType wt : {at::kFloat, at::kBFloat16, at::kHalf}) {
      at::Tensor weight = at::randn({out, in}).to(wt);
      at::Tensor wide = weight.to(at::kDouble);  // the weights as stored, exactly
      at::Tensor bias = at::randn({out});
      for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 12, 16, 17}) {
        at::Tensor x = at::randn({rows, in});
        at::Tensor want = at::linear(x.to(at::kDouble), wide, bias.to(at::kDouble));
        at::Tensor term_scale = at::matmul(x.abs().to(at::kDouble), wide.abs().t()) + bias.abs().to(at::kDouble);
        for (Isa isa : kernels::supported_isas()) {
          SCOPED_TRACE(testing::Message() << kernels::isa_name(isa) << " " << at::toString(wt) << " rows " << rows
                                          << " [" << out << ", " << in << "]");
          at::Tensor got = kernels::linear_on(isa, x, weight, bias);
          ASSERT_EQ(got.sizes(), (std::vector<int64_t>{rows, out}));
          EXPECT_LT(relative_error(got, want, term_scale), 4e-6 * std::sqrt(static_cast<double>(in)));
          at::Tensor no_bias = kernels::linear_on(isa, x, weight);
          EXPECT_LT(relative_error(no_bias, want - bias.to(at::kDouble), term_scale),
                    4e-6 * std::sqrt(static_cast<double>(in)));
        }
      }
    }
  }
}

/// Sets kernels::streams_weight_rows for a scope and puts the previous setting back.
class StreamsWeightRows {
 public:
  explicit StreamsWeightRows(bool on) : before_(kernels::streams_weight_rows()) {
    kernels::set_streams_weight_rows(on);
  }
  ~StreamsWeightRows() { kernels::set_streams_weight_rows(before_); }
  StreamsWeightRows(const StreamsWeightRows&) = delete;
  StreamsWeightRows& operator=(const StreamsWeightRows&) = delete;

 private:
  bool before_;
};

TEST(CpuKernels, FewRowProductsGiveTheSameBitsWhetherTheyStreamWeightRowsAndWhateverElseIsInTheCall) {
  // Reading the weight rows as far-apart streams (the default on AMD CPUs) or in tiles of adjacent
  // rows: each output sums its terms in one order, so the bits are the same, and a row's result
  // does not depend on the other rows of the call (a request decoded alone or in a batch).
  at::manual_seed(13);
  for (auto [out, in] : std::vector<std::pair<int64_t, int64_t>>{{9, 87}, {130, 768}, {70, 2048}}) {
    for (at::ScalarType wt : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const at::Tensor weight = at::randn({out, in}).to(wt);
      const at::Tensor wide = weight.to(at::kDouble);
      const at::Tensor bias = at::randn({out});
      // Row counts in one pass and in several (f32 on AVX-512: passes of up to 6 rows, 16 = 6 + 5 + 5).
      for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 12, 16}) {
        const at::Tensor x = at::randn({rows, in});
        const at::Tensor want = at::linear(x.to(at::kDouble), wide, bias.to(at::kDouble));
        const at::Tensor term_scale = at::matmul(x.abs().to(at::kDouble), wide.abs().t()) + bias.abs().to(at::kDouble);
        for (Isa isa : kernels::supported_isas()) {
          SCOPED_TRACE(testing::Message() << kernels::isa_name(isa) << " " << at::toString(wt) << " rows " << rows
                                          << " [" << out << ", " << in << "]");
          at::Tensor tiles, streamed;
          {
            StreamsWeightRows setting(false);
            tiles = kernels::linear_on(isa, x, weight, bias);
          }
          StreamsWeightRows setting(true);
          streamed = kernels::linear_on(isa, x, weight, bias);
          EXPECT_LT(relative_error(streamed, want, term_scale), 4e-6 * std::sqrt(static_cast<double>(in)));
          EXPECT_TRUE(at::equal(streamed, tiles)) << "max |diff| " << (streamed - tiles).abs().max().item<double>();
          for (int64_t r = 0; r < rows; ++r)
            EXPECT_TRUE(at::equal(kernels::linear_on(isa, x.narrow(0, r, 1), weight, bias), streamed.narrow(0, r, 1)))
                << "row " << r;
        }
      }
    }
  }
}

TEST(CpuKernels, LinearKeepsLeadingDimsForFewAndManyRows) {
  at::manual_seed(4);
  at::Tensor weight = at::randn({24, 40}).to(at::kBFloat16);
  for (int64_t s : {1, 5, 40}) {  // 2 * s rows: decode kernel for the first two, GEMM for 80 rows
    at::Tensor x = at::randn({2, s, 40});
    at::Tensor y = kernels::linear(x, weight);
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, s, 24}));
    EXPECT_TRUE(at::allclose(y, at::linear(x, weight.to(at::kFloat)), 1e-4, 1e-5));
  }
  // Rows of no features: each output is its bias, few rows or many, on every path.
  const at::Tensor bias = at::randn({24});
  for (int64_t rows : {3, 40}) {
    const at::Tensor empty = at::zeros({2, rows, 0});
    EXPECT_TRUE(at::equal(kernels::linear(empty, at::zeros({24, 0}), bias), bias.expand({2, rows, 24})));
    for (Isa isa : kernels::supported_isas())
      EXPECT_TRUE(at::equal(kernels::linear_on(isa, empty, at::zeros({24, 0}), bias), bias.expand({2, rows, 24})));
  }
}

TEST(CpuKernels, ManyRowsWithTheWrongWidthOrBiasAreRefusedBeforeAnyWork) {
  // 40 rows: past the decode kernels, for float32, 16-bit and FP8 weights alike.
  const at::Tensor x = at::randn({40, 64});
  for (at::ScalarType wt : {at::kFloat, at::kBFloat16}) {
    const at::Tensor weight = at::randn({24, 64}).to(wt);
    EXPECT_THROW(kernels::linear(x, at::randn({24, 60}).to(wt)), Error);  // width
    EXPECT_THROW(kernels::linear(x, weight, at::randn({20})), Error);     // bias too short
    EXPECT_THROW(kernels::linear(x, weight, at::randn({})), Error);       // bias 0-d
    EXPECT_THROW(kernels::linear(at::randn({80, 64}), weight, at::randn({25})), Error);
    EXPECT_EQ(kernels::linear(x, weight).sizes(), (std::vector<int64_t>{40, 24}));  // and it still works
  }
}

TEST(CpuKernels, ManyRowProductsMatchFloat64AndARowsResultDoesNotDependOnTheOtherRows) {
  // The GEMM tiles (more rows than the decode kernels take): widths with and without a vector
  // tail, outputs that leave partial tiles, 300-wide rows whose outputs span three blocks of
  // kGemmBlockBytes, row counts that leave each partial row tile; input rows with a stride.
  at::manual_seed(12);
  for (auto [out, in] : std::vector<std::pair<int64_t, int64_t>>{{13, 37}, {101, 768}, {500, 300}, {7, 16}}) {
    const at::Tensor weight = at::randn({out, in});
    const at::Tensor wide = weight.to(at::kDouble);
    const at::Tensor bias = at::randn({out});
    for (int64_t rows : {17, 30, 66, 203}) {
      const at::Tensor x = at::randn({rows, in + 5}).narrow(1, 2, in);
      const at::Tensor want = at::linear(x.to(at::kDouble), wide, bias.to(at::kDouble));
      const at::Tensor term_scale = at::matmul(x.abs().to(at::kDouble), wide.abs().t()) + bias.abs().to(at::kDouble);
      for (Isa isa : kernels::supported_isas()) {
        SCOPED_TRACE(testing::Message() << kernels::isa_name(isa) << " rows " << rows << " [" << out << ", " << in
                                        << "]");
        const at::Tensor got = kernels::linear_on(isa, x, weight, bias);
        EXPECT_LT(relative_error(got, want, term_scale), 4e-6 * std::sqrt(static_cast<double>(in)));
        // The same rows one place later in the call (other tile slots, other partial tiles): the
        // same bits. A request's prefill gives what it gives alone, whatever it is batched with.
        const at::Tensor shifted = kernels::linear_on(isa, at::cat({at::randn({1, in}), x}), weight, bias);
        EXPECT_TRUE(at::equal(shifted.narrow(0, 1, rows), got));
        if (isa == kernels::active_isa() && isa != Isa::kPortable && kernels::enabled()) {
          EXPECT_TRUE(at::equal(kernels::linear(x, weight, bias), got));
        }
      }
    }
  }
}

TEST(CpuKernels, WidenIsExactForEvery16BitPattern) {
  // All 65536 bit patterns: normals, subnormals, zeros, infinities and NaNs of both formats.
  at::Tensor bits = at::arange(0, 65536, at::kInt).to(at::kShort);
  for (at::ScalarType t : {at::kBFloat16, at::kHalf}) {
    at::Tensor h = at::empty({256, 256}, t);
    std::memcpy(h.data_ptr(), bits.data_ptr(), 65536 * 2);
    at::Tensor want = h.to(at::kFloat);
    for (Isa isa : kernels::supported_isas()) {
      at::Tensor got = kernels::widen_on(isa, h);
      // Equal as numbers, NaN where NaN (payloads may differ).
      EXPECT_TRUE(at::equal(got.isnan(), want.isnan())) << kernels::isa_name(isa) << " " << at::toString(t);
      EXPECT_TRUE(at::equal(got.nan_to_num(0), want.nan_to_num(0))) << kernels::isa_name(isa) << " " << at::toString(t);
    }
  }
}

/// FP8 bytes [out, in] with no E4M3 NaN byte, and a scale grid of the given blocks.
std::pair<at::Tensor, kernels::Fp8Scales> random_fp8(int64_t out, int64_t in, int64_t block_out, int64_t block_in,
                                                     bool e5m2) {
  at::Tensor bytes = at::randint(0, 256, {out, in}, at::kLong).to(at::kByte);
  if (!e5m2)
    bytes.masked_fill_(bytes.bitwise_and(0x7f).eq(0x7f), 0x3c);
  else
    bytes.masked_fill_(bytes.bitwise_and(0x7c).eq(0x7c), 0x3c);  // no infinities or NaN either
  const int64_t rows = (out + block_out - 1) / block_out, cols = (in + block_in - 1) / block_in;
  return {bytes, kernels::Fp8Scales{at::rand({rows, cols}) * 0.01 + 0.001, block_out, block_in, e5m2}};
}

/// The weights by the format definition (vlmgen/io/fp8.h) times the scale of each element's block.
at::Tensor fp8_reference(const at::Tensor& bytes, const kernels::Fp8Scales& q) {
  at::Tensor values = fp8_decode(bytes, q.e5m2 ? Fp8Format::kE5M2 : Fp8Format::kE4M3).to(at::kDouble);
  at::Tensor grid = q.grid.to(at::kDouble).repeat_interleave(q.block_out, 0).repeat_interleave(q.block_in, 1);
  return values * grid.narrow(0, 0, bytes.size(0)).narrow(1, 0, bytes.size(1));
}

TEST(CpuKernels, Fp8LinearAndWideningMatchTheFormatDefinitionOnEveryPathAndScaleLayout) {
  at::manual_seed(8);
  struct Case {
    int64_t out, in, block_out, block_in;
  };
  // Blocks of 32 x 32 and 128 x 128 (partial edges; tiles of 4 outputs inside one row block: the
  // input is scaled), blocks of 2 x 16 (tiles across row blocks: each weight vector is scaled),
  // per output channel and per tensor (one column block: each sum is scaled once); 2 x 64 and
  // 16 x 128 with widths that end in a vector and a scalar tail past the last whole block; 4 x 128
  // and 2 x 128 over 216 columns, where the vectors after the whole cache lines start inside a
  // scale block (the input scaled, and the weights).
  for (Case c : {Case{70, 96, 32, 32}, Case{130, 200, 128, 128}, Case{22, 64, 2, 16}, Case{13, 37, 1, 37},
                 Case{64, 768, 64, 768}, Case{22, 216, 2, 64}, Case{40, 152, 16, 128}, Case{20, 216, 4, 128},
                 Case{22, 216, 2, 128}}) {
    // E4M3 random; every other row without a zero exponent (whole lines of normal numbers), with
    // only zero exponents (zeros and subnormals, else within the tolerance of wrong values among
    // the others), or only subnormals (lines without a zero byte); E5M2.
    for (int variant = 0; variant < 5; ++variant) {
      const bool e5m2 = variant == 4;
      auto [bytes, q] = random_fp8(c.out, c.in, c.block_out, c.block_in, e5m2);
      at::Tensor rows = bytes.slice(0, 0, c.out, 2);
      if (variant == 1) rows.copy_(at::where(rows.bitwise_and(0x78).eq(0), rows.bitwise_or(0x08), rows));
      if (variant == 2) rows.copy_(rows.bitwise_and(0x87));
      if (variant == 3) rows.copy_(rows.bitwise_and(0x87).bitwise_or(0x01));
      at::Tensor w = fp8_reference(bytes, q);
      for (Isa isa : kernels::supported_isas()) {
        SCOPED_TRACE(testing::Message() << kernels::isa_name(isa) << (e5m2 ? " e5m2 " : " e4m3 ") << variant << " ["
                                        << c.out << ", " << c.in << "] blocks " << c.block_out << " x " << c.block_in);
        // Widening is exact: the byte's value times its scale, one rounding.
        EXPECT_TRUE(at::equal(kernels::widen_on(isa, bytes, q), w.to(at::kFloat)));
        for (int64_t rows : {1, 3, 16, 30, 70}) {  // 30: widened once per call; 70: the GEMM tiles
          at::Tensor x = at::randn({rows, c.in});
          at::Tensor want = at::matmul(x.to(at::kDouble), w.t());
          at::Tensor term_scale = at::matmul(x.abs().to(at::kDouble), w.abs().t());
          EXPECT_LT(relative_error(kernels::linear_on(isa, x, bytes, {}, q), want, term_scale),
                    4e-6 * std::sqrt(static_cast<double>(c.in)));
        }
      }
    }
  }
}

// FP8 products read their weights as far-apart streams too (1 row on AVX-512 by default on AMD
// CPUs): where column blocks are whole lines the streams cross row blocks and each output scales
// its inputs by its own block's scale in the tile (far_block_tile), else a stream's tiles keep to
// one row block, whose prepared inputs carry its scales as a run of adjacent tiles does; either
// way the bits are those of adjacent tiles. Per tensor, per 128 x 128 block (130 outputs: on two
// threads the second range starts inside a block; 520: each stream in other blocks and crossing
// their edges), per 32 x 32 block (lines straddle column blocks: streams within row blocks), 2 x
// 64 blocks over 216 columns (a tile's 4 outputs in 4 blocks, one-output tiles, a vector tail),
// and 5 outputs (one tile of streams, one output left over); E4M3 and E5M2, with a bias.
TEST(CpuKernels, Fp8ProductsGiveTheSameBitsWhetherTheyStreamWeightRows) {
  at::manual_seed(14);
  for (auto [out, in, block_out, block_in] : std::vector<std::array<int64_t, 4>>{{130, 768, 128, 128},
                                                                                 {520, 768, 128, 128},
                                                                                 {130, 768, 32, 32},
                                                                                 {70, 2048, 70, 2048},
                                                                                 {64, 216, 2, 64},
                                                                                 {5, 256, 1, 64}}) {
    for (bool e5m2 : {false, true}) {
      auto [bytes, q] = random_fp8(out, in, block_out, block_in, e5m2);
      const at::Tensor bias = at::randn({out});
      for (int64_t rows : {1, 2, 3, 4, 16}) {
        const at::Tensor x = at::randn({rows, in});
        for (Isa isa : kernels::supported_isas()) {
          SCOPED_TRACE(testing::Message()
                       << kernels::isa_name(isa) << (e5m2 ? " e5m2" : " e4m3") << " rows " << rows << " [" << out
                       << ", " << in << "] blocks " << block_out << " x " << block_in);
          at::Tensor tiles;
          {
            StreamsWeightRows setting(false);
            tiles = kernels::linear_on(isa, x, bytes, bias, q);
          }
          StreamsWeightRows setting(true);
          const at::Tensor streamed = kernels::linear_on(isa, x, bytes, bias, q);
          EXPECT_TRUE(at::equal(streamed, tiles)) << "max |diff| " << (streamed - tiles).abs().max().item<double>();
          EXPECT_TRUE(at::equal(kernels::linear_on(isa, x.narrow(0, rows - 1, 1), bytes, bias, q),
                                streamed.narrow(0, rows - 1, 1)));
        }
      }
    }
  }
}

TEST(CpuKernels, ManyRowsWiden16BitAndFp8WeightsInBlocksThatCoverTheWholeMatrix) {
  // 4100 x 300 weights: 3495 output rows per widened block of 2^20 floats, so a full block and
  // a partial one; 80 rows go to the GEMM tiles (ATen's GEMM on the portable path), each block
  // into its own columns of the output.
  at::manual_seed(9);
  const int64_t out = 4100, in = 300, rows = 80;
  const at::Tensor x = at::randn({2, rows / 2, in});
  const at::Tensor bias = at::randn({out});
  auto check = [&](const at::Tensor& got, const at::Tensor& wide, const char* what) {
    SCOPED_TRACE(what);
    const at::Tensor flat = x.reshape({rows, in}).to(at::kDouble);
    const at::Tensor want = at::linear(flat, wide, bias.to(at::kDouble));
    const at::Tensor term_scale = at::matmul(flat.abs(), wide.abs().t()) + bias.abs().to(at::kDouble);
    ASSERT_EQ(got.sizes(), (std::vector<int64_t>{2, rows / 2, out}));
    EXPECT_LT(relative_error(got.reshape({rows, out}), want, term_scale), 4e-6 * std::sqrt(static_cast<double>(in)));
  };
  for (at::ScalarType wt : {at::kBFloat16, at::kHalf}) {
    const at::Tensor weight = at::randn({out, in}).to(wt);
    check(kernels::linear(x, weight, bias), weight.to(at::kDouble), at::toString(wt));
  }
  auto [bytes, q] = random_fp8(out, in, 128, 128, false);
  check(kernels::linear(x, bytes, bias, q), fp8_reference(bytes, q), "e4m3, 128 x 128 blocks");
}

TEST(CpuKernels, Fp8ScalesThatDoNotFitTheWeightAreRefused) {
  auto [bytes, q] = random_fp8(40, 64, 16, 32, false);
  at::Tensor x = at::randn({1, 64});
  kernels::Fp8Scales wrong_grid = q;
  wrong_grid.grid = at::ones({2, 2});  // 40 rows in blocks of 16 need 3 grid rows
  EXPECT_THROW(kernels::linear(x, bytes, {}, wrong_grid), Error);
  kernels::Fp8Scales odd_block = q;
  odd_block.block_in = 24;  // neither a multiple of 16 nor the whole row
  odd_block.grid = at::ones({3, 3});
  EXPECT_THROW(kernels::linear(x, bytes, {}, odd_block), Error);
  EXPECT_THROW(kernels::linear(x, bytes.to(at::kFloat), {}, q), Error);   // scales need uint8 bytes
  EXPECT_THROW(kernels::linear(x.to(at::kDouble), bytes, {}, q), Error);  // and float32 input
}

TEST(CpuKernels, CallsThatAutogradRecordsGoThroughAtenAndKeepTheirGradients) {
  at::Tensor weight = at::randn({8, 16}).requires_grad_();
  at::Tensor x = at::randn({1, 16});
  at::Tensor y = kernels::linear(x, weight);  // one row: the kernel's case, were no gradient needed
  ASSERT_TRUE(y.requires_grad());
  y.sum().backward();
  EXPECT_TRUE(at::allclose(weight.grad(), x.expand({8, 16})));  // d sum(x W^T) / dW: x in every row
  at::Tensor q = at::randn({1, 2, 1, 16}).requires_grad_(), k = at::randn({1, 1, 5, 16});
  // The explicit kernel calls keep no graph, and say so rather than return a result without one.
  EXPECT_THROW(kernels::decode_attention(q, k, k, at::ones({1, 5}), 4, 1.0), Error);
  EXPECT_THROW(kernels::linear_on(Isa::kPortable, x, weight), Error);
  at::NoGradGuard no_grad;
  EXPECT_EQ(kernels::decode_attention(q, k, k, at::ones({1, 5}), 4, 1.0).sizes(), q.sizes());
}

TEST(CpuKernels, LinearRefusesWhatItCannotRun) {
  at::Tensor x = at::randn({2, 8});
  EXPECT_THROW(kernels::linear_on(Isa::kPortable, x, at::randn({4, 9})), Error);                  // width
  EXPECT_THROW(kernels::linear_on(Isa::kPortable, x, at::randn({4, 8}), at::randn({5})), Error);  // bias
  EXPECT_THROW(kernels::linear_on(Isa::kPortable, x, at::randn({8, 4}).t()), Error);              // not contiguous
  EXPECT_THROW(kernels::linear_on(Isa::kPortable, x, at::randn({4, 8}).to(at::kDouble)), Error);  // dtype
}

}  // namespace
}  // namespace vlmgen
