#pragma once

// Images in memory and on disk: decoding PNG/JPEG bytes that may come from a stranger, and
// writing PNG.
//
//   vlmgen::Image image = vlmgen::load_image("beach.jpg");
//   vlmgen::Image small = vlmgen::decode_image(bytes.data(), bytes.size(),
//                                              vlmgen::ImageLimits().max_pixels(4 << 20));

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace vlmgen {

/// An 8-bit RGB image. Channel c of the pixel at row y, column x is
/// `rgb[(y * width + x) * 3 + c]` (HWC, rows top to bottom).
struct Image {
  int64_t height = 0;
  int64_t width = 0;
  std::vector<uint8_t> rgb;  // [height * width * 3]
};

/// Largest image decode_image and load_image accept by default: 2^26 pixels (64 Mi, 8192 x
/// 8192), five times the largest input Qwen2-VL's processor keeps (12.8 M pixels).
inline constexpr int64_t kDefaultMaxImagePixels = int64_t{1} << 26;

/// What an image file may cost before it is decoded. Every limit is checked on the file's
/// header, so a small file that declares a huge image is refused without decoding it.
class ImageLimits {
 public:
  /// Largest width * height. Default kDefaultMaxImagePixels.
  ImageLimits& max_pixels(int64_t value) {
    max_pixels_ = value;
    return *this;
  }
  int64_t max_pixels() const { return max_pixels_; }

  /// Largest file in bytes (at most 2^31 - 1, the decoder's limit). Default 256 MiB.
  ImageLimits& max_file_bytes(int64_t value) {
    max_file_bytes_ = value;
    return *this;
  }
  int64_t max_file_bytes() const { return max_file_bytes_; }

  /// Most scans in a (progressive) JPEG: each scan is a pass over the whole image, so a small
  /// file with thousands of scans would keep the decoder busy for minutes. Encoders write at
  /// most a dozen or so. Default 64.
  ImageLimits& max_jpeg_scans(int64_t value) {
    max_jpeg_scans_ = value;
    return *this;
  }
  int64_t max_jpeg_scans() const { return max_jpeg_scans_; }

 private:
  int64_t max_pixels_ = kDefaultMaxImagePixels;
  int64_t max_file_bytes_ = int64_t{256} << 20;
  int64_t max_jpeg_scans_ = 64;
};

/// Decodes PNG or JPEG bytes into RGB: grayscale is replicated to three channels and an alpha
/// channel is dropped (as PIL's `convert("RGB")` does). EXIF orientation is not applied.
/// Before decoding, the container is checked: a PNG must be well-formed chunk by chunk with a
/// correct CRC-32 on every chunk (the decoder itself ignores CRCs, so a corrupted file would
/// give wrong pixels silently), a JPEG must have a frame header and at most
/// limits.max_jpeg_scans() scans, and the declared width * height must not exceed
/// limits.max_pixels(). The decoder's allocations are bounded by the declared size too (a PNG
/// whose compressed data inflates beyond it fails instead of allocating gigabytes).
/// Throws vlmgen::Error naming `what`, what was expected and what came.
Image decode_image(const uint8_t* data, size_t size, const ImageLimits& limits = ImageLimits(),
                   const std::string& what = "image");

/// Reads the image file `path` and decodes it (decode_image). A path that is not a regular
/// file (a FIFO, a directory, a device) is refused without blocking. Throws vlmgen::Error naming
/// `path` when the file cannot be opened, is not a PNG/JPEG image, has no pixels, or exceeds a
/// limit.
Image load_image(const std::string& path, const ImageLimits& limits = ImageLimits());

/// Writes `image` as an 8-bit RGB PNG (lossless, so load_image gives the same pixels back).
/// Throws vlmgen::Error naming `path` when the image is malformed or the file cannot be written.
void save_png(const std::string& path, const Image& image);

}  // namespace vlmgen
