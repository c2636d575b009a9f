#pragma once

// Container checks run on untrusted PNG/JPEG bytes before stb decodes them (private).

#include <cstddef>
#include <cstdint>
#include <string>

#include "vlmgen/image/image.h"

namespace vlmgen::detail {

enum class ImageFormat { kPng, kJpeg };

/// What the container declares, read without decoding any pixel data.
struct ImageHeader {
  ImageFormat format = ImageFormat::kPng;
  int64_t width = 0;
  int64_t height = 0;
  int64_t jpeg_scans = 0;  // SOS segments (JPEG only)
};

/// CRC-32 (ISO 3309 / ITU-T V.42, as PNG uses it) of `size` bytes, continuing from `crc`.
uint32_t crc32(const uint8_t* data, size_t size, uint32_t crc = 0);

/// The JPEG part of read_image_header (jpeg_header.cpp); `data` starts with SOI.
ImageHeader read_jpeg_header(const uint8_t* data, size_t size, const ImageLimits& limits, const std::string& what);

/// Walks the container: a PNG chunk by chunk (lengths inside the file, IHDR first, a correct
/// CRC-32 on every chunk, IEND present), a JPEG marker by marker (segments inside the file, a
/// frame header with a non-zero size, Huffman tables of at most 256 codes, every table a scan
/// uses defined before it, at most limits.max_jpeg_scans() scans; see jpeg_header.cpp). Throws
/// vlmgen::Error naming `what` when the bytes are neither, or break a rule; the pixel limit is
/// the caller's to check.
ImageHeader read_image_header(const uint8_t* data, size_t size, const ImageLimits& limits, const std::string& what);

}  // namespace vlmgen::detail
