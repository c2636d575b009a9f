#pragma once

// The library keeps its stb copy private, so the tests write JPEG, grayscale/RGBA PNG files and
// zlib streams through their own (static, per translation unit) copy of the writer.

#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STB_IMAGE_WRITE_STATIC
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#endif
#if defined(__clang__)
// stb's JPEG encoder shifts negative values left (undefined behaviour, found by UBSan in the
// sanitizer build); this test-only copy is exempt, the library never encodes JPEG.
#pragma clang attribute push(__attribute__((no_sanitize("shift"))), apply_to = function)
#endif
#if __has_include(<stb/stb_image_write.h>)
#include <stb/stb_image_write.h>
#else
#include <stb_image_write.h>
#endif
#if defined(__clang__)
#pragma clang attribute pop
#endif
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
