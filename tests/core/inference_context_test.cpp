#include "vlmgen/inference_context.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace vlmgen {
namespace {

TEST(InferenceContext, AppendReturnsPrefixPlusWindowAndCommitAdvances) {
  KvCacheSpec spec{2, 2, 3, at::kFloat};
  InferenceContext ctx(spec, 1, 10);
  auto k1 = at::rand({1, 2, 4, 3}), v1 = at::rand({1, 2, 4, 3});
  auto [k, v] = ctx.append_kv(1, k1, v1);
  EXPECT_TRUE(at::equal(k, k1));
  EXPECT_EQ(ctx.length(), 0) << "append does not commit";
  ctx.commit(at::arange(4, at::kLong).unsqueeze(0), at::ones({1, 4}, at::kLong));
  EXPECT_EQ(ctx.length(), 4);
  auto k2 = at::rand({1, 2, 1, 3});
  auto [kk, vv] = ctx.append_kv(1, k2, k2);
  EXPECT_EQ(kk.size(2), 5);
  EXPECT_TRUE(at::equal(kk.narrow(2, 0, 4), k1));
  EXPECT_TRUE(at::equal(kk.narrow(2, 4, 1), k2));
  EXPECT_TRUE(at::equal(ctx.tokens(), at::arange(4, at::kLong).unsqueeze(0)));
  ctx.truncate(2);
  EXPECT_EQ(ctx.length(), 2);
  EXPECT_THROW(ctx.truncate(3), Error);
}

TEST(InferenceContext, OverflowIsAnErrorWithTheNumbers) {
  InferenceContext ctx(KvCacheSpec{1, 1, 2, at::kFloat}, 1, 4);
  ctx.commit(at::zeros({1, 3}, at::kLong), at::ones({1, 3}, at::kLong));
  try {
    ctx.append_kv(0, at::zeros({1, 1, 2, 2}), at::zeros({1, 1, 2, 2}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("holds 3 of 4 columns; 2 more"));
  }
  EXPECT_THROW(ctx.append_kv(0, at::zeros({1, 2, 1, 2}), at::zeros({1, 2, 1, 2})), Error) << "wrong kv heads";
  EXPECT_THROW(ctx.append_kv(5, at::zeros({1, 1, 1, 2}), at::zeros({1, 1, 1, 2})), Error) << "no layer 5";
  EXPECT_EQ(ctx.length(), 3);
}

TEST(InferenceContext, BytesComeFromTheConfiguredHeadDim) {
  // A Mistral-Small-24B-like shape: hidden 5120 / 32 heads would give 160, the config says 128.
  KvCacheSpec spec{40, 8, 128, at::kBFloat16};
  EXPECT_EQ(spec.bytes_per_token(), 2 * 40 * 8 * 128 * 2);
  InferenceContext ctx(KvCacheSpec{2, 2, 4, at::kFloat}, 3, 5);
  EXPECT_EQ(ctx.bytes(), 2 * 2 * 2 * 4 * 4 * 3 * 5);
}

}  // namespace
}  // namespace vlmgen
