#pragma once

// Strict reads of preprocessor_config.json fields (Qwen-VL's and Gemma-3's processors): integers
// only where the processor counts, in the int64 range; finite numbers; lists of exactly three; and
// the pixel normalization checked as it is computed, in float32. A field of another type or shape
// is a vlmgen::Error naming it, never a silent conversion (4.9 read as 4, a fourth image_std entry
// dropped, 1e300 cast to an integer). Private to src/image.

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "../io/json_parse.h"
#include "vlmgen/error.h"

namespace vlmgen::detail {

/// An integer field (`what`: the file, `key`: the field) within the int64 range; a float with no
/// fraction (14.0, as a hand-edited file may hold it, and Python reads it) counts as one.
inline int64_t config_int(const nlohmann::json& v, const std::string& what, const std::string& key) {
  if (v.is_number_float()) {
    const double d = v.get<double>();
    VLMGEN_CHECK(std::isfinite(d) && d == std::floor(d) && std::abs(d) < 9.2e18,
                 "{}: {} is {}; expected an integer within the int64 range", what, key, json_excerpt(v));
    return static_cast<int64_t>(d);
  }
  VLMGEN_CHECK(v.is_number_integer() &&
                   (!v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()}),
               "{}: {} is {}; expected an integer within the int64 range", what, key, json_excerpt(v));
  return v.get<int64_t>();
}

/// A finite number.
inline double config_number(const nlohmann::json& v, const std::string& what, const std::string& key) {
  VLMGEN_CHECK(v.is_number() && std::isfinite(v.get<double>()), "{}: {} is {}; expected a finite number", what, key,
               json_excerpt(v));
  return v.get<double>();
}

/// A list of exactly three finite numbers (one per RGB channel).
inline std::array<double, 3> config_triple(const nlohmann::json& v, const std::string& what, const std::string& key) {
  VLMGEN_CHECK(v.is_array() && v.size() == 3, "{}: {} is {}; expected a list of 3 numbers (one per channel)", what, key,
               json_excerpt(v));
  std::array<double, 3> out{};
  for (size_t c = 0; c < 3; ++c) out[c] = config_number(v[c], what, fmt::format("{}[{}]", key, c));
  return out;
}

/// Whether (p * rescale - mean[c]) / std[c] is a finite float32, std[c] a non-zero float32, for
/// every channel and pixel value p in [0, 255]: the normalization as the processors compute it.
inline void check_normalization(const std::array<double, 3>& mean, const std::array<double, 3>& std, double rescale,
                                const std::string& what) {
  const auto finite_float = [](double x) {
    return std::isfinite(x) && std::abs(x) <= static_cast<double>(std::numeric_limits<float>::max());
  };
  VLMGEN_CHECK(finite_float(rescale), "{}: rescale factor {} is not a finite float32", what, rescale);
  for (size_t c = 0; c < 3; ++c) {
    VLMGEN_CHECK(finite_float(mean[c]) && finite_float(std[c]) && static_cast<float>(std[c]) != 0.0f,
                 "{}: image_mean[{}] {} and image_std[{}] {} must be finite float32 numbers, the std non-zero", what, c,
                 mean[c], c, std[c]);
    const double low = (0.0 - mean[c]) / std[c], high = (255.0 * rescale - mean[c]) / std[c];
    VLMGEN_CHECK(finite_float(low) && finite_float(high),
                 "{}: channel {} normalizes pixels to [{}, {}] (rescale {}, mean {}, std {}); expected finite float32 "
                 "values",
                 what, c, low, high, rescale, mean[c], std[c]);
  }
}

}  // namespace vlmgen::detail
