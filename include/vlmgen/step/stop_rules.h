#pragma once

// Why a row ends after choosing `token`: an end token, a stop token, or its length budget.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vlmgen/request.h"

namespace vlmgen::detail {

inline bool contains(const std::vector<int64_t>& ids, int64_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

/// The finish reason of a row that has just produced `token` as its `produced`-th new token
/// (kNotFinished when it goes on).
inline FinishReason finish_reason_after(int64_t token, int64_t produced, const GenerationConfig& config) {
  if (contains(config.end_token_ids(), token)) return FinishReason::kEndId;
  if (contains(config.stop_token_ids(), token)) return FinishReason::kStopWords;
  if (produced == config.max_new_tokens()) return FinishReason::kLength;
  return FinishReason::kNotFinished;
}

}  // namespace vlmgen::detail
