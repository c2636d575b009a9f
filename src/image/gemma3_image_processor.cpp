#include "vlmgen/image/gemma3_image_processor.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "../io/json_parse.h"
#include "config_fields.h"
#include "vlmgen/error.h"
#include "vlmgen/image/preprocessor_config.h"
#include "vlmgen/image/qwen_image_processor.h"
#include "vlmgen/io/files.h"

namespace vlmgen {

VisionInputs preprocess_gemma3(const std::vector<Image>& images, const Gemma3ImageProcessorOptions& options) {
  VLMGEN_CHECK(!images.empty(), "preprocess_gemma3 needs at least one image");
  VLMGEN_CHECK(options.size >= 1 && options.size <= 8192, "gemma3 image size must be in [1, 8192], got {}",
               options.size);
  detail::check_normalization(options.image_mean, options.image_std, options.rescale_factor, "gemma3 image options");
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor mean = at::tensor(std::vector<double>(options.image_mean.begin(), options.image_mean.end()), opts);
  const at::Tensor std = at::tensor(std::vector<double>(options.image_std.begin(), options.image_std.end()), opts);
  std::vector<at::Tensor> pixels;
  std::vector<int64_t> sizes;
  for (const Image& image : images) {
    const Image resized = resize_bilinear(image, options.size, options.size);
    // [H, W, C] uint8 -> [C, H, W]; rescaled in double then stored as float32, as HF's rescale does.
    at::Tensor x = at::from_blob(const_cast<uint8_t*>(resized.rgb.data()), {options.size, options.size, 3}, at::kByte)
                       .permute({2, 0, 1})
                       .to(at::kDouble)
                       .mul(options.rescale_factor)
                       .to(at::kFloat);
    pixels.push_back(x.sub(mean.view({3, 1, 1})).div(std.view({3, 1, 1})));
    sizes.insert(sizes.end(), {image.height, image.width});
  }
  const auto n = static_cast<int64_t>(images.size());
  return VisionInputs::per_image(at::stack(pixels), at::tensor(sizes, at::kLong).view({n, 2}));
}

Gemma3ImageProcessorOptions parse_gemma3_preprocessor_config(std::string_view json_text, const std::string& what,
                                                             int64_t default_size) {
  const nlohmann::json j =
      detail::parse_json(std::string(json_text), what, JsonLimits().max_bytes(kMaxPreprocessorConfigBytes));
  VLMGEN_CHECK(j.is_object(), "{}: expected a JSON object, got {}", what, j.type_name());
  Gemma3ImageProcessorOptions o;
  o.size = default_size;
  auto field = [&](const char* key) -> const nlohmann::json* {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  };
  try {
    if (const auto* type = field("image_processor_type")) {
      const std::string t = type->get<std::string>();
      VLMGEN_CHECK(t == "Gemma3ImageProcessor" || t == "Gemma3ImageProcessorFast",
                   "{}: image_processor_type {} is not supported; expected Gemma3ImageProcessor", what, t);
    }
    for (const char* key : {"do_resize", "do_rescale", "do_normalize"}) {
      if (const auto* v = field(key)) VLMGEN_CHECK(v->get<bool>(), "{}: {} is false; vlmgen always does it", what, key);
    }
    if (const auto* v = field("do_pan_and_scan")) {
      VLMGEN_CHECK(!v->get<bool>(), "{}: do_pan_and_scan is true; pan-and-scan crops are not implemented", what);
    }
    if (const auto* v = field("resample")) {
      const int64_t filter = detail::config_int(*v, what, "resample");
      VLMGEN_CHECK(filter == 2, "{}: resample {} is not supported; expected 2 (bilinear)", what, filter);
    }
    if (const auto* size = field("size")) {
      VLMGEN_CHECK(size->is_object(), "{}: size is {}; expected {{\"height\": ..., \"width\": ...}}", what,
                   detail::json_excerpt(*size));
      const int64_t h = detail::config_int(size->at("height"), what, "size.height");
      const int64_t w = detail::config_int(size->at("width"), what, "size.width");
      VLMGEN_CHECK(h == w, "{}: size {}x{} (height x width) is not square", what, h, w);
      o.size = h;
    }
    if (const auto* v = field("rescale_factor")) o.rescale_factor = detail::config_number(*v, what, "rescale_factor");
    if (const auto* v = field("image_mean")) o.image_mean = detail::config_triple(*v, what, "image_mean");
    if (const auto* v = field("image_std")) o.image_std = detail::config_triple(*v, what, "image_std");
  } catch (const nlohmann::json::exception& e) {
    VLMGEN_FAIL("{}: a field has the wrong type: {}", what, e.what());
  }
  for (double s : o.image_std) VLMGEN_CHECK(s > 0, "{}: image_std must be positive, got {}", what, s);
  detail::check_normalization(o.image_mean, o.image_std, o.rescale_factor, what);
  return o;
}

Gemma3ImageProcessorOptions gemma3_image_processor(const std::string& dir, int64_t image_size) {
  const std::filesystem::path path = std::filesystem::path(dir) / kPreprocessorConfigFile;
  Gemma3ImageProcessorOptions o;
  o.size = image_size;
  if (!file_exists(path.string(), "preprocessor config")) return o;
  o = parse_gemma3_preprocessor_config(
      read_regular_file(path.string(), "preprocessor config", kMaxPreprocessorConfigBytes), path.string(), image_size);
  VLMGEN_CHECK(o.size == image_size, "{}: size {} disagrees with the vision tower's image_size {}", path.string(),
               o.size, image_size);
  return o;
}

}  // namespace vlmgen
