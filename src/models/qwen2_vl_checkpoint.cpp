// Qwen2-VL checkpoints: HF config.json + safetensors, in either HF tensor-name spelling.

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/qwen2_vl.h"

namespace vlmgen {
namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

/// Where a tensor named `name` in the classic spelling (`visual.*`, `model.*`, `lm_head.*`) may
/// sit in a checkpoint: that name first, then the transformers >= 4.52 spelling
/// (`model.visual.*`, `model.language_model.*`; lm_head is unchanged).
std::vector<std::string> name_candidates(const std::string& name) {
  if (starts_with(name, "visual.")) return {name, "model." + name};
  if (starts_with(name, "model.")) return {name, "model.language_model." + name.substr(6)};
  return {name};
}

}  // namespace

std::unique_ptr<Qwen2Vl> Qwen2Vl::from_checkpoint(const std::string& dir) {
  const std::filesystem::path root(dir);
  QwenVlConfig config = QwenVlConfig::from_file((root / "config.json").string());
  SafetensorsCheckpoint checkpoint(dir);
  // Some tied checkpoints leave tie_word_embeddings unset but ship no head: use the embedding.
  if (!checkpoint.contains("lm_head.weight")) config.tie_word_embeddings = true;
  std::unique_ptr<Qwen2Vl> model(new Qwen2Vl(config, Uninitialized{}));

  auto weights = model->named_weights();
  std::vector<std::string> sources(weights.size());
  std::vector<std::string> missing;
  for (size_t i = 0; i < weights.size(); ++i) {
    for (const std::string& candidate : name_candidates(weights[i].first)) {
      if (checkpoint.contains(candidate)) {
        sources[i] = candidate;
        break;
      }
    }
    if (sources[i].empty()) missing.push_back(weights[i].first);
  }
  VLMGEN_CHECK(missing.empty(), "checkpoint {} lacks {} of the {} tensors the config needs (either spelling): {}", dir,
               missing.size(), weights.size(), fmt::join(missing, ", "));

  for (size_t i = 0; i < weights.size(); ++i) {
    at::Tensor* target = weights[i].second;
    const SafetensorsEntry& entry = checkpoint.entry(sources[i]);
    VLMGEN_CHECK(entry.shape == target->sizes().vec(),
                 "tensor {} has shape [{}] in checkpoint {} but the config needs {}", sources[i],
                 fmt::join(entry.shape, ", "), dir, detail::shape_str(*target));
    VLMGEN_CHECK(entry.dtype == at::kFloat || entry.dtype == at::kHalf || entry.dtype == at::kBFloat16,
                 "tensor {} in checkpoint {} is {}; weights must be F32, F16 or BF16", sources[i], dir,
                 c10::toString(entry.dtype));
    *target = checkpoint.tensor(sources[i]).to(at::kFloat).contiguous();
  }
  if (model->config_.tie_word_embeddings) model->tie_lm_head();
  return model;
}

void Qwen2Vl::save_checkpoint(const std::string& dir) const {
  const std::filesystem::path root(dir);
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  VLMGEN_CHECK(!ec, "cannot create checkpoint directory {}: {}", dir, ec.message());
  {
    const std::string path = (root / "config.json").string();
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    VLMGEN_CHECK(out.good(), "cannot open {} for writing", path);
    out << config_.to_json();
    out.close();
    VLMGEN_CHECK(!out.fail(), "writing {} failed", path);
  }
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [name, tensor] : named_weights()) tensors.emplace(name, tensor->to(at::kCPU).contiguous());
  save_safetensors((root / "model.safetensors").string(), tensors, {{"format", "pt"}});
}

}  // namespace vlmgen
