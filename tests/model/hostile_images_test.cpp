// Image files a stranger could hand vlmgen: corrupted PNG chunks, headers that declare billions
// of pixels, compressed data that inflates far beyond its image, JPEGs with thousands of scans or
// Huffman tables that overrun the decoder. Each must be refused, before decoding where the
// header tells, with a vlmgen::Error naming what was expected and what came.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "hostile_test_util.h"
#include "stb_write_for_tests.h"
#include "vlmgen/error.h"
#include "vlmgen/image/gemma3_image_processor.h"
#include "vlmgen/image/qwen_image_processor.h"

namespace vlmgen {
namespace {

using hostile_test::error_of;
using hostile_test::error_within;
using hostile_test::read_bytes;
using hostile_test::seconds_since;
using hostile_test::TempDir;
using hostile_test::write_bytes;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

std::string decode_error(const std::string& bytes, const ImageLimits& limits = ImageLimits()) {
  return error_of([&] { decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), limits); });
}

// An independent CRC-32 (bitwise, no table) to build test files with.
uint32_t crc32(const std::string& bytes) {
  uint32_t crc = 0xffffffffu;
  for (unsigned char byte : bytes) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1)));
  }
  return ~crc;
}

std::string be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8), static_cast<char>(v)};
}

std::string png_chunk(const std::string& type, const std::string& data) {
  return be32(static_cast<uint32_t>(data.size())) + type + data + be32(crc32(type + data));
}

// An 8-bit RGB PNG of the given declared size around `idat` (a zlib stream), CRCs correct.
std::string png_file(uint32_t width, uint32_t height, const std::string& idat) {
  const std::string ihdr = be32(width) + be32(height) + std::string{8, 2, 0, 0, 0};
  return std::string("\x89PNG\r\n\x1a\n", 8) + png_chunk("IHDR", ihdr) + png_chunk("IDAT", idat) +
         png_chunk("IEND", "");
}

std::string zlib(const std::string& raw) {
  int length = 0;
  unsigned char* data = stbi_zlib_compress(reinterpret_cast<unsigned char*>(const_cast<char*>(raw.data())),
                                           static_cast<int>(raw.size()), &length, 8);
  std::string out(reinterpret_cast<char*>(data), static_cast<size_t>(length));
  STBIW_FREE(data);
  return out;
}

Image gradient(int64_t height, int64_t width) {
  Image image{height, width, std::vector<uint8_t>(static_cast<size_t>(height * width * 3))};
  for (size_t i = 0; i < image.rgb.size(); ++i) image.rgb[i] = static_cast<uint8_t>(i * 7 % 256);
  return image;
}

void append_bytes(void* context, void* data, int size) {
  static_cast<std::string*>(context)->append(static_cast<const char*>(data), static_cast<size_t>(size));
}

std::string jpeg_bytes(const Image& image) {
  std::string out;
  stbi_write_jpg_to_func(append_bytes, &out, static_cast<int>(image.width), static_cast<int>(image.height), 3,
                         image.rgb.data(), 90);
  return out;
}

// ---- PNG ----

TEST(HostileImages, PngWithAWrongChunkCrcIsRefusedNamingTheChunk) {
  TempDir dir;
  save_png(dir / "a.png", gradient(16, 16));
  const std::string good = read_bytes(dir / "a.png");
  ASSERT_EQ(decode_error(good), "<no error>");
  std::string bad = good;
  const size_t idat = bad.find("IDAT");
  bad[idat + 6] = static_cast<char>(bad[idat + 6] ^ 0x10);  // a data byte: stb would decode it silently
  EXPECT_THAT(decode_error(bad), AllOf(HasSubstr("'IDAT'"), HasSubstr("CRC-32"), HasSubstr("expected 0x")));
  bad = good;
  bad[8 + 8 + 13] = static_cast<char>(bad[8 + 8 + 13] ^ 1);  // IHDR's stored CRC
  EXPECT_THAT(decode_error(bad), AllOf(HasSubstr("'IHDR'"), HasSubstr("CRC-32")));
  EXPECT_THAT(decode_error(good.substr(0, good.size() - 12)), HasSubstr("before IEND"));
  write_bytes(dir / "bad.png", bad);
  EXPECT_THAT(error_of([&] { load_image(dir / "bad.png"); }), AllOf(HasSubstr(dir / "bad.png"), HasSubstr("CRC")));
}

TEST(HostileImages, PngDeclaring100000x100000IsRefusedBeforeDecoding) {
  const std::string file = png_file(100000, 100000, zlib(std::string(1000, '\0')));
  const auto start = Clock::now();
  EXPECT_THAT(decode_error(file), AllOf(HasSubstr("100000x100000"), HasSubstr("10000000000"),
                                        HasSubstr("limit of 67108864"), HasSubstr("ImageLimits::max_pixels")));
  EXPECT_LT(seconds_since(start), 0.5);
  // Just above the default: stb alone would decode it (a 200 MB allocation).
  EXPECT_THAT(decode_error(png_file(8193, 8192, "")), HasSubstr("limit of 67108864"));
}

TEST(HostileImages, PngSidesAbove2To31AreRefused) {
  // Found by fuzz/image_fuzzer: 4294967295 x 4294967295 overflowed int64 when multiplied.
  const std::string found = read_bytes(std::string(VLMGEN_SOURCE_DIR) + "/fuzz/regressions/png_sides_2to32.png");
  ASSERT_FALSE(found.empty());
  EXPECT_THAT(decode_error(found), AllOf(HasSubstr("4294967295x4294967295"), HasSubstr("[1, 2^31 - 1]")));
  EXPECT_THAT(decode_error(png_file(0x80000000u, 1, "")), HasSubstr("[1, 2^31 - 1]"));
  // The largest legal sides with no pixel limit at all reach the decoder, which refuses them.
  const std::string largest = png_file(0x7fffffff, 0x7fffffff, zlib(std::string(16, '\0')));
  EXPECT_THAT(decode_error(largest, ImageLimits().max_pixels(std::numeric_limits<int64_t>::max())),
              HasSubstr("cannot decode"));
}

TEST(HostileImages, PixelLimitIsConfigurable) {
  TempDir dir;
  save_png(dir / "a.png", gradient(16, 16));
  const std::string bytes = read_bytes(dir / "a.png");
  EXPECT_THAT(decode_error(bytes, ImageLimits().max_pixels(255)), HasSubstr("= 256, above the limit of 255"));
  EXPECT_EQ(decode_error(bytes, ImageLimits().max_pixels(256)), "<no error>");
  EXPECT_THAT(error_of([&] { load_image(dir / "a.png", ImageLimits().max_file_bytes(10)); }),
              AllOf(HasSubstr("above the limit of 10 bytes")));
}

TEST(HostileImages, PngThatInflatesFarBeyondItsDeclaredSizeIsRefused) {
  // A 1x1 image whose compressed data inflates to 8 MB: stb grows its buffer to hold all of it
  // (without a bound, gigabytes for a bigger bomb) and then decodes the first pixel.
  const std::string file = png_file(1, 1, zlib(std::string(8 << 20, '\0')));
  ASSERT_LT(file.size(), 200000u);
  EXPECT_THAT(decode_error(file), AllOf(HasSubstr("cannot decode"), HasSubstr("1x1 declared"), HasSubstr("outofmem")));
  // The same image with the right amount of data decodes.
  EXPECT_EQ(decode_error(png_file(1, 1, zlib(std::string(4, '\0')))), "<no error>");
}

// ---- JPEG ----

TEST(HostileImages, JpegDeclaringHugeSizeIsRefusedBeforeDecoding) {
  std::string bytes = jpeg_bytes(gradient(8, 8));
  const size_t sof = bytes.find("\xff\xc0");
  ASSERT_NE(sof, std::string::npos);
  for (size_t i : {sof + 5, sof + 7}) {  // height, width: 60000 each
    bytes[i] = static_cast<char>(60000 >> 8);
    bytes[i + 1] = static_cast<char>(60000 & 0xff);
  }
  const auto start = Clock::now();
  EXPECT_THAT(decode_error(bytes), AllOf(HasSubstr("60000x60000"), HasSubstr("limit of 67108864")));
  EXPECT_LT(seconds_since(start), 0.5);
}

TEST(HostileImages, JpegWithMoreScansThanTheLimitIsRefused) {
  const std::string good = jpeg_bytes(gradient(16, 16));
  ASSERT_EQ(decode_error(good), "<no error>");
  const size_t sos = good.find("\xff\xda");
  const size_t eoi = good.rfind("\xff\xd9");
  ASSERT_LT(sos, eoi);
  std::string many = good.substr(0, eoi);
  for (int i = 0; i < 70; ++i) many += good.substr(sos, eoi - sos);
  many += "\xff\xd9";
  EXPECT_THAT(decode_error(many), AllOf(HasSubstr("more than 64 scans"), HasSubstr("max_jpeg_scans")));
  EXPECT_THAT(decode_error(many, ImageLimits().max_jpeg_scans(100)), Not(HasSubstr("scans")));
}

TEST(HostileImages, JpegHuffmanTableWithMoreThan256CodesIsRefused) {
  // Found by fuzz/image_fuzzer: stb_image 2.27 writes past its Huffman tables (UBSan: index 257
  // out of bounds), over its other tables. Kept as fuzz/regressions/jpeg_huffman_overflow.jpg.
  const std::string found = read_bytes(std::string(VLMGEN_SOURCE_DIR) + "/fuzz/regressions/jpeg_huffman_overflow.jpg");
  ASSERT_FALSE(found.empty());
  EXPECT_THAT(decode_error(found), AllOf(HasSubstr("Huffman table"), HasSubstr("expected at most 256")));
  // The same defect made by hand: the first table's first code count raised to 255.
  std::string bytes = jpeg_bytes(gradient(8, 8));
  const size_t dht = bytes.find("\xff\xc4");
  ASSERT_NE(dht, std::string::npos);
  bytes[dht + 5] = static_cast<char>(255);
  EXPECT_THAT(decode_error(bytes), AllOf(HasSubstr("Huffman table"), HasSubstr("at most 256")));
}

TEST(HostileImages, JpegScanWithAnUndefinedTableIsRefused) {
  // Found by fuzz/image_fuzzer: a progressive scan decoding with an AC table no DHT defined;
  // stb 2.27 reads its uninitialised table (UBSan: index 2097151996 out of bounds).
  const std::string found =
      read_bytes(std::string(VLMGEN_SOURCE_DIR) + "/fuzz/regressions/jpeg_undefined_huffman_table.jpg");
  ASSERT_FALSE(found.empty());
  EXPECT_THAT(decode_error(found), AllOf(HasSubstr("Huffman table AC 1"), HasSubstr("no segment before it defined")));
  // The same by hand on a baseline file (stb writes DC/AC tables 0 and 1, quantization 0 and 1).
  const std::string good = jpeg_bytes(gradient(8, 8));
  std::string bytes = good;
  const size_t sos = bytes.find("\xff\xda");
  bytes[sos + 6] = 0x22;  // first component: DC 2, AC 2
  EXPECT_THAT(decode_error(bytes), AllOf(HasSubstr("scan 1"), HasSubstr("Huffman table DC 2")));
  bytes = good;
  const size_t sof = bytes.find("\xff\xc0");
  bytes[sof + 12] = 2;  // first component's quantization table
  EXPECT_THAT(decode_error(bytes), HasSubstr("quantization table 2, which no segment before it defined"));
}

TEST(HostileImages, TruncatedJpegSegmentIsRefused) {
  const std::string good = jpeg_bytes(gradient(8, 8));
  const size_t dht = good.find("\xff\xc4");
  EXPECT_THAT(decode_error(good.substr(0, dht + 10)), AllOf(HasSubstr("segment"), HasSubstr("remain")));
  EXPECT_THAT(decode_error("\xff\xd8\xff\xd9"), HasSubstr("no frame header"));
}

TEST(HostileImages, TheChecksAcceptEveryValidSeedFile) {
  // Palette + tRNS, 16-bit RGBA, 1-bit gray and Adam7-interlaced PNGs; baseline, progressive and
  // restart-marker JPEGs: the container checks must not refuse what stb decodes correctly.
  const std::filesystem::path corpus = std::filesystem::path(VLMGEN_SOURCE_DIR) / "fuzz" / "corpus" / "image";
  int checked = 0;
  for (const auto& entry : std::filesystem::directory_iterator(corpus)) {
    if (entry.path().filename().string().rfind("regression_", 0) == 0) continue;  // fuzz findings
    EXPECT_EQ(error_of([&] { load_image(entry.path().string()); }), "<no error>") << entry.path();
    ++checked;
  }
  EXPECT_GE(checked, 12);
}

// ---- files and the preprocessor ----

TEST(HostileImages, FifoAndDeviceImagesAreRefusedWithoutBlocking) {
  TempDir dir;
  ASSERT_EQ(::mkfifo((dir / "a.png").c_str(), 0600), 0);
  EXPECT_THAT(error_within(std::chrono::milliseconds(1000), dir / "a.png", [&] { load_image(dir / "a.png"); }),
              AllOf(HasSubstr("a.png"), HasSubstr("got a FIFO")));
  EXPECT_THAT(error_of([] { load_image("/dev/zero"); }), HasSubstr("got a character device"));
}

TEST(HostileImages, ATallNarrowImageIsRefusedBeforeItsWidenedCopyIsMade) {
  // 4 x 4,194,304 (16 Mi pixels, within the decode limit): widened to 896 first, as Pillow
  // resizes, it would pass through 3.8 G pixels (11 GB). Gemma-3 and LLaVA-NeXT have no aspect
  // limit of their own (Qwen's smart_resize refuses ratios above 200).
  Image tall{int64_t{1} << 22, 4, std::vector<uint8_t>(size_t{3} << 24, 128)};
  const auto start = Clock::now();
  EXPECT_THAT(error_of([&] { preprocess_gemma3({tall}, Gemma3ImageProcessorOptions()); }),
              AllOf(HasSubstr("4194304x4 (height x width)"), HasSubstr("too tall for its width")));
  EXPECT_THAT(error_of([&] { resize_bicubic(tall, 896, 896); }), HasSubstr("passes through 4194304x896 pixels"));
  EXPECT_LT(seconds_since(start), 2.0);
  // A tall picture within the bound resizes.
  const Image ok{20000, 4, std::vector<uint8_t>(size_t{3} * 80000, 7)};
  EXPECT_EQ(resize_bilinear(ok, 896, 896).rgb.size(), size_t{3} * 896 * 896);
}

TEST(HostileImages, PreprocessorSettingsAndResizedSizesAreBounded) {
  const Image image = gradient(28, 28);
  EXPECT_THAT(error_of([&] { preprocess({image}, QwenImageProcessorOptions().patch_size(4096)); }),
              AllOf(HasSubstr("patch_size 4096 * merge_size 2"), HasSubstr("4096")));
  EXPECT_THAT(error_of([&] { preprocess({image}, QwenImageProcessorOptions().max_pixels(int64_t{1} << 27)); }),
              AllOf(HasSubstr("max_pixels 134217728"), HasSubstr("limit of 67108864")));
  EXPECT_THAT(error_of([&] { preprocess({image}, QwenImageProcessorOptions().temporal_patch_size(65)); }),
              HasSubstr("temporal_patch_size must be in [1, 64], got 65"));
  // min = max = 2^26 pixels at 4 frames each (rounding up overshoots max_pixels, as in HF):
  // refused before anything is resampled.
  const auto options =
      QwenImageProcessorOptions().temporal_patch_size(4).min_pixels(int64_t{1} << 26).max_pixels(int64_t{1} << 26);
  const auto start = Clock::now();
  EXPECT_THAT(error_of([&] { preprocess({image}, options); }),
              AllOf(HasSubstr("image 0"), HasSubstr("8204x8204"), HasSubstr("x 4 frames"), HasSubstr("134217728")));
  EXPECT_LT(seconds_since(start), 0.5);
  // Sides whose products would overflow int64.
  EXPECT_THAT(error_of([] { smart_resize(int64_t{1} << 40, int64_t{1} << 40); }),
              AllOf(HasSubstr("1099511627776x1099511627776"), HasSubstr("limit of 16777216")));
}

}  // namespace
}  // namespace vlmgen
