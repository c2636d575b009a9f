#include "vlmgen/image/preprocessor_config.h"

#include <array>
#include <filesystem>
#include <fstream>

#include "../io/json_parse.h"
#include "config_fields.h"
#include "vlmgen/error.h"
#include "vlmgen/io/files.h"

namespace vlmgen {
namespace {

using Json = nlohmann::json;

// PIL's resampling filters by number, as HF stores them.
const char* resample_name(int64_t filter) {
  switch (filter) {
    case 0: return "nearest";
    case 1: return "lanczos";
    case 2: return "bilinear";
    case 3: return "bicubic";
    case 4: return "box";
    case 5: return "hamming";
  }
  return "unknown";
}

void check_type(const Json& j, const std::string& what) {
  if (!j.contains("image_processor_type")) return;
  const std::string type = j.at("image_processor_type").get<std::string>();
  for (const char* known : {"Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2_5_VLImageProcessor"}) {
    if (type == known) return;
  }
  VLMGEN_FAIL(
      "{}: image_processor_type {} is not supported; expected Qwen2VLImageProcessor(Fast) or "
      "Qwen2_5_VLImageProcessor",
      what, quote_excerpt(type));
}

void read_pixel_bounds(const Json& j, const std::string& what, QwenImageProcessorOptions& options) {
  using detail::config_int;
  if (j.contains("size") && !j.at("size").is_null()) {
    const Json& size = j.at("size");
    VLMGEN_CHECK(size.is_object(), "{}: size is {}; expected {{\"shortest_edge\": ..., \"longest_edge\": ...}}", what,
                 detail::json_excerpt(size));
    if (size.contains("shortest_edge"))
      options.min_pixels(config_int(size.at("shortest_edge"), what, "size.shortest_edge"));
    if (size.contains("longest_edge"))
      options.max_pixels(config_int(size.at("longest_edge"), what, "size.longest_edge"));
  }
  if (j.contains("min_pixels") && !j.at("min_pixels").is_null())
    options.min_pixels(config_int(j.at("min_pixels"), what, "min_pixels"));
  if (j.contains("max_pixels") && !j.at("max_pixels").is_null())
    options.max_pixels(config_int(j.at("max_pixels"), what, "max_pixels"));
}

void read_fields(const Json& j, const std::string& what, QwenImageProcessorOptions& options) {
  check_type(j, what);
  VLMGEN_CHECK(!j.contains("do_resize") || j.at("do_resize").get<bool>(),
               "{}: do_resize is false; vlmgen's Qwen-VL processor always resizes to the patch grid", what);
  if (j.contains("resample")) {
    const int64_t filter = detail::config_int(j.at("resample"), what, "resample");
    VLMGEN_CHECK(filter == 3, "{}: resample {} ({}) is not supported; expected 3 (bicubic)", what, filter,
                 resample_name(filter));
  }
  read_pixel_bounds(j, what, options);
  for (const auto& [key, set] :
       {std::pair<const char*, QwenImageProcessorOptions& (QwenImageProcessorOptions::*)(int64_t)>{
            "patch_size", &QwenImageProcessorOptions::patch_size},
        {"temporal_patch_size", &QwenImageProcessorOptions::temporal_patch_size},
        {"merge_size", &QwenImageProcessorOptions::merge_size}}) {
    if (j.contains(key)) (options.*set)(detail::config_int(j.at(key), what, key));
  }
  if (j.contains("image_mean")) options.image_mean(detail::config_triple(j.at("image_mean"), what, "image_mean"));
  if (j.contains("image_std")) options.image_std(detail::config_triple(j.at("image_std"), what, "image_std"));
  if (j.contains("rescale_factor"))
    options.rescale(detail::config_number(j.at("rescale_factor"), what, "rescale_factor"));
  if (j.contains("do_rescale") && !j.at("do_rescale").get<bool>()) options.rescale(1.0);
  if (j.contains("do_normalize") && !j.at("do_normalize").get<bool>()) {
    options.image_mean({0.0, 0.0, 0.0}).image_std({1.0, 1.0, 1.0});
  }
}

}  // namespace

QwenImageProcessorOptions parse_preprocessor_config(std::string_view json_text, const std::string& what) {
  const Json j = detail::parse_json(json_text, what, JsonLimits().max_bytes(kMaxPreprocessorConfigBytes));
  VLMGEN_CHECK(j.is_object(), "{}: expected a JSON object, got {}", what, detail::json_excerpt(j));
  QwenImageProcessorOptions options;
  try {
    read_fields(j, what, options);
  } catch (const Json::exception& e) {
    VLMGEN_FAIL("{} is not a valid preprocessor config: {}", what, quote_excerpt(e.what(), 160));
  }
  try {
    options.validate();
  } catch (const Error& e) {
    VLMGEN_FAIL("{}: {}", what, e.what());
  }
  return options;
}

std::optional<QwenImageProcessorOptions> load_preprocessor_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / kPreprocessorConfigFile).string();
  if (!file_exists(path, "preprocessor config")) return std::nullopt;
  return parse_preprocessor_config(read_regular_file(path, "preprocessor config", kMaxPreprocessorConfigBytes), path);
}

QwenImageProcessorOptions checkpoint_image_processor(const std::string& dir, const QwenVlConfig& config,
                                                     std::string* source) {
  const auto& v = config.vision;
  std::optional<QwenImageProcessorOptions> from_file = load_preprocessor_config(dir);
  if (!from_file) {
    if (source != nullptr) *source = fmt::format("HF's defaults ({} has no {})", dir, kPreprocessorConfigFile);
    return QwenImageProcessorOptions()
        .patch_size(v.patch_size)
        .temporal_patch_size(v.temporal_patch_size)
        .merge_size(v.spatial_merge_size);
  }
  const QwenImageProcessorOptions& o = *from_file;
  VLMGEN_CHECK(o.patch_size() == v.patch_size && o.temporal_patch_size() == v.temporal_patch_size &&
                   o.merge_size() == v.spatial_merge_size,
               "{}/{} cuts patch_size {} temporal_patch_size {} merge_size {}, but the model's config.json expects {} "
               "/ {} / {}",
               dir, kPreprocessorConfigFile, o.patch_size(), o.temporal_patch_size(), o.merge_size(), v.patch_size,
               v.temporal_patch_size, v.spatial_merge_size);
  if (source != nullptr) *source = fmt::format("{}/{}", dir, kPreprocessorConfigFile);
  return o;
}

void save_preprocessor_config(const std::string& dir, const QwenImageProcessorOptions& options) {
  options.validate();
  Json j;
  j["image_processor_type"] = "Qwen2VLImageProcessor";
  j["patch_size"] = options.patch_size();
  j["temporal_patch_size"] = options.temporal_patch_size();
  j["merge_size"] = options.merge_size();
  j["min_pixels"] = options.min_pixels();
  j["max_pixels"] = options.max_pixels();
  j["image_mean"] = options.image_mean();
  j["image_std"] = options.image_std();
  j["do_rescale"] = true;
  j["rescale_factor"] = options.rescale();
  j["do_normalize"] = true;
  j["do_resize"] = true;
  j["resample"] = 3;
  const std::string path = (std::filesystem::path(dir) / kPreprocessorConfigFile).string();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  VLMGEN_CHECK(out.good(), "cannot open {} for writing", path);
  out << j.dump(2) << '\n';
  out.close();
  VLMGEN_CHECK(!out.fail(), "writing {} failed", path);
}

}  // namespace vlmgen
