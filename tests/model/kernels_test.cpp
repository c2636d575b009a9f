// The CPU kernels on every path this machine can run, against float64 ATen on the same numbers.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vlmgen/error.h"
#include "vlmgen/fp8_kv_rows.h"
#include "vlmgen/io/fp8.h"
#include "vlmgen/kernels/cpu.h"

namespace vlmgen {
namespace {

using kernels::Isa;

/// Largest |got - want| over the scale of the terms summed (sum over i of |x_i w_i| per output):
/// float32 accumulation of n terms stays within a few n * 2^-24 of that scale.
double relative_error(const at::Tensor& got, const at::Tensor& want, const at::Tensor& term_scale) {
  return ((got.to(at::kDouble) - want).abs() / (term_scale + 1e-30)).max().item<double>();
}

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

/// Masked softmax attention in float64, one query head at a time (GQA by head / groups).
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& real,
                               int64_t first_query_key, double scale) {
  const int64_t b = q.size(0), heads = q.size(1), s = q.size(2), keys = k.size(2);
  const int64_t groups = heads / k.size(1);
  at::Tensor out = at::zeros(q.sizes(), at::kDouble);
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      at::Tensor kh = k[r][h / groups].to(at::kDouble), vh = v[r][h / groups].to(at::kDouble);
      for (int64_t c = 0; c < s; ++c) {
        at::Tensor scores = at::mv(kh, q[r][h][c].to(at::kDouble)) * scale;
        at::Tensor visible = at::arange(keys).le(first_query_key + c).logical_and(real[r].to(at::kBool));
        scores = scores.masked_fill(visible.logical_not(), std::numeric_limits<double>::lowest());
        out[r][h][c] = at::mv(vh.t(), at::softmax(scores, 0));
      }
    }
  }
  return out;
}

TEST(CpuKernels, DecodeAttentionMatchesFloat64OverACacheViewWithPaddingAndCausalColumns) {
  at::manual_seed(5);
  const int64_t b = 2, heads = 6, kv = 2, d = 40, capacity = 50;  // d: 2.5 AVX-512 vectors
  for (int64_t keys : {1, 9, 33, 47}) {
    for (int64_t s : {1, 3}) {
      if (s > keys) continue;
      // The cache holds `capacity` columns; the kernel reads the first `keys` in place.
      at::Tensor k_cache = at::randn({b, kv, capacity, d}), v_cache = at::randn({b, kv, capacity, d});
      at::Tensor k = k_cache.narrow(2, 0, keys), v = v_cache.narrow(2, 0, keys);
      at::Tensor q = at::randn({b, heads, s, d});
      at::Tensor real = at::ones({b, keys}, at::kLong);
      real[1].narrow(0, 0, keys / 2).fill_(0);  // row 1 left-padded
      const int64_t first = keys - s;
      at::Tensor want = reference_attention(q, k, v, real, first, 0.125);
      for (Isa isa : kernels::supported_isas()) {
        SCOPED_TRACE(testing::Message() << kernels::isa_name(isa) << " keys " << keys << " s " << s);
        at::Tensor got = kernels::decode_attention_on(isa, q, k, v, real, first, 0.125);
        ASSERT_EQ(got.sizes(), q.sizes());
        EXPECT_LT((got.to(at::kDouble) - want).abs().max().item<double>(), 2e-5);
      }
    }
  }
}

TEST(CpuKernels, DecodeAttentionOverLongCachesAndWideScoresOnHeadDimsOfEveryPath) {
  // Scores spread over tens of units (the exponential's whole useful range), 2048 keys, head
  // dims 64 and 128 (the register-blocked value pass) and 24 (vector plus scalar columns).
  at::manual_seed(6);
  for (int64_t d : {24, 64, 128}) {
    const int64_t keys = 2048;
    at::Tensor q = at::randn({1, 8, 1, d}) * 2, k = at::randn({1, 2, keys, d}) * 2, v = at::randn({1, 2, keys, d});
    at::Tensor real = at::ones({1, keys}, at::kBool);
    real[0].narrow(0, 0, 100).fill_(false);
    at::Tensor want = reference_attention(q, k, v, real, keys - 1, 1.0 / std::sqrt(static_cast<double>(d)));
    for (Isa isa : kernels::supported_isas()) {
      at::Tensor got =
          kernels::decode_attention_on(isa, q, k, v, real, keys - 1, 1.0 / std::sqrt(static_cast<double>(d)));
      EXPECT_LT((got.to(at::kDouble) - want).abs().max().item<double>(), 2e-5) << kernels::isa_name(isa) << " d " << d;
    }
  }
}

// Padding keys are never weighed, however large their scores would be: here q . k of a padded key
// is about 400 (e^400 overflows a float), so a padded key that reached the softmax at all would
// turn every output of its row into NaN or inf. Whole blocks of 16 padded keys, a block half
// padded, and a row with none, on every path.
TEST(CpuKernels, DecodeAttentionIgnoresPaddedKeysWhoseScoresWouldOverflow) {
  at::manual_seed(9);
  const int64_t keys = 56, d = 64;
  at::Tensor q = at::full({2, 4, 1, d}, 0.5) + at::randn({2, 4, 1, d}) * 0.01;
  at::Tensor k = at::randn({2, 2, keys, d}) * 0.5, v = at::randn({2, 2, keys, d});
  at::Tensor real = at::ones({2, keys}, at::kBool);
  real[0].narrow(0, 0, 24).fill_(false);  // row 0: a whole block and half of the next padded
  k[0].narrow(1, 0, 24).fill_(100.0);     // their scores: 100 * 64 * 0.5 * 0.125 = 400
  at::Tensor want = reference_attention(q, k, v, real, keys - 1, 0.125);
  for (Isa isa : kernels::supported_isas()) {
    at::Tensor got = kernels::decode_attention_on(isa, q, k, v, real, keys - 1, 0.125);
    ASSERT_TRUE(at::isfinite(got).all().item<bool>()) << kernels::isa_name(isa);
    EXPECT_LT((got.to(at::kDouble) - want).abs().max().item<double>(), 2e-5) << kernels::isa_name(isa);
  }
}

// The kernel takes a column's keys in one pass, a block at a time, rescaling what it summed so far
// whenever a block holds a larger score than every earlier one. Here the scores climb with the
// key (0 to about 60 over 300 keys: the top grows in every block, and the first blocks' terms
// shrink by up to e^-60), a run of padded keys with enormous scores sits mid-cache across a block
// edge, and one KV head serves 70 query heads (more than a run of the kernel takes at once).
TEST(CpuKernels, DecodeAttentionRescalesEarlierBlocksWhenTheTopScoreGrowsAndTakesAnyNumberOfHeads) {
  at::manual_seed(10);
  const int64_t keys = 300, d = 64, heads = 70;
  at::Tensor q = at::full({1, heads, 1, d}, 0.5) + at::randn({1, heads, 1, d}) * 0.05;
  at::Tensor k = at::arange(keys, at::kFloat).mul(0.05).view({1, 1, keys, 1}).expand({1, 1, keys, d}).contiguous() +
                 at::randn({1, 1, keys, d}) * 0.05;
  at::Tensor v = at::randn({1, 1, keys, d});
  at::Tensor real = at::ones({1, keys}, at::kBool);
  real[0].narrow(0, 120, 20).fill_(false);  // keys 120-139: across the edge of the blocks at 128
  k[0][0].narrow(0, 120, 20).fill_(100.0);
  for (int64_t s : {1, 2}) {
    at::Tensor qs = q.expand({1, heads, s, d}).contiguous();
    at::Tensor want = reference_attention(qs, k, v, real, keys - s, 0.125);
    for (Isa isa : kernels::supported_isas()) {
      at::Tensor got = kernels::decode_attention_on(isa, qs, k, v, real, keys - s, 0.125);
      EXPECT_LT((got.to(at::kDouble) - want).abs().max().item<double>(), 2e-5) << kernels::isa_name(isa) << " s " << s;
    }
  }
}

// A real key whose score is NaN makes its column NaN, as a softmax over the scores does, also when
// it comes before any finite score and the rest of its block is padding (the running maximum
// passes NaNs by, so that block has no top score of its own).
TEST(CpuKernels, DecodeAttentionWithANanScoreIsNanWhereverTheKeyIs) {
  at::manual_seed(11);
  const int64_t keys = 100, d = 64;
  at::Tensor q = at::randn({1, 2, 1, d}), v = at::randn({1, 1, keys, d});
  for (int64_t nan_key : {0, 70, 99}) {
    at::Tensor k = at::randn({1, 1, keys, d});
    k[0][0][nan_key].fill_(std::numeric_limits<float>::quiet_NaN());
    at::Tensor real = at::ones({1, keys}, at::kBool);
    if (nan_key == 0) real[0].narrow(0, 1, 63).fill_(false);  // the rest of its block is padding
    for (Isa isa : kernels::supported_isas()) {
      at::Tensor got = kernels::decode_attention_on(isa, q, k, v, real, keys - 1, 0.125);
      EXPECT_TRUE(at::isnan(got).all().item<bool>()) << kernels::isa_name(isa) << " NaN key " << nan_key;
    }
  }
}

TEST(CpuKernels, DecodeAttentionWithEveryKeyBlockedAveragesAllValues) {
  at::Tensor q = at::randn({1, 2, 1, 16}), k = at::randn({1, 1, 5, 16}), v = at::randn({1, 1, 5, 16});
  at::Tensor real = at::zeros({1, 5}, at::kBool);
  at::Tensor want = reference_attention(q, k, v, real, 4, 0.25);
  for (Isa isa : kernels::supported_isas()) {
    at::Tensor got = kernels::decode_attention_on(isa, q, k, v, real, 4, 0.25);
    EXPECT_LT((got.to(at::kDouble) - want).abs().max().item<double>(), 1e-5) << kernels::isa_name(isa);
  }
}

// A bfloat16 cache: keys and values widened exactly as they are read, so every path gives bit
// for bit what it gives over the same values stored as float32: head dims with and without a
// scalar tail and the register-blocked value pass, padding, causal columns, a cache view, and a
// row with every key blocked.
TEST(CpuKernels, DecodeAttentionOverABfloat16CacheIsTheFloat32PathOnTheSameValues) {
  at::manual_seed(8);
  for (int64_t d : {16, 24, 40, 64, 128}) {  // 16: one step of the key blocks
    const int64_t keys = 70, capacity = 80, s = 2;
    const at::Tensor k_cache = (at::randn({2, 2, capacity, d}) * 2).to(at::kBFloat16);
    const at::Tensor v_cache = at::randn({2, 2, capacity, d}).to(at::kBFloat16);
    const at::Tensor k = k_cache.narrow(2, 0, keys), v = v_cache.narrow(2, 0, keys);
    const at::Tensor q = at::randn({2, 6, s, d});
    at::Tensor real = at::ones({2, keys}, at::kLong);
    real[1].narrow(0, 0, 20).fill_(0);
    at::Tensor none = at::zeros({2, keys}, at::kLong);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (Isa isa : kernels::supported_isas()) {
      SCOPED_TRACE(testing::Message() << kernels::isa_name(isa) << " d " << d);
      for (const at::Tensor& r : {real, none}) {
        const at::Tensor got = kernels::decode_attention_on(isa, q, k, v, r, keys - s, scale);
        const at::Tensor want =
            kernels::decode_attention_on(isa, q, k.to(at::kFloat), v.to(at::kFloat), r, keys - s, scale);
        EXPECT_TRUE(at::equal(got, want)) << "max |diff| " << (got - want).abs().max().item<double>();
      }
      EXPECT_LT((kernels::decode_attention_on(isa, q, k, v, real, keys - s, scale).to(at::kDouble) -
                 reference_attention(q, k.to(at::kFloat), v.to(at::kFloat), real, keys - s, scale))
                    .abs()
                    .max()
                    .item<double>(),
                2e-5);
    }
  }
  // Keys and values of one dtype each.
  const at::Tensor q = at::randn({1, 2, 1, 16}), k = at::randn({1, 1, 5, 16});
  EXPECT_THROW(kernels::decode_attention(q, k.to(at::kBFloat16), k, at::ones({1, 5}), 4, 1.0), Error);
  EXPECT_THROW(kernels::decode_attention(q, k.to(at::kHalf), k.to(at::kHalf), at::ones({1, 5}), 4, 1.0), Error);
}

// An FP8 cache (rows of E4M3 bytes and their scale, encode_fp8_kv_row): every path attends as
// float64 does over the rows' decoded values (decode_fp8_kv), within float32 accumulation: head
// dims with and without a scalar tail, the register-blocked value pass and key blocks widened
// once per group (and a head too wide for that), rows of very different
// scales (a factor applied to the wrong key or value row shows), padding, causal columns, a cache
// view and a row with every key blocked.
TEST(CpuKernels, DecodeAttentionOverAnFp8CacheMatchesFloat64OnItsDecodedValues) {
  at::manual_seed(12);
  for (int64_t d : {16, 24, 40, 64, 128, 320}) {  // 320: wider than the blocks widened on the stack
    const int64_t keys = 70, capacity = 80, s = 2;
    // Key rows from 1/4 to 4 (scores stay within the exponential's useful range), value rows from
    // 4^-3 to 4^3.
    const at::Tensor k_cache =
        encode_fp8_kv(at::randn({2, 2, capacity, d}) * at::pow(2.0, at::randint(-2, 3, {2, 2, capacity, 1})));
    const at::Tensor v_cache =
        encode_fp8_kv(at::randn({2, 2, capacity, d}) * at::pow(4.0, at::randint(-3, 4, {2, 2, capacity, 1})));
    const at::Tensor k = k_cache.narrow(2, 0, keys), v = v_cache.narrow(2, 0, keys);
    const at::Tensor q = at::randn({2, 6, s, d});
    at::Tensor real = at::ones({2, keys}, at::kLong);
    real[1].narrow(0, 0, 20).fill_(0);
    at::Tensor none = at::zeros({2, keys}, at::kLong);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (const at::Tensor& r : {real, none}) {
      const at::Tensor want = reference_attention(q, decode_fp8_kv(k), decode_fp8_kv(v), r, keys - s, scale);
      for (Isa isa : kernels::supported_isas()) {
        SCOPED_TRACE(testing::Message() << kernels::isa_name(isa) << " d " << d);
        const at::Tensor got = kernels::decode_attention_on(isa, q, k, v, r, keys - s, scale);
        const double err = (got.to(at::kDouble) - want).abs().max().item<double>();
        EXPECT_LT(err / want.abs().max().item<double>(), 1e-5) << "max |diff| " << err;
      }
    }
  }
  // Rows must hold the head dim and the scale: q's head dim plus 4 bytes.
  const at::Tensor q = at::randn({1, 2, 1, 16});
  EXPECT_THROW(kernels::decode_attention(q, encode_fp8_kv(at::randn({1, 1, 5, 12})),
                                         encode_fp8_kv(at::randn({1, 1, 5, 12})), at::ones({1, 5}), 4, 1.0),
               Error);
  EXPECT_NO_THROW(kernels::decode_attention(q, encode_fp8_kv(at::randn({1, 1, 5, 16})),
                                            encode_fp8_kv(at::randn({1, 1, 5, 16})), at::ones({1, 5}), 4, 1.0));
}

TEST(CpuKernels, DecodeAttentionRefusesMismatchedShapes) {
  at::Tensor q = at::randn({1, 3, 1, 16}), k = at::randn({1, 2, 5, 16});
  EXPECT_THROW(kernels::decode_attention(q, k, k, at::ones({1, 5}), 4, 1.0), Error);  // 3 heads over 2 KV heads
  at::Tensor q2 = at::randn({1, 4, 1, 16});
  EXPECT_THROW(kernels::decode_attention(q2, k, k, at::ones({1, 6}), 4, 1.0), Error);  // key_real width
}

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
