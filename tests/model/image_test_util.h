#pragma once

// Test images shared by the image-processing tests.

#include <cstdint>
#include <vector>

#include "vlmgen/image/image.h"

namespace vlmgen::image_test {

inline Image make_image(int64_t height, int64_t width, uint8_t (*value)(int64_t c, int64_t y, int64_t x)) {
  Image image{height, width, std::vector<uint8_t>(static_cast<size_t>(height * width * 3))};
  for (int64_t y = 0; y < height; ++y) {
    for (int64_t x = 0; x < width; ++x) {
      for (int64_t c = 0; c < 3; ++c) image.rgb[static_cast<size_t>((y * width + x) * 3 + c)] = value(c, y, x);
    }
  }
  return image;
}

// The input of the Pillow references: pillow_input(h, w)[y, x, c] in their scripts.
inline uint8_t pillow_input_value(int64_t c, int64_t y, int64_t x) {
  return uint8_t((c * 53 + y * 37 + x * 71 + x * y * 5) % 256);
}

}  // namespace vlmgen::image_test
