#pragma once

// Under tensor parallelism every rank must run the same request: a rank with another prompt
// length deadlocks or aborts inside a collective, and one with the same length but other ids,
// images or options silently computes garbage. One small all-gather of a request digest at
// the start of a call turns both into a vlmgen::Error on every rank, naming the ranks.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "vlmgen/content_hash.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/error.h"

namespace vlmgen::detail {

/// Gathers `digest` from every rank of `group` (on `device`, which the communicator's backend
/// must accept) and throws vlmgen::Error on every rank when they differ. `what` names the
/// thing compared, for the message; `advice` ends it.
inline void check_ranks_agree(Communicator& group, const ContentHash& digest, at::Device device, const char* what,
                              const char* advice = "every rank must call with the same prompts, images and options") {
  // Eight 4-byte words, each below 2^32: exact in float64 on any backend.
  std::vector<double> words(8);
  for (size_t i = 0; i < 8; ++i) {
    words[i] = static_cast<double>(uint32_t{digest[4 * i]} << 24 | uint32_t{digest[4 * i + 1]} << 16 |
                                   uint32_t{digest[4 * i + 2]} << 8 | uint32_t{digest[4 * i + 3]});
  }
  at::Tensor local = at::tensor(words, at::kDouble).reshape({1, 8}).to(device);
  at::Tensor all = group.all_gather(local, 0).to(at::kCPU);  // [ranks, 8]
  std::vector<int64_t> differ;
  for (int64_t r = 0; r < all.size(0); ++r) {
    if (!at::equal(all[r], all[0])) differ.push_back(r);
  }
  if (differ.empty()) return;
  VLMGEN_FAIL(
      "tensor-parallel ranks were given different {}: rank(s) [{}] differ from rank 0 (this is rank {} of {}); {}",
      what, fmt::join(differ, ", "), group.rank(), group.size(), advice);
}

}  // namespace vlmgen::detail
