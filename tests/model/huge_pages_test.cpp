// Decode weights loaded into memory advised for transparent huge pages (LoadOptions::huge_pages):
// where the bytes go, that they are the same bytes, and that the memory lives exactly as long as
// a tensor on it.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "qwen_test_util.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/models/llava_next.h"
#include "vlmgen/models/qwen2_vl.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)

constexpr uintptr_t kTwoMiB = uintptr_t{2} << 20;

/// The mapping of this process that holds `p`, from /proc/self/smaps: its range and its
/// THPeligible line (-1 where the kernel prints none). start == end == 0 when none holds it.
struct Vma {
  uintptr_t start = 0, end = 0;
  int thp_eligible = -1;
};

Vma vma_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  Vma found;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t start = 0, end = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> start >> dash >> end && dash == '-' && line.find(':') > line.find(' ')) {
      if (inside) break;  // the next mapping's header
      inside = address >= start && address < end;
      if (inside) found = Vma{start, end, -1};
    } else if (inside && line.rfind("THPeligible:", 0) == 0) {
      found.thp_eligible = std::stoi(line.substr(12));
    }
  }
  return found;
}

/// Whether the system lets a process ask for huge pages (enabled is "always" or "madvise").
bool thp_allowed() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string s;
  std::getline(f, s);
  return !s.empty() && s.find("[never]") == std::string::npos;
}

/// What a decode step reads whole: every layer's 7 matrices, then the head unless it is the
/// embedding (a tied head stays that one tensor, where the embedding was loaded).
template <class Model>
std::vector<at::Tensor> streamed(const Model& lm) {
  std::vector<at::Tensor> out;
  for (const auto& l : lm.layers)
    for (const qwen_vl::Linear* linear :
         {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj})
      out.push_back(linear->weight);
  if (!lm.lm_head.is_same(lm.embed_tokens)) out.push_back(lm.lm_head);
  return out;
}

/// The tensors lie one after another from a 2 MiB boundary (in the order the loader read them),
/// each at a 64-byte boundary, none overlapping, all in one mapping that the kernel may back with
/// huge pages.
void expect_packed(std::vector<at::Tensor> tensors) {
  ASSERT_FALSE(tensors.empty());
  auto at = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()); };
  std::sort(tensors.begin(), tensors.end(), [&](const at::Tensor& a, const at::Tensor& b) { return at(a) < at(b); });
  EXPECT_EQ(at(tensors[0]) % kTwoMiB, 0u);
  for (size_t i = 1; i < tensors.size(); ++i) {
    EXPECT_EQ(at(tensors[i]) % 64, 0u);
    EXPECT_EQ(at(tensors[i]), at(tensors[i - 1]) + (tensors[i - 1].nbytes() + 63) / 64 * 64)
        << "tensor " << i << " of " << tensors.size() << ": not right after the one before";
  }
  const Vma vma = vma_of(tensors[0].data_ptr());
  const uintptr_t end = at(tensors.back()) + tensors.back().nbytes();
  EXPECT_LE(end, vma.end);
  EXPECT_LE(vma.end, (end + kTwoMiB - 1) / kTwoMiB * kTwoMiB) << "the reserved room past the last page is given back";
  if (thp_allowed() && vma.thp_eligible != -1) {
    EXPECT_EQ(vma.thp_eligible, 1);
  }
}

TEST(HugePages, QwenDecodeWeightsLoadIntoOneMappingWithTheSameValues) {
  ScratchDir scratch;
  QwenVlConfig config = test_config();
  config.intermediate_size = 8192;  // 12.6 MB of float32 weights: several 2 MiB pages, and as bf16
                                    // half the room reserved for them is left to give back
  Qwen2Vl model(config, 9);
  model.save_checkpoint(scratch.dir("a"));
  const VisionInputs vision = make_vision(config, {{1, 4, 4}}, 71);
  const Batch batch = left_pad({image_prompt({1, 2, 3}, 4, {4, 5}), {6, 7, 8}});

  auto moved = Qwen2Vl::from_checkpoint(scratch.dir("a"));
  LoadOptions off;
  off.huge_pages = false;
  auto kept = Qwen2Vl::from_checkpoint(scratch.dir("a"), ParallelContext::single(), off);
  std::vector<at::Tensor> weights = streamed(moved->language_model());
  expect_packed(weights);
  const std::vector<at::Tensor> plain = streamed(kept->language_model());
  for (size_t i = 0; i < weights.size(); ++i) EXPECT_TRUE(weights[i].equal(plain[i])) << i;
  EXPECT_NE(vma_of(plain[0].data_ptr()).start, vma_of(weights[0].data_ptr()).start);
  LoadOptions bf16;
  bf16.weights_dtype = at::kBFloat16;
  auto half = Qwen2Vl::from_checkpoint(scratch.dir("a"), ParallelContext::single(), bf16);
  const std::vector<at::Tensor> half_weights = streamed(half->language_model());
  EXPECT_EQ(half_weights[0].scalar_type(), at::kBFloat16);
  expect_packed(half_weights);
  for (size_t i = 0; i < weights.size(); ++i) EXPECT_TRUE(half_weights[i].equal(plain[i].to(at::kBFloat16))) << i;
  const at::Tensor want = full_forward(model, batch, vision);
  EXPECT_TRUE(full_forward(*moved, batch, vision).equal(want));
  EXPECT_TRUE(full_forward(*kept, batch, vision).equal(want));

  // The mapping lives while any tensor on it does: a weight outlives its model, then goes.
  at::Tensor survivor = moved->language_model().layers[1].down_proj.weight;
  const at::Tensor values = survivor.clone();
  const uintptr_t start = vma_of(survivor.data_ptr()).start;
  weights.clear();
  moved.reset();
  EXPECT_TRUE(survivor.equal(values));
  EXPECT_EQ(vma_of(survivor.data_ptr()).start, start);
  const void* gone = survivor.data_ptr();
  survivor = at::Tensor();
  EXPECT_EQ(vma_of(gone).start, 0u) << "unmapped with the last tensor on it";
}

TEST(HugePages, ATiedHeadStaysTheEmbeddingAndGemmaAndLlavaLoadTheirsThereToo) {
  ScratchDir scratch;
  QwenVlConfig config = test_config();
  config.tie_word_embeddings = true;
  Qwen2Vl(config, 4).save_checkpoint(scratch.dir("tied"));
  auto tied = Qwen2Vl::from_checkpoint(scratch.dir("tied"));
  const qwen_vl::LanguageModel& lm = tied->language_model();
  EXPECT_TRUE(lm.lm_head.is_same(lm.embed_tokens));
  EXPECT_EQ(streamed(lm).size(), lm.layers.size() * 7);
  expect_packed(streamed(lm));

  Gemma3 gemma(Gemma3Config::tiny(), 5);
  gemma.save_checkpoint(scratch.dir("gemma"));
  auto gemma_loaded = Gemma3::from_checkpoint(scratch.dir("gemma"));
  expect_packed(streamed(gemma_loaded->language_model()));

  LlavaNext llava(LlavaNextConfig::tiny(), 6);
  llava.save_checkpoint(scratch.dir("llava"));
  auto llava_loaded = LlavaNext::from_checkpoint(scratch.dir("llava"));
  const qwen_vl::LanguageModel& text = llava_loaded->language_model().language_model();
  expect_packed(streamed(text));
}

}  // namespace
}  // namespace vlmgen
