#pragma once

// Overflow-checked arithmetic for counts derived from user numbers (grids, sizes, lengths): a
// product that wraps would turn a hostile input into a small, plausible count.

#include <cstdint>

#include "vlmgen/error.h"

namespace vlmgen::detail {

/// a * b, or vlmgen::Error naming `what` when the product does not fit in int64.
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  VLMGEN_CHECK(!__builtin_mul_overflow(a, b, &out), "{}: {} * {} overflows a 64-bit count", what, a, b);
  return out;
}

/// a + b, or vlmgen::Error naming `what` when the sum does not fit in int64.
inline int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  VLMGEN_CHECK(!__builtin_add_overflow(a, b, &out), "{}: {} + {} overflows a 64-bit count", what, a, b);
  return out;
}

}  // namespace vlmgen::detail
