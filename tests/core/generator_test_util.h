#pragma once

// Helpers shared by the generator tests (generator_test.cpp, generator_decoding_test.cpp).

#include <cstddef>
#include <cstdint>
#include <vector>

#include "vlmgen/generator.h"

namespace vlmgen::generator_test {

constexpr int64_t kImage = 63;

inline std::vector<int64_t> tokens_of(const GenerationResult& r, size_t row = 0) { return r.sequences.at(row).tokens; }

}  // namespace vlmgen::generator_test
