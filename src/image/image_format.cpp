#include "image_format.h"

#include <array>
#include <string_view>

#include "vlmgen/error.h"
#include "vlmgen/io/json.h"

namespace vlmgen::detail {
namespace {

constexpr uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};

std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t n = 0; n < 256; ++n) {
    uint32_t c = n;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
    table[n] = c;
  }
  return table;
}

uint32_t be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

std::string chunk_type(const uint8_t* p) {
  return quote_excerpt(std::string_view(reinterpret_cast<const char*>(p), 4));
}

ImageHeader read_png(const uint8_t* data, size_t size, const std::string& what) {
  ImageHeader header;
  header.format = ImageFormat::kPng;
  size_t pos = sizeof(kPngSignature);
  for (bool first = true;; first = false) {
    VLMGEN_CHECK(size - pos >= 12,
                 "{}: PNG chunk at byte {} needs 12 bytes of length, type and CRC, {} remain (the "
                 "file ends before IEND)",
                 what, pos, size - pos);
    const uint32_t length = be32(data + pos);
    const uint8_t* type = data + pos + 4;
    VLMGEN_CHECK(length <= 0x7fffffffu && length <= size - pos - 12,
                 "{}: PNG chunk '{}' at byte {} declares {} bytes of data, {} remain in the file", what,
                 chunk_type(type), pos, length, size - pos - 12);
    const uint32_t stored = be32(type + 4 + length);
    const uint32_t computed = crc32(type, 4 + size_t{length});
    VLMGEN_CHECK(stored == computed,
                 "{}: PNG chunk '{}' at byte {} has CRC-32 0x{:08x}, expected 0x{:08x} (the file "
                 "is corrupted)",
                 what, chunk_type(type), pos, stored, computed);
    const std::string_view name(reinterpret_cast<const char*>(type), 4);
    if (first) {
      VLMGEN_CHECK(name == "IHDR" && length == 13,
                   "{}: a PNG must start with a 13-byte IHDR chunk, got '{}' of {} bytes", what, chunk_type(type),
                   length);
      header.width = be32(type + 4);
      header.height = be32(type + 8);
      // The format's own bound; it also keeps width * height inside int64. Found by
      // fuzz/image_fuzzer (UBSan: 4294967295 * 4294967295 overflowed).
      constexpr int64_t kMaxSide = 0x7fffffff;
      VLMGEN_CHECK(header.width > 0 && header.height > 0 && header.width <= kMaxSide && header.height <= kMaxSide,
                   "{}: PNG declares {}x{} pixels (width x height), expected each side in [1, 2^31 - 1]", what,
                   header.width, header.height);
    }
    if (name == "IEND") return header;
    pos += 12 + size_t{length};
  }
}

}  // namespace

uint32_t crc32(const uint8_t* data, size_t size, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_crc_table();
  crc = ~crc;
  for (size_t i = 0; i < size; ++i) crc = table[(crc ^ data[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

ImageHeader read_image_header(const uint8_t* data, size_t size, const ImageLimits& limits, const std::string& what) {
  if (size >= sizeof(kPngSignature) && std::equal(kPngSignature, kPngSignature + 8, data)) {
    return read_png(data, size, what);
  }
  if (size >= 3 && data[0] == 0xff && data[1] == 0xd8 && data[2] == 0xff) {
    return read_jpeg_header(data, size, limits, what);
  }
  VLMGEN_FAIL("cannot decode {}: not a PNG or JPEG file ({} bytes starting with '{}')", what, size,
              quote_excerpt(std::string_view(reinterpret_cast<const char*>(data), size), 16));
}

}  // namespace vlmgen::detail
