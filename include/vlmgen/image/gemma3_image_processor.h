#pragma once

// Gemma-3's image preprocessing (transformers' Gemma3ImageProcessor without pan-and-scan): every
// image resized to size x size with Pillow's bilinear filter, rescaled by 1/255 and normalized
// with mean and std 0.5, one [channels, size, size] entry per image.
//
//   auto options = vlmgen::gemma3_image_processor(dir, model->config().image_size);
//   vlmgen::VisionInputs vision = vlmgen::preprocess_gemma3({vlmgen::load_image("cat.png")}, options);

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "vlmgen/image/image.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen {

struct Gemma3ImageProcessorOptions {
  int64_t size = 896;  ///< height and width after the resize (the vision tower's image_size)
  double rescale_factor = 1.0 / 255.0;
  std::array<double, 3> image_mean = {0.5, 0.5, 0.5};
  std::array<double, 3> image_std = {0.5, 0.5, 0.5};
};

/// pixel_values [N, 3, size, size] float32 and image_sizes [N, 2] (each image's original height
/// and width), as VisionInputs::per_image. vlmgen::Error for an empty list or a malformed image.
VisionInputs preprocess_gemma3(const std::vector<Image>& images, const Gemma3ImageProcessorOptions& options);

/// Settings from a preprocessor_config.json text as transformers writes it for Gemma-3 (size
/// {height, width}, image_mean, image_std, rescale_factor, resample). Refuses with a vlmgen::Error
/// naming `what`: another processor type, a size that is not square, a filter other than bilinear
/// (2), pan-and-scan turned on (not implemented), do_resize/do_rescale/do_normalize false.
/// A file without `size` keeps `default_size`.
Gemma3ImageProcessorOptions parse_gemma3_preprocessor_config(std::string_view json_text, const std::string& what,
                                                             int64_t default_size = 896);

/// The preprocessing of a Gemma-3 checkpoint folder: its preprocessor_config.json when present,
/// else the defaults at `image_size`. vlmgen::Error when the file's size is not `image_size`.
Gemma3ImageProcessorOptions gemma3_image_processor(const std::string& dir, int64_t image_size);

}  // namespace vlmgen
