#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vlmgen/error.h"
#include "vlmgen/image_spans.h"

namespace vlmgen {

/// Which images a forward call is sent.
enum class ReplayMode {
  /// Exactly the images whose placeholder span overlaps the call's window (the default, and
  /// the only correct rule): every step without a KV cache, prefill only with one, the new
  /// turn's images after a cached prefix, a chunk's own images in chunked prefill.
  kSpanAware,
  /// Every image at every call, whatever the window. For models that select embeddings
  /// themselves from the full bundle.
  kAlways,
  /// WRONG, kept only to reproduce the upstream bug in tests and A/B demos: every image at
  /// step 0, none afterwards. Without a KV cache, steps >= 1 recompute the whole prefix with
  /// the image placeholders left un-replaced, and the text drifts away from the picture.
  kStepZero,
};

inline const char* to_string(ReplayMode mode) {
  switch (mode) {
    case ReplayMode::kSpanAware: return "span-aware";
    case ReplayMode::kAlways: return "always";
    case ReplayMode::kStepZero: return "step-zero (legacy, wrong)";
  }
  return "?";
}

/// The token columns [start, end) one forward call computes, the same for every row.
struct TokenWindow {
  int64_t start = 0;
  int64_t end = 0;
};

/// Decides, for one forward call, which images to send. A pure function of the window, the
/// spans and (for kStepZero only) the step: no tensors involved.
///
///   ReplayPolicy policy;                        // kSpanAware
///   auto images = policy.images_for_window({0, 40}, spans, /*step=*/3);
class ReplayPolicy {
 public:
  explicit ReplayPolicy(ReplayMode mode = ReplayMode::kSpanAware, bool allow_partial_spans = false)
      : mode_(mode), allow_partial_spans_(allow_partial_spans) {}

  ReplayMode mode() const { return mode_; }
  bool allow_partial_spans() const { return allow_partial_spans_; }

  /// Ascending indices of the images to send for `window` at generation `step`. Under
  /// kSpanAware a span cut by the window is an error unless partial spans are allowed, since
  /// the model would get an embedding count that disagrees with the placeholders it sees.
  std::vector<int64_t> images_for_window(TokenWindow window, const std::vector<ImageSpan>& spans, int64_t step) const {
    VLMGEN_CHECK(window.start >= 0 && window.end >= window.start, "invalid window [{}, {})", window.start, window.end);
    std::vector<int64_t> images;
    switch (mode_) {
      case ReplayMode::kAlways:
        for (const auto& s : spans) images.push_back(s.image);
        break;
      case ReplayMode::kStepZero:
        if (step == 0) {
          for (const auto& s : spans) images.push_back(s.image);
        }
        break;
      case ReplayMode::kSpanAware:
        if (window.start == window.end) break;  // an empty window computes no image
        for (const auto& s : spans) {
          if (s.end <= window.start || s.begin >= window.end) continue;
          VLMGEN_CHECK(allow_partial_spans_ || (s.begin >= window.start && s.end <= window.end),
                       "image {} (row {}) has its placeholders at columns [{}, {}) but the window [{}, {}) "
                       "cuts them; the model cannot take part of an image",
                       s.image, s.row, s.begin, s.end, window.start, window.end);
          images.push_back(s.image);
        }
        break;
    }
    std::sort(images.begin(), images.end());
    images.erase(std::unique(images.begin(), images.end()), images.end());
    return images;
  }

  /// Where a prefill chunk starting at `start` should end, given a wish of `proposed_end`: the
  /// largest end <= proposed_end that cuts no span, or, when a span starting inside the chunk
  /// is longer than the chunk, the end of that span (a chunk never splits an image unless
  /// partial spans are allowed).
  int64_t chunk_end(int64_t start, int64_t proposed_end, const std::vector<ImageSpan>& spans) const {
    VLMGEN_CHECK(proposed_end > start, "a chunk must hold at least one token: [{}, {})", start, proposed_end);
    if (allow_partial_spans_) return proposed_end;
    int64_t end = proposed_end;
    bool moved = true;
    while (moved) {  // moving the end back can land inside another span of another row
      moved = false;
      for (const auto& s : spans) {
        if (s.begin < end && end < s.end) {
          end = s.begin;
          moved = true;
        }
      }
    }
    if (end > start) return end;
    // The first span at the chunk's start does not fit: take all of it (and whatever spans of
    // other rows it then cuts).
    end = proposed_end;
    moved = true;
    while (moved) {
      moved = false;
      for (const auto& s : spans) {
        if (s.begin < end && end < s.end) {
          end = s.end;
          moved = true;
        }
      }
    }
    return end;
  }

 private:
  ReplayMode mode_;
  bool allow_partial_spans_;
};

}  // namespace vlmgen
