#pragma once

#include <memory>
#include <string>

#include "vlmgen/model.h"
#include "vlmgen/models/load_options.h"
#include "vlmgen/parallel.h"

namespace vlmgen {

/// Loads the model an HF checkpoint folder describes: reads `dir`/config.json's model_type (or
/// architectures[0] when model_type is absent) and returns the matching CausalVlm, with this
/// rank's slices under tensor parallelism. Supported: qwen2_vl, qwen2_5_vl, qwen3_vl (all
/// QwenVl), gemma3 (Gemma3) and llava_next (LlavaNext). An unknown type is a vlmgen::Error
/// naming it and the supported ones.
///
///   auto model = vlmgen::load_model("/models/Qwen2.5-VL-3B-Instruct");
///   vlmgen::Generator generator(*model);
std::unique_ptr<CausalVlm> load_model(const std::string& dir,
                                      const ParallelContext& parallel = ParallelContext::single(),
                                      const LoadOptions& options = {});

/// The model type `dir`/config.json names (model_type, else architectures[0]); vlmgen::Error
/// when the file is missing, not JSON, or names neither.
std::string checkpoint_model_type(const std::string& dir);

}  // namespace vlmgen
