#pragma once

// LLaVA-NeXT's image preprocessing (transformers' LlavaNextImageProcessor): each image becomes
// its base tile (the whole picture resized to a square) followed by the tiles of its anyres
// resolution (the picture resized to fit that resolution with its aspect ratio kept, centred on
// black padding, cut into squares), all rescaled and normalized with CLIP's statistics.
//
//   auto options = vlmgen::LlavaNextImageProcessorOptions::for_model(model->config());
//   vlmgen::VisionInputs vision = vlmgen::preprocess_llava_next({vlmgen::load_image("cat.png")}, options);

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "vlmgen/image/image.h"
#include "vlmgen/vision_inputs.h"

namespace vlmgen {

struct LlavaNextConfig;

struct LlavaNextImageProcessorOptions {
  int64_t tile_size = 336;  ///< crop_size: the side of every tile (the vision tower's image_size)
  std::vector<std::array<int64_t, 2>> image_grid_pinpoints;  ///< (height, width) in pixels
  double rescale_factor = 1.0 / 255.0;
  std::array<double, 3> image_mean = {0.48145466, 0.4578275, 0.40821073};
  std::array<double, 3> image_std = {0.26862954, 0.26130258, 0.27577711};

  /// The released processors' settings for this model (its image_size and pinpoints).
  static LlavaNextImageProcessorOptions for_model(const LlavaNextConfig& config);
};

/// for_model(config) with the image_mean, image_std and rescale_factor of the checkpoint folder's
/// preprocessor_config.json when it has one (a fine-tune's own statistics). A vlmgen::Error naming
/// the file for what vlmgen would not do as it says: another processor type, a filter other than
/// bicubic (3), a size or crop_size other than the model's image_size, pinpoints other than the
/// model's, do_resize / do_rescale / do_normalize / do_pad false, a normalization that is not
/// finite in float32.
LlavaNextImageProcessorOptions llava_next_image_processor(const std::string& dir, const LlavaNextConfig& config);

/// pixel_values [N, tiles, 3, tile_size, tile_size] (images with fewer tiles than the most are
/// padded with zero tiles, as transformers batches them) and image_sizes [N, 2] (original height
/// and width). Resizing is Pillow's bicubic (resize_bicubic). vlmgen::Error for an empty list, a
/// malformed image or options.
VisionInputs preprocess_llava_next(const std::vector<Image>& images, const LlavaNextImageProcessorOptions& options);

}  // namespace vlmgen
