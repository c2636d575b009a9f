// libFuzzer target: PNG/JPEG bytes through the decoder and the Qwen2-VL preprocessor. The
// limits are lower than the defaults so that each input stays fast; the checks are the same.
//
// decode_image refuses a PNG whose chunk CRCs are wrong, which would stop almost every mutation
// at the first chunk; so each PNG input is decoded twice: as it came (exercising the CRC check)
// and with every CRC recomputed (exercising the decoder behind it).

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vlmgen/error.h"
#include "vlmgen/image/qwen_image_processor.h"

namespace {

uint32_t crc32(const uint8_t* data, size_t size) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  uint32_t crc = 0xffffffffu;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ data[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

// A copy with the CRC of every complete chunk recomputed.
std::vector<uint8_t> with_png_crcs_repaired(const uint8_t* data, size_t size) {
  std::vector<uint8_t> out(data, data + size);
  size_t pos = 8;
  while (size - pos >= 12) {
    const uint32_t length = (uint32_t{out[pos]} << 24) | (uint32_t{out[pos + 1]} << 16) |
                            (uint32_t{out[pos + 2]} << 8) | uint32_t{out[pos + 3]};
    if (length > size - pos - 12) break;
    const uint32_t crc = crc32(&out[pos + 4], 4 + size_t{length});
    for (int i = 0; i < 4; ++i) out[pos + 8 + length + i] = static_cast<uint8_t>(crc >> (24 - 8 * i));
    pos += 12 + size_t{length};
  }
  return out;
}

void decode_and_preprocess(const uint8_t* data, size_t size) {
  try {
    const vlmgen::Image image =
        vlmgen::decode_image(data, size, vlmgen::ImageLimits().max_pixels(1 << 20).max_jpeg_scans(16));
    const auto options =
        vlmgen::QwenImageProcessorOptions().patch_size(4).merge_size(2).min_pixels(64).max_pixels(64 * 64);
    (void)vlmgen::preprocess({image}, options);
  } catch (const vlmgen::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  decode_and_preprocess(data, size);
  if (size >= 8 && data[0] == 0x89 && std::memcmp(data + 1, "PNG", 3) == 0) {
    const std::vector<uint8_t> repaired = with_png_crcs_repaired(data, size);
    decode_and_preprocess(repaired.data(), repaired.size());
  }
  return 0;
}
