#pragma once

// A checkpoint folder's own image preprocessing: `preprocessor_config.json`, as HF writes it for
// the Qwen-VL image processors. Loading a folder uses these settings by default, so the model sees
// the image it was trained on; a caller's overrides are applied on top and reported.
//
//   auto options = vlmgen::load_preprocessor_config(dir).value_or(vlmgen::QwenImageProcessorOptions());

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "vlmgen/image/qwen_image_processor.h"
#include "vlmgen/models/qwen_vl_config.h"

namespace vlmgen {

/// The file name inside a checkpoint folder.
inline constexpr const char* kPreprocessorConfigFile = "preprocessor_config.json";
/// Largest preprocessor_config.json read (real ones are under 1 KiB).
inline constexpr int64_t kMaxPreprocessorConfigBytes = int64_t{1} << 20;

/// Settings from the text of a preprocessor_config.json. Reads `min_pixels`/`max_pixels` (or,
/// in newer files, `size.shortest_edge`/`size.longest_edge`, which are areas despite their
/// names; top-level min/max_pixels win when both are there, as in HF), `patch_size`,
/// `temporal_patch_size`, `merge_size`, `image_mean`, `image_std`, `rescale_factor`,
/// `do_rescale`, `do_normalize` and `resample`; absent fields keep HF's defaults. Refuses with a
/// vlmgen::Error naming `what` and the field: a processor type other than the Qwen2-VL /
/// Qwen2.5-VL ones, `do_resize: false`, a resampling filter other than bicubic (3), and any value
/// QwenImageProcessorOptions::validate refuses.
QwenImageProcessorOptions parse_preprocessor_config(std::string_view json_text, const std::string& what);

/// `dir`/preprocessor_config.json parsed, or nullopt when the folder has none.
std::optional<QwenImageProcessorOptions> load_preprocessor_config(const std::string& dir);

/// The image preprocessing of a Qwen-VL checkpoint folder, the default everywhere a folder is
/// loaded: its preprocessor_config.json when present, else HF's defaults with the model's patch
/// geometry (config.vision). `source`, when given, receives where the settings came from, for a
/// log line. Throws vlmgen::Error when the file's patch_size, temporal_patch_size or merge_size
/// disagree with the model's config.json: the vision tower could not take those patches.
QwenImageProcessorOptions checkpoint_image_processor(const std::string& dir, const QwenVlConfig& config,
                                                     std::string* source = nullptr);

/// Writes `options` as `dir`/preprocessor_config.json, in the layout HF reads.
void save_preprocessor_config(const std::string& dir, const QwenImageProcessorOptions& options);

}  // namespace vlmgen
