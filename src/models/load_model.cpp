#include "vlmgen/models/load_model.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "../io/json_parse.h"
#include "vlmgen/error.h"
#include "vlmgen/io/files.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/models/llava_next.h"
#include "vlmgen/models/qwen_vl.h"

namespace vlmgen {

std::string checkpoint_model_type(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  const std::string text = read_regular_file(path, "config file", QwenVlConfigLimits::kMaxConfigBytes);
  const nlohmann::json root =
      detail::parse_json(text, "config", JsonLimits().max_bytes(QwenVlConfigLimits::kMaxConfigBytes));
  VLMGEN_CHECK(root.is_object(), "config file '{}' must hold a JSON object, got {}", path, root.type_name());
  auto model_type = root.find("model_type");
  if (model_type != root.end() && model_type->is_string()) return model_type->get<std::string>();
  auto architectures = root.find("architectures");
  if (architectures != root.end() && architectures->is_array() && !architectures->empty() &&
      (*architectures)[0].is_string()) {
    return (*architectures)[0].get<std::string>();
  }
  VLMGEN_FAIL("config file '{}' names no model_type (or architectures); supported: {}", path, supported_family_names());
}

std::unique_ptr<CausalVlm> load_model(const std::string& dir, const ParallelContext& parallel,
                                      const LoadOptions& options) {
  const std::string type = checkpoint_model_type(dir);
  if (type == "gemma3" || type == "Gemma3ForConditionalGeneration")
    return Gemma3::from_checkpoint(dir, parallel, options);
  if (type == "llava_next" || type == "LlavaNextForConditionalGeneration")
    return LlavaNext::from_checkpoint(dir, parallel, options);
  VLMGEN_CHECK(family_from_name(type).has_value(),
               "checkpoint {}: model type '{}' is not supported; supported: {}, gemma3, llava_next", dir, type,
               supported_family_names());
  return QwenVl::from_checkpoint(dir, parallel, options);
}

}  // namespace vlmgen
