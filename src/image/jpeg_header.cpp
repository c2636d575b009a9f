// The JPEG container walk that runs before stb_image decodes a file. stb_image 2.27 (Debian 12's)
// trusts parts of the file that a hostile one gets wrong, so this walk refuses them first:
//
// - A Huffman table (DHT) whose 16 code counts add up to more than 256: stb writes past its
//   257-byte size list and 256-byte value list, over the decoder's other tables (up to 4 KB of
//   writes the file controls). Found by fuzz/image_fuzzer (UBSan: index 257 out of bounds).
// - A scan that uses a Huffman or quantization table no earlier segment defined: stb allocates
//   its decoder state without clearing it, decodes with whatever the heap held, and indexes its
//   tables with symbols computed from it (UBSan: index 2097151996 out of bounds; without the
//   sanitizer a read far outside the allocation, or heap contents leaking into the pixels).
// - A segment cut short by the end of the file: stb reads zeros in its place.
// - More scans than ImageLimits::max_jpeg_scans: each is a pass over the whole image.
// Later stb versions check the first two themselves. Markers are found the way stb finds them
// (bytes between segments are skipped up to the next 0xFF), so every segment stb would act on is
// seen here, in the same order.

#include <algorithm>
#include <array>
#include <vector>

#include "image_format.h"
#include "vlmgen/error.h"

namespace vlmgen::detail {
namespace {

uint32_t be16(const uint8_t* p) { return (uint32_t{p[0]} << 8) | uint32_t{p[1]}; }

// Which tables the segments so far have defined (ids 0-3 each).
struct DefinedTables {
  std::array<bool, 4> dc{};
  std::array<bool, 4> ac{};
  std::array<bool, 4> quant{};
};

struct Frame {
  bool present = false;
  bool progressive = false;
  std::vector<std::array<int, 2>> components;  // (component id, quantization table)
};

bool is_frame_header(uint8_t marker) {
  // SOF0..SOF15, except DHT (C4), JPG (C8) and DAC (CC) which share the range.
  return marker >= 0xc0 && marker <= 0xcf && marker != 0xc4 && marker != 0xc8 && marker != 0xcc;
}

void read_huffman_tables(const uint8_t* segment, size_t length, DefinedTables& tables, const std::string& what) {
  size_t off = 2;  // after the length field
  while (off < length) {
    VLMGEN_CHECK(length - off >= 17, "{}: JPEG Huffman table at segment byte {} needs 17 bytes, {} remain", what, off,
                 length - off);
    const int table_class = segment[off] >> 4;
    const int table_id = segment[off] & 15;
    VLMGEN_CHECK(table_class <= 1 && table_id <= 3, "{}: JPEG Huffman table class {} id {}, expected class 0-1, id 0-3",
                 what, table_class, table_id);
    size_t codes = 0;
    for (size_t i = 1; i <= 16; ++i) codes += segment[off + i];
    VLMGEN_CHECK(codes <= 256, "{}: JPEG Huffman table (class {}, id {}) declares {} codes, expected at most 256", what,
                 table_class, table_id, codes);
    VLMGEN_CHECK(codes <= length - off - 17,
                 "{}: JPEG Huffman table declares {} codes, its segment holds {} more bytes", what, codes,
                 length - off - 17);
    (table_class == 0 ? tables.dc : tables.ac)[static_cast<size_t>(table_id)] = true;
    off += 17 + codes;
  }
}

void read_quantization_tables(const uint8_t* segment, size_t length, DefinedTables& tables, const std::string& what) {
  size_t off = 2;
  while (off < length) {
    const int precision = segment[off] >> 4;
    const int table_id = segment[off] & 15;
    VLMGEN_CHECK(precision <= 1 && table_id <= 3,
                 "{}: JPEG quantization table precision {} id {}, expected precision 0-1, id 0-3", what, precision,
                 table_id);
    const size_t bytes = precision == 0 ? 65 : 129;
    VLMGEN_CHECK(bytes <= length - off, "{}: JPEG quantization table {} needs {} bytes, its segment holds {}", what,
                 table_id, bytes, length - off);
    tables.quant[static_cast<size_t>(table_id)] = true;
    off += bytes;
  }
}

void read_frame(uint8_t marker, const uint8_t* segment, size_t length, Frame& frame, ImageHeader& header,
                const std::string& what) {
  VLMGEN_CHECK(length >= 8, "{}: JPEG frame header of {} bytes, expected at least 8", what, length);
  header.height = be16(segment + 3);
  header.width = be16(segment + 5);
  VLMGEN_CHECK(header.width > 0 && header.height > 0,
               "{}: JPEG declares {}x{} pixels (width x height), expected both positive", what, header.width,
               header.height);
  const size_t count = segment[7];
  VLMGEN_CHECK(length == 8 + 3 * count, "{}: JPEG frame header of {} bytes for {} components, expected {}", what,
               length, count, 8 + 3 * count);
  for (size_t i = 0; i < count; ++i) {
    const uint8_t* c = segment + 8 + 3 * i;
    VLMGEN_CHECK(c[2] <= 3, "{}: JPEG component {} uses quantization table {}, expected 0-3", what, c[0], c[2]);
    frame.components.push_back({c[0], c[2]});
  }
  frame.progressive = marker == 0xc2;
  frame.present = true;
}

// The tables a scan decodes with must exist by now: baseline scans use each component's DC and
// AC tables; progressive first DC scans (Ss = 0, Ah = 0) the DC tables, progressive AC scans
// (Ss > 0) the AC tables, and DC refinement scans none.
void check_scan(const uint8_t* segment, size_t length, const Frame& frame, const DefinedTables& tables, int64_t scan,
                const std::string& what) {
  VLMGEN_CHECK(frame.present, "{}: JPEG scan {} comes before the frame header (SOF)", what, scan);
  const size_t count = length >= 3 ? segment[2] : 0;
  VLMGEN_CHECK(count >= 1 && length == 6 + 2 * count, "{}: JPEG scan {} header of {} bytes for {} components", what,
               scan, length, count);
  const int spectral_start = segment[3 + 2 * count];
  const int approximation_high = segment[5 + 2 * count] >> 4;
  const bool uses_dc = !frame.progressive || (spectral_start == 0 && approximation_high == 0);
  const bool uses_ac = !frame.progressive || spectral_start > 0;
  for (size_t i = 0; i < count; ++i) {
    const int id = segment[3 + 2 * i];
    const size_t dc = segment[4 + 2 * i] >> 4;
    const size_t ac = segment[4 + 2 * i] & 15;
    const auto it = std::find_if(frame.components.begin(), frame.components.end(),
                                 [&](const std::array<int, 2>& c) { return c[0] == id; });
    VLMGEN_CHECK(it != frame.components.end(), "{}: JPEG scan {} names component {}, which the frame does not have",
                 what, scan, id);
    VLMGEN_CHECK(tables.quant[static_cast<size_t>((*it)[1])],
                 "{}: JPEG scan {} decodes component {} with quantization table {}, which no segment before it defined",
                 what, scan, id, (*it)[1]);
    VLMGEN_CHECK(dc <= 3 && ac <= 3, "{}: JPEG scan {} selects Huffman tables DC {} / AC {}, expected ids 0-3", what,
                 scan, dc, ac);
    VLMGEN_CHECK(!uses_dc || tables.dc[dc],
                 "{}: JPEG scan {} decodes component {} with Huffman table DC {}, which no segment before it defined",
                 what, scan, id, dc);
    VLMGEN_CHECK(!uses_ac || tables.ac[ac],
                 "{}: JPEG scan {} decodes component {} with Huffman table AC {}, which no segment before it defined",
                 what, scan, id, ac);
  }
}

// Skips entropy-coded data: it ends at the first 0xFF that is neither a stuffed 0xFF00 nor a
// restart marker, as in the decoder.
size_t skip_entropy_coded(const uint8_t* data, size_t size, size_t pos) {
  while (pos + 1 < size) {
    if (data[pos] == 0xff && data[pos + 1] != 0 && !(data[pos + 1] >= 0xd0 && data[pos + 1] <= 0xd7)) break;
    ++pos;
  }
  return pos;
}

}  // namespace

ImageHeader read_jpeg_header(const uint8_t* data, size_t size, const ImageLimits& limits, const std::string& what) {
  ImageHeader header;
  header.format = ImageFormat::kJpeg;
  DefinedTables tables;
  Frame frame;
  size_t pos = 2;
  while (true) {
    while (pos < size && data[pos] != 0xff) ++pos;
    while (pos < size && data[pos] == 0xff) ++pos;
    if (pos >= size) break;
    const uint8_t marker = data[pos++];
    if (marker == 0xd9) break;                                                             // EOI
    if (marker == 0x00 || marker == 0x01 || (marker >= 0xd0 && marker <= 0xd8)) continue;  // no length
    VLMGEN_CHECK(size - pos >= 2, "{}: JPEG ends inside marker 0x{:02x} at byte {}", what, marker, pos - 1);
    const size_t length = be16(data + pos);
    VLMGEN_CHECK(length >= 2 && length <= size - pos,
                 "{}: JPEG marker 0x{:02x} at byte {} declares a {}-byte segment, {} bytes remain", what, marker,
                 pos - 1, length, size - pos);
    const uint8_t* segment = data + pos;
    if (is_frame_header(marker) && !frame.present) read_frame(marker, segment, length, frame, header, what);
    if (marker == 0xc4) read_huffman_tables(segment, length, tables, what);
    if (marker == 0xdb) read_quantization_tables(segment, length, tables, what);
    pos += length;
    if (marker == 0xda) {
      ++header.jpeg_scans;
      VLMGEN_CHECK(header.jpeg_scans <= limits.max_jpeg_scans(),
                   "{}: JPEG has more than {} scans (ImageLimits::max_jpeg_scans); each scan is a pass over the image",
                   what, limits.max_jpeg_scans());
      check_scan(segment, length, frame, tables, header.jpeg_scans, what);
      pos = skip_entropy_coded(data, size, pos);
    }
  }
  VLMGEN_CHECK(frame.present, "{}: JPEG has no frame header (SOF) giving its size", what);
  return header;
}

}  // namespace vlmgen::detail
