#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "image_format.h"
#include "vlmgen/error.h"
#include "vlmgen/image/image.h"
#include "vlmgen/io/files.h"

namespace vlmgen::detail {
namespace {

// The largest single allocation stb may make while decoding the current image on this thread;
// set from the declared size before decoding (see DecodeBudget). stb grows its inflate buffer
// by doubling without bound, so without this a PNG of a few MB whose compressed data inflates
// far beyond its declared size would have stb allocate gigabytes.
thread_local size_t stb_allocation_limit = std::numeric_limits<size_t>::max();

void* stb_malloc(size_t size) { return size > stb_allocation_limit ? nullptr : std::malloc(size); }
void* stb_realloc(void* p, size_t size) { return size > stb_allocation_limit ? nullptr : std::realloc(p, size); }

}  // namespace
}  // namespace vlmgen::detail

// The stb implementations live in this one translation unit. STATIC keeps their symbols out of
// libvlmgen's exports, so a program that links its own copy of stb does not clash with ours.
// Only the PNG and JPEG decoders are compiled: less code that parses untrusted bytes.
#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_STATIC
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_NO_STDIO
#define STBI_MALLOC(size) ::vlmgen::detail::stb_malloc(size)
#define STBI_REALLOC(p, size) ::vlmgen::detail::stb_realloc(p, size)
#define STBI_FREE(p) std::free(p)
#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#endif
#include "stb_image.h"
#include "stb_image_write.h"
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

namespace vlmgen {
namespace detail {
namespace {

constexpr int kChannels = 3;

// Sets stb_allocation_limit for one decode: generous for any valid file of the declared size
// (16-bit RGBA rows plus filter bytes, JPEG blocks padded to 16 pixels, room for one doubling),
// and restores it on every exit.
class DecodeBudget {
 public:
  DecodeBudget(const ImageHeader& header, size_t file_size) : previous_(stb_allocation_limit) {
    // In double: with a caller's max_pixels near 2^63 the product would overflow any integer.
    const double padded = static_cast<double>(header.width + 16) * static_cast<double>(header.height + 16);
    const double limit =
        2 * (8 * padded + 8 * static_cast<double>(header.height + 16)) + 2 * static_cast<double>(file_size) + (1 << 20);
    const auto most = static_cast<double>(std::numeric_limits<size_t>::max());
    stb_allocation_limit = limit >= most ? std::numeric_limits<size_t>::max() : static_cast<size_t>(limit);
  }
  ~DecodeBudget() { stb_allocation_limit = previous_; }
  DecodeBudget(const DecodeBudget&) = delete;
  DecodeBudget& operator=(const DecodeBudget&) = delete;

 private:
  size_t previous_;
};

struct StbFree {
  void operator()(stbi_uc* p) const { stbi_image_free(p); }
};

}  // namespace
}  // namespace detail

Image decode_image(const uint8_t* data, size_t size, const ImageLimits& limits, const std::string& what) {
  const int64_t max_bytes = std::min<int64_t>(limits.max_file_bytes(), std::numeric_limits<int>::max());
  VLMGEN_CHECK(static_cast<uint64_t>(size) <= static_cast<uint64_t>(max_bytes),
               "{} is {} bytes, above the limit of {} bytes (ImageLimits::max_file_bytes)", what, size, max_bytes);
  const detail::ImageHeader header = detail::read_image_header(data, size, limits, what);
  // The product cannot overflow: each side is below 2^31 (PNG) or 2^16 (JPEG).
  const int64_t pixels = header.width * header.height;
  VLMGEN_CHECK(pixels <= limits.max_pixels(),
               "{} declares {}x{} pixels (width x height) = {}, above the limit of {} (ImageLimits::max_pixels)", what,
               header.width, header.height, pixels, limits.max_pixels());

  int width = 0;
  int height = 0;
  int channels_in_file = 0;
  std::unique_ptr<stbi_uc, detail::StbFree> pixels_rgb;
  {
    const detail::DecodeBudget budget(header, size);
    // Asking stb for 3 channels makes it expand grayscale and drop alpha for us.
    pixels_rgb.reset(
        stbi_load_from_memory(data, static_cast<int>(size), &width, &height, &channels_in_file, detail::kChannels));
  }
  VLMGEN_CHECK(pixels_rgb != nullptr, "cannot decode {} as a PNG or JPEG image ({}x{} declared): {}", what,
               header.width, header.height, stbi_failure_reason());
  VLMGEN_CHECK(width == header.width && height == header.height,
               "{}: decoded {}x{} pixels but the header declares {}x{} (width x height)", what, width, height,
               header.width, header.height);
  Image image;
  image.height = height;
  image.width = width;
  image.rgb.assign(pixels_rgb.get(), pixels_rgb.get() + static_cast<size_t>(pixels) * detail::kChannels);
  return image;
}

Image load_image(const std::string& path, const ImageLimits& limits) {
  const std::string bytes = read_regular_file(path, "image file", limits.max_file_bytes());
  return decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), limits,
                      fmt::format("image file '{}'", path));
}

void save_png(const std::string& path, const Image& image) {
  VLMGEN_CHECK(image.height > 0 && image.width > 0 &&
                   image.height <= std::numeric_limits<int32_t>::max() / image.width / detail::kChannels,
               "save_png('{}'): the image must have pixels and fit in 2^31 bytes, got {}x{} (height x width)", path,
               image.height, image.width);
  const size_t expected = static_cast<size_t>(image.height * image.width * detail::kChannels);
  VLMGEN_CHECK(image.rgb.size() == expected,
               "save_png('{}'): a {}x{} RGB image needs {} bytes (height * width * 3), got {}", path, image.height,
               image.width, expected, image.rgb.size());
  const int width = static_cast<int>(image.width);
  const int ok = stbi_write_png(path.c_str(), width, static_cast<int>(image.height), detail::kChannels,
                                image.rgb.data(), width * detail::kChannels);
  VLMGEN_CHECK(ok != 0, "cannot write PNG file '{}' ({}x{}, height x width)", path, image.height, image.width);
}

}  // namespace vlmgen
