// The CPU decode-attention kernel on every path this machine can run, against float64 attention
// on the same numbers: float32, bfloat16 and FP8 caches, padding, causal columns, edge scores.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "vlmgen/error.h"
#include "vlmgen/fp8_kv_rows.h"
#include "vlmgen/kernels/cpu.h"

namespace vlmgen {
namespace {

using kernels::Isa;

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

}  // namespace
}  // namespace vlmgen
