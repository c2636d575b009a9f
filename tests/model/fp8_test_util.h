#pragma once

// Helpers shared by the FP8 tests (fp8_test.cpp, fp8_checkpoint_test.cpp): the E4M3 byte format
// written out from its definition, to check the library's decoding and quantizing against.

#include <cmath>
#include <limits>

namespace vlmgen::fp8_test {

// E4M3 (float8_e4m3fn): bias 7, 3 mantissa bits, no infinities, S.1111.111 NaN.
inline double e4m3_definition(int b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  double v;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) {
    v = std::ldexp(m / 8.0, 1 - 7);
  } else {
    v = std::ldexp(1.0 + m / 8.0, e - 7);
  }
  return s ? -v : v;
}

}  // namespace vlmgen::fp8_test
