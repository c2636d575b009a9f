#pragma once

#include <cstdint>
#include <vector>

#include "vlmgen/error.h"

namespace vlmgen {

/// Where one image's placeholder tokens sit: columns [begin, end) of batch row `row`.
struct ImageSpan {
  int64_t image = 0;  ///< index into the request's VisionInputs
  int64_t row = 0;
  int64_t begin = 0;
  int64_t end = 0;

  int64_t size() const { return end - begin; }
  bool operator==(const ImageSpan& o) const {
    return image == o.image && row == o.row && begin == o.begin && end == o.end;
  }
};

/// Finds every image's placeholder span in `rows` (one token vector per batch row, unpadded).
/// Images are assigned in order of appearance, row 0 first, with the placeholder count of
/// image i being `tokens_per_image[i]`; adjacent images may share one run of placeholders.
/// `column_offset[r]` (optional) is added to row r's columns, e.g. its left padding.
/// Throws vlmgen::Error when the counts disagree: the message gives both numbers.
inline std::vector<ImageSpan> find_image_spans(const std::vector<std::vector<int64_t>>& rows, int64_t image_token_id,
                                               const std::vector<int64_t>& tokens_per_image,
                                               const std::vector<int64_t>& column_offset = {}) {
  VLMGEN_CHECK(column_offset.empty() || column_offset.size() == rows.size(), "column_offset has {} entries for {} rows",
               column_offset.size(), rows.size());
  int64_t placeholders = 0;
  for (const auto& row : rows) {
    for (int64_t t : row) placeholders += (t == image_token_id);
  }
  int64_t needed = 0;
  for (int64_t c : tokens_per_image) needed += c;
  VLMGEN_CHECK(placeholders == needed,
               "the prompts hold {} image placeholder tokens (id {}) but the vision bundle's {} images need {}",
               placeholders, image_token_id, tokens_per_image.size(), needed);

  std::vector<ImageSpan> spans;
  size_t next_image = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const auto& row = rows[r];
    const int64_t offset = column_offset.empty() ? 0 : column_offset[r];
    const int64_t len = static_cast<int64_t>(row.size());
    int64_t i = 0;
    while (i < len) {
      if (row[i] != image_token_id) {
        ++i;
        continue;
      }
      int64_t run_end = i;
      while (run_end < len && row[run_end] == image_token_id) ++run_end;
      // Split the run into consecutive images.
      int64_t pos = i;
      while (pos < run_end) {
        VLMGEN_CHECK(next_image < tokens_per_image.size(),
                     "row {}: placeholder run at columns [{}, {}) holds more images than the bundle's {}", r, i,
                     run_end, tokens_per_image.size());
        const int64_t need = tokens_per_image[next_image];
        VLMGEN_CHECK(need > 0, "image {} has {} placeholder tokens; expected a positive count", next_image, need);
        VLMGEN_CHECK(pos + need <= run_end,
                     "row {}: image {} needs {} placeholder tokens but its run at columns [{}, {}) has {} left", r,
                     next_image, need, i, run_end, run_end - pos);
        spans.push_back({static_cast<int64_t>(next_image), static_cast<int64_t>(r), pos + offset, pos + need + offset});
        pos += need;
        ++next_image;
      }
      i = run_end;
    }
  }
  return spans;
}

}  // namespace vlmgen
