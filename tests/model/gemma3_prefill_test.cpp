// Gemma-3 prompts longer than one chunk of the prefill attention (128 query columns,
// detail::kAttentionChunk): each chunk computes only the keys its queries see, which for a query inside an image
// reaches past the chunk's last column (the image's later placeholders) and, in a sliding layer,
// before the window (its earlier ones). A one-shot forward of such a prompt must equal the same
// prompt computed in cached windows that hold each image whole.

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "gemma3_test_util.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/models/gemma3.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)
using gemma3_test::hashed_images;
using gemma3_test::hashed_model;
using gemma3_test::image;

constexpr int64_t kLength = 300;  // three chunks of the attention

/// A row of `length` text tokens with an image (begin-of-image, 4 placeholders, end-of-image)
/// whose begin-of-image token sits at each of `boi_at`.
std::vector<int64_t> row_with_images(int64_t length, const std::vector<int64_t>& boi_at) {
  std::vector<int64_t> row;
  for (int64_t i = 0; i < length; ++i) row.push_back(2 + (i * 7) % 80);
  const std::vector<int64_t> placeholders = image();
  for (int64_t at : boi_at) std::copy(placeholders.begin(), placeholders.end(), row.begin() + at);
  return row;
}

TEST(Gemma3Prefill, ALongPromptInOneShotEqualsCachedWindowsWithImagesAcrossChunkEdges) {
  // A sliding window of 2 columns, shorter than an image: a query at an image's third
  // placeholder sees the image's first one only through the image rule.
  Gemma3Config config = Gemma3Config::tiny();
  config.sliding_window = 2;
  auto model = hashed_model(config);
  // Placeholder columns (row 1 is left-padded by 30): row 0 [11, 15), [126, 130), [254, 258);
  // row 1 [125, 129), [253, 257): the chunk edges at 128 and 256 fall inside four of them.
  const std::vector<std::vector<int64_t>> rows = {row_with_images(kLength, {10, 125, 253}),
                                                  row_with_images(kLength - 30, {94, 222})};
  const Batch batch = left_pad(rows);
  ASSERT_EQ(batch.ids.size(1), kLength);
  const VisionInputs vision = hashed_images({2001, 2002, 2003, 2004, 2005});
  const at::Tensor one_shot = full_forward(*model, batch, vision);

  // Windows whose edges fall outside every image, each sent the images it holds (row 0's, then
  // row 1's, in order).
  const RopePlan plan = model->plan_positions(batch.ids, batch.mask, vision);
  const std::vector<std::pair<int64_t, std::vector<int64_t>>> windows = {
      {0, {0}}, {64, {}}, {120, {1, 3}}, {131, {}}, {200, {}}, {250, {2, 4}}, {259, {}}};
  InferenceContext ctx(model->traits().kv_cache, 2, kLength);
  double worst = 0.0;
  for (size_t i = 0; i < windows.size(); ++i) {
    const int64_t start = windows[i].first;
    const int64_t end = i + 1 < windows.size() ? windows[i + 1].first : kLength;
    ForwardArgs args;
    args.input_ids = batch.ids.narrow(1, start, end - start);
    args.attention_mask = batch.mask.narrow(1, 0, end);
    args.position_ids = plan.prompt_positions.narrow(1, start, end - start);
    args.context = &ctx;
    args.window_start = start;
    if (!windows[i].second.empty()) {
      args.vision = vision.select(windows[i].second);
      args.images = windows[i].second;
    }
    const at::Tensor logits = model->forward(args);
    ctx.commit(args.input_ids, batch.mask.narrow(1, start, end - start));
    for (int64_t r = 0; r < 2; ++r) {  // the rows' real columns only (row 1's padding is ignored)
      const int64_t from = std::max(start, batch.pads[static_cast<size_t>(r)]);
      if (from >= end) continue;
      worst = std::max(
          worst, max_abs_diff(logits[r].narrow(0, from - start, end - from), one_shot[r].narrow(0, from, end - from)));
    }
  }
  report("gemma3 300-token prompt, one shot vs 7 cached windows, max|diff|", worst);
  EXPECT_LE(worst, 1e-5);
}

}  // namespace
}  // namespace vlmgen
