#include "vlmgen/image/llava_next_image_processor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "../io/json_parse.h"
#include "config_fields.h"
#include "vlmgen/error.h"
#include "vlmgen/image/preprocessor_config.h"
#include "vlmgen/image/qwen_image_processor.h"
#include "vlmgen/io/files.h"
#include "vlmgen/models/llava_next.h"

namespace vlmgen {
namespace {

/// [H, W, 3] uint8 -> [3, H, W] float32, rescaled (in double, as transformers) and normalized.
at::Tensor normalized(const Image& image, const LlavaNextImageProcessorOptions& o) {
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor mean = at::tensor(std::vector<double>(o.image_mean.begin(), o.image_mean.end()), opts);
  const at::Tensor std = at::tensor(std::vector<double>(o.image_std.begin(), o.image_std.end()), opts);
  return at::from_blob(const_cast<uint8_t*>(image.rgb.data()), {image.height, image.width, 3}, at::kByte)
      .permute({2, 0, 1})
      .to(at::kDouble)
      .mul(o.rescale_factor)
      .to(at::kFloat)
      .sub(mean.view({3, 1, 1}))
      .div(std.view({3, 1, 1}));
}

/// A square side as preprocessor_config.json gives it: a number, {"height", "width"} (equal) or
/// {"shortest_edge"}.
int64_t square_side(const nlohmann::json& v, const std::string& what, const std::string& key) {
  if (!v.is_object()) return detail::config_int(v, what, key);
  if (v.contains("shortest_edge")) return detail::config_int(v.at("shortest_edge"), what, key + ".shortest_edge");
  VLMGEN_CHECK(v.contains("height") && v.contains("width"), "{}: {} is {}; expected height and width", what, key,
               detail::json_excerpt(v));
  const int64_t h = detail::config_int(v.at("height"), what, key + ".height");
  const int64_t w = detail::config_int(v.at("width"), what, key + ".width");
  VLMGEN_CHECK(h == w, "{}: {} is {}x{} (height x width); expected a square", what, key, h, w);
  return h;
}

void read_llava_fields(const nlohmann::json& j, const std::string& what, LlavaNextImageProcessorOptions& o) {
  auto field = [&](const char* key) -> const nlohmann::json* {
    const auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  if (const auto* v = field("image_processor_type")) {
    const std::string type = v->get<std::string>();
    VLMGEN_CHECK(type == "LlavaNextImageProcessor" || type == "LlavaNextImageProcessorFast",
                 "{}: image_processor_type {} is not supported; expected LlavaNextImageProcessor", what, type);
  }
  for (const char* key : {"do_resize", "do_rescale", "do_normalize", "do_pad"}) {
    if (const auto* v = field(key)) VLMGEN_CHECK(v->get<bool>(), "{}: {} is false; vlmgen always does it", what, key);
  }
  if (const auto* v = field("resample")) {
    const int64_t filter = detail::config_int(*v, what, "resample");
    VLMGEN_CHECK(filter == 3, "{}: resample {} is not supported; expected 3 (bicubic)", what, filter);
  }
  for (const char* key : {"size", "crop_size"}) {
    if (const auto* v = field(key)) {
      const int64_t side = square_side(*v, what, key);
      VLMGEN_CHECK(side == o.tile_size, "{}: {} {} differs from the vision tower's image_size {}", what, key, side,
                   o.tile_size);
    }
  }
  if (const auto* v = field("image_grid_pinpoints")) {
    const auto pinpoints = v->get<std::vector<std::array<int64_t, 2>>>();
    VLMGEN_CHECK(pinpoints == o.image_grid_pinpoints,
                 "{}: image_grid_pinpoints {} differ from config.json's; the placeholder counts follow config.json",
                 what, detail::json_excerpt(*v));
  }
  if (const auto* v = field("rescale_factor")) o.rescale_factor = detail::config_number(*v, what, "rescale_factor");
  if (const auto* v = field("image_mean")) o.image_mean = detail::config_triple(*v, what, "image_mean");
  if (const auto* v = field("image_std")) o.image_std = detail::config_triple(*v, what, "image_std");
}

/// The picture resized to fit (height, width) with its aspect ratio kept, centred on black.
Image fit_and_pad(const Image& image, int64_t height, int64_t width) {
  const double scale_w = static_cast<double>(width) / image.width, scale_h = static_cast<double>(height) / image.height;
  int64_t new_h = height, new_w = width;
  if (scale_w < scale_h) {
    new_h = std::min(static_cast<int64_t>(std::ceil(image.height * scale_w)), height);
  } else {
    new_w = std::min(static_cast<int64_t>(std::ceil(image.width * scale_h)), width);
  }
  const Image resized = resize_bicubic(image, new_h, new_w);
  Image out{height, width, std::vector<uint8_t>(static_cast<size_t>(height * width * 3), 0)};
  const int64_t top = (height - new_h) / 2, left = (width - new_w) / 2;
  for (int64_t y = 0; y < new_h; ++y) {
    std::copy_n(&resized.rgb[static_cast<size_t>(y * new_w * 3)], new_w * 3,
                &out.rgb[static_cast<size_t>(((top + y) * width + left) * 3)]);
  }
  return out;
}

}  // namespace

LlavaNextImageProcessorOptions LlavaNextImageProcessorOptions::for_model(const LlavaNextConfig& config) {
  LlavaNextImageProcessorOptions o;
  o.tile_size = config.image_size;
  o.image_grid_pinpoints = config.image_grid_pinpoints;
  return o;
}

LlavaNextImageProcessorOptions llava_next_image_processor(const std::string& dir, const LlavaNextConfig& config) {
  LlavaNextImageProcessorOptions o = LlavaNextImageProcessorOptions::for_model(config);
  const std::string path = (std::filesystem::path(dir) / kPreprocessorConfigFile).string();
  if (!file_exists(path, "preprocessor config")) return o;
  const nlohmann::json j =
      detail::parse_json(read_regular_file(path, "preprocessor config", kMaxPreprocessorConfigBytes), path,
                         JsonLimits().max_bytes(kMaxPreprocessorConfigBytes));
  VLMGEN_CHECK(j.is_object(), "{}: expected a JSON object, got {}", path, detail::json_excerpt(j));
  try {
    read_llava_fields(j, path, o);
  } catch (const nlohmann::json::exception& e) {
    VLMGEN_FAIL("{}: a field has the wrong type: {}", path, quote_excerpt(e.what(), 160));
  }
  detail::check_normalization(o.image_mean, o.image_std, o.rescale_factor, path);
  return o;
}

VisionInputs preprocess_llava_next(const std::vector<Image>& images, const LlavaNextImageProcessorOptions& o) {
  VLMGEN_CHECK(!images.empty(), "preprocess_llava_next needs at least one image");
  VLMGEN_CHECK(o.tile_size >= 1 && o.tile_size <= 4096, "llava_next tile_size must be in [1, 4096], got {}",
               o.tile_size);
  detail::check_normalization(o.image_mean, o.image_std, o.rescale_factor, "llava_next image options");
  VLMGEN_CHECK(!o.image_grid_pinpoints.empty(), "llava_next preprocessing needs image_grid_pinpoints");
  for (double s : o.image_std) VLMGEN_CHECK(s > 0, "llava_next image_std must be positive, got {}", s);
  const int64_t t = o.tile_size;
  std::vector<at::Tensor> per_image;
  std::vector<int64_t> sizes;
  int64_t most = 0;
  for (const Image& image : images) {
    const auto [best_h, best_w] = select_best_resolution(image.height, image.width, o.image_grid_pinpoints);
    VLMGEN_CHECK(best_h % t == 0 && best_w % t == 0 && best_h / t <= 64 && best_w / t <= 64,
                 "pinpoint {}x{} must be a multiple of the tile size {} of at most 64 tiles a side", best_h, best_w, t);
    std::vector<at::Tensor> tiles = {normalized(resize_bicubic(image, t, t), o)};
    const at::Tensor grid = normalized(fit_and_pad(image, best_h, best_w), o);  // [3, best_h, best_w]
    for (int64_t r = 0; r < best_h / t; ++r) {
      for (int64_t c = 0; c < best_w / t; ++c) tiles.push_back(grid.narrow(1, r * t, t).narrow(2, c * t, t));
    }
    per_image.push_back(at::stack(tiles));
    most = std::max<int64_t>(most, static_cast<int64_t>(tiles.size()));
    sizes.insert(sizes.end(), {image.height, image.width});
  }
  at::Tensor pixels = at::zeros({static_cast<int64_t>(images.size()), most, 3, t, t});
  for (size_t i = 0; i < per_image.size(); ++i) {
    pixels[static_cast<int64_t>(i)].narrow(0, 0, per_image[i].size(0)).copy_(per_image[i]);
  }
  return VisionInputs::per_image(pixels, at::tensor(sizes, at::kLong).view({-1, 2}));
}

}  // namespace vlmgen
