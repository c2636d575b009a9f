#include "vlmgen/replay_policy.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace vlmgen {
namespace {

// Random non-overlapping spans per row over `columns` columns, images numbered row-major.
std::vector<ImageSpan> random_spans(std::mt19937& rng, int64_t rows, int64_t columns) {
  std::vector<ImageSpan> spans;
  int64_t image = 0;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t c = 0;
    while (true) {
      c += std::uniform_int_distribution<int64_t>(0, 4)(rng);
      const int64_t len = std::uniform_int_distribution<int64_t>(1, 5)(rng);
      if (c + len > columns) break;
      spans.push_back({image++, r, c, c + len});
      c += len;
    }
  }
  return spans;
}

TEST(ReplayPolicy, SpanAwareSendsExactlyTheImagesInsideTheWindow) {
  std::mt19937 rng(12345);
  const ReplayPolicy policy;
  const ReplayPolicy partial(ReplayMode::kSpanAware, /*allow_partial_spans=*/true);
  int checked = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t columns = 16;
    auto spans = random_spans(rng, 1 + trial % 3, columns);
    for (int64_t start = 0; start <= columns; ++start) {
      for (int64_t end = start; end <= columns; ++end) {
        // Brute force: an image is touched when any of its columns is in the window.
        std::vector<int64_t> touched;
        bool cut = false;
        for (const auto& s : spans) {
          int64_t inside = 0;
          for (int64_t c = s.begin; c < s.end; ++c) inside += (c >= start && c < end);
          if (inside > 0) touched.push_back(s.image);
          if (inside > 0 && inside < s.size()) cut = true;
        }
        std::sort(touched.begin(), touched.end());
        EXPECT_EQ(partial.images_for_window({start, end}, spans, 3), touched);
        if (cut) {
          EXPECT_THROW(policy.images_for_window({start, end}, spans, 3), Error);
        } else {
          EXPECT_EQ(policy.images_for_window({start, end}, spans, 3), touched);
        }
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 20000);
}

TEST(ReplayPolicy, TheThreeTextbookCases) {
  // One image at columns [3, 7) of a 10-column prompt.
  const std::vector<ImageSpan> spans = {{0, 0, 3, 7}};
  const ReplayPolicy policy;
  for (int64_t step = 0; step < 5; ++step) {  // no cache: the window is the whole prefix
    EXPECT_EQ(policy.images_for_window({0, 10 + step}, spans, step), std::vector<int64_t>{0});
  }
  EXPECT_EQ(policy.images_for_window({0, 10}, spans, 0), std::vector<int64_t>{0});  // cache: prefill
  EXPECT_TRUE(policy.images_for_window({10, 11}, spans, 1).empty());                // cache: decode
  // Cached text prefix of 3 columns, then the turn with the image.
  EXPECT_EQ(policy.images_for_window({3, 10}, spans, 0), std::vector<int64_t>{0});
}

TEST(ReplayPolicy, LegacyAndAlwaysModes) {
  const std::vector<ImageSpan> spans = {{0, 0, 3, 7}, {1, 1, 0, 2}};
  const ReplayPolicy legacy(ReplayMode::kStepZero);
  EXPECT_EQ(legacy.images_for_window({0, 10}, spans, 0), (std::vector<int64_t>{0, 1}));
  EXPECT_TRUE(legacy.images_for_window({0, 11}, spans, 1).empty()) << "the bug, kept on purpose";
  const ReplayPolicy always(ReplayMode::kAlways);
  EXPECT_EQ(always.images_for_window({10, 11}, spans, 4), (std::vector<int64_t>{0, 1}));
}

TEST(ReplayPolicy, ChunkEndNeverSplitsAnImage) {
  std::mt19937 rng(99);
  const ReplayPolicy policy;
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t columns = 24;
    auto spans = random_spans(rng, 1 + trial % 3, columns);
    for (int64_t chunk = 1; chunk <= 8; ++chunk) {
      int64_t start = 0;
      std::vector<int> sent(spans.size(), 0);
      while (start < columns) {
        const int64_t wish = std::min(columns, start + chunk);
        const int64_t end = policy.chunk_end(start, wish, spans);
        ASSERT_GT(end, start);
        ASSERT_LE(end, columns);
        for (int64_t i : policy.images_for_window({start, end}, spans, 0)) ++sent[i];  // throws if cut
        // When the chunk shrank, growing it by one column would have cut a span.
        if (end < wish) {
          EXPECT_THROW(policy.images_for_window({start, end + 1}, spans, 0), Error);
        }
        start = end;
      }
      for (int s : sent) EXPECT_EQ(s, 1);
    }
  }
}

}  // namespace
}  // namespace vlmgen
