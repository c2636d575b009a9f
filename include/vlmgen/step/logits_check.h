#pragma once

// What a model must return from a forward call: logits [batch, columns, >= vocab] (or the last
// column only, when that is all the generator asked for; a block of the vocabulary per rank for
// vocab-parallel models). Anything else is the model's bug, named before it is sampled from.

#include <ATen/ATen.h>

#include <cstdint>

#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/model.h"

namespace vlmgen::detail {

inline void check_window_logits(const at::Tensor& logits, int64_t batch, int64_t columns, bool last_column_only,
                                const ModelTraits& traits, bool vocab_parallel, int64_t tp_size) {
  const bool columns_ok =
      logits.defined() && logits.dim() == 3 && (logits.size(1) == columns || (last_column_only && logits.size(1) == 1));
  if (vocab_parallel) {
    VLMGEN_CHECK(columns_ok && logits.size(0) == batch && logits.size(2) * tp_size >= traits.vocab_size,
                 "the model returned vocab-parallel logits {} for a window of [{}, {}, >= {} / {}]: tensor-parallel "
                 "size {} times the block of {} ids must cover the vocabulary of {}",
                 shape_str(logits), batch, columns, traits.vocab_size, tp_size, tp_size,
                 logits.defined() && logits.dim() == 3 ? logits.size(2) : 0, traits.vocab_size);
  } else {
    VLMGEN_CHECK(columns_ok && logits.size(0) == batch && logits.size(2) >= traits.vocab_size,
                 "the model returned logits {} for a window of [{}, {}, >= {}]{}", shape_str(logits), batch, columns,
                 traits.vocab_size,
                 traits.vocab_parallel_logits
                     ? " (the model's logits are vocab-parallel: give the Generator the model's ParallelContext)"
                     : "");
  }
}

}  // namespace vlmgen::detail
