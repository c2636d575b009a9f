#include "vlmgen/sampling.h"

#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "vlmgen/detail/torch_compat.h"

namespace vlmgen {
namespace {

// The nucleus by brute force: most likely first, until the mass before a token reaches top_p.
std::set<int64_t> nucleus(const at::Tensor& logits, double temperature, double top_p) {
  auto [p, ids] = at::sort(at::softmax(logits / temperature, 0), 0, true);
  std::set<int64_t> keep;
  double mass = 0;
  for (int64_t i = 0; i < p.size(0) && (i == 0 || mass < top_p); ++i) {
    keep.insert(ids[i].item<int64_t>());
    mass += p[i].item<double>();
  }
  return keep;
}

TEST(Sampler, TopPSamplesOnlyFromTheNucleusOnPeakedAndFlatLogits) {
  at::Generator gen = detail::make_cpu_generator(3);
  for (double scale : {8.0, 0.05}) {  // peaked: nucleus in the top 1024; flat: it is not
    at::Tensor logits = at::randn({5000}, gen) * scale;
    SamplingOptions o;
    o.temperature = 0.9;
    o.top_p = 0.6;
    o.seed = 11;
    Sampler sampler(o, 1);
    const auto allowed = nucleus(logits, 0.9, 0.6);
    std::set<int64_t> seen;
    for (int i = 0; i < 300; ++i) {
      const int64_t t = sampler.choose(logits.unsqueeze(0), {true})[0];
      EXPECT_TRUE(allowed.count(t)) << "token " << t << " is outside the nucleus (scale " << scale << ")";
      seen.insert(t);
    }
    EXPECT_GT(seen.size(), 1u) << "sampling, not argmax";
  }
}

TEST(Sampler, TopKSamplesOnlyTheKBestAndSuppressedTokensNever) {
  at::Tensor logits = at::arange(100, at::kFloat) / 10.0;  // token 99 best
  SamplingOptions o;
  o.temperature = 2.0;
  o.top_k = 5;
  o.suppressed_tokens = {98};
  Sampler sampler(o, 1);
  std::set<int64_t> seen;
  for (int i = 0; i < 400; ++i) seen.insert(sampler.choose(logits.unsqueeze(0), {true})[0]);
  EXPECT_EQ(seen, (std::set<int64_t>{94, 95, 96, 97, 99}));
}

TEST(Sampler, InactiveRowsGetMinusOneAndKeepTheirStream) {
  SamplingOptions o;
  o.temperature = 1.0;
  o.seed = 5;
  at::Tensor logits = at::zeros({2, 50});
  Sampler a(o, 2), b(o, 2);
  a.choose(logits, {false, true});  // row 0 inactive: its stream must not move
  for (int i = 0; i < 8; ++i) {     // eight draws in a row: a moved stream would not match them all
    EXPECT_EQ(a.choose(logits, {true, false})[0], b.choose(logits, {true, false})[0]) << "draw " << i;
  }
  EXPECT_EQ(b.choose(logits, {false, true})[0], -1);
}

}  // namespace
}  // namespace vlmgen
