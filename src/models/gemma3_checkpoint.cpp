// Gemma-3 checkpoints: HF config.json + safetensors, in either transformers tensor-name spelling.

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint_folder.h"
#include "qwen_vl_ops.h"
#include "vlmgen/error.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/gemma3.h"
#include "weight_arena.h"

namespace vlmgen {
namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

}  // namespace

std::unique_ptr<Gemma3> Gemma3::from_checkpoint(const std::string& dir, const ParallelContext& parallel,
                                                const LoadOptions& options) {
  check_kv_cache_dtype(options.kv_cache_dtype, options.device);
  const at::ScalarType dtype = options.weights_dtype;
  VLMGEN_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
               "gemma3 weights can be loaded as float32, bfloat16 or float16, got {}", c10::toString(dtype));
  VLMGEN_CHECK(!options.keep_fp8, "gemma3: FP8 weights (keep_fp8 / --dtype fp8) are not implemented for this family");
  const std::filesystem::path root(dir);
  Gemma3Config config = Gemma3Config::from_file((root / "config.json").string());
  SafetensorsCheckpoint checkpoint(dir);
  if (!checkpoint.contains("lm_head.weight") && !checkpoint.contains("language_model.lm_head.weight"))
    config.tie_word_embeddings = true;
  const int64_t parameters = config.parameter_count();
  VLMGEN_CHECK(parameters <= checkpoint.data_bytes() / 2,
               "checkpoint {}: config.json describes {} weights, at least {} bytes as F16/BF16, but its safetensors "
               "files hold only {} bytes of tensor data",
               dir, parameters, parameters * 2, checkpoint.data_bytes());
  std::unique_ptr<Gemma3> model(new Gemma3(config, Uninitialized{}, parallel));

  std::vector<WeightSlot> slots = model->weight_slots();
  std::vector<std::string> sources(slots.size()), missing;
  for (size_t i = 0; i < slots.size(); ++i) {
    for (const std::string& candidate : detail::multimodal_name_candidates(slots[i].name)) {
      if (checkpoint.contains(candidate)) {
        sources[i] = candidate;
        break;
      }
    }
    if (sources[i].empty()) missing.push_back(slots[i].name);
  }
  VLMGEN_CHECK(missing.empty(),
               "checkpoint {} lacks {} of the {} tensors the gemma3 config needs (either spelling): {}", dir,
               missing.size(), slots.size(), fmt::join(missing, ", "));
  detail::StreamedWeights streamed(detail::decode_streamed(model->lm_.layers, model->lm_.lm_head), options);
  for (size_t i = 0; i < slots.size(); ++i) {
    const SafetensorsEntry& entry = checkpoint.entry(sources[i]);
    VLMGEN_CHECK(!entry.fp8, "tensor {} in checkpoint {} is FP8; FP8 checkpoints of gemma3 are not implemented",
                 sources[i], dir);
    VLMGEN_CHECK(entry.dtype == at::kFloat || entry.dtype == at::kHalf || entry.dtype == at::kBFloat16,
                 "tensor {} in checkpoint {} is {}; weights must be F32, F16 or BF16", sources[i], dir,
                 c10::toString(entry.dtype));
    const std::vector<int64_t> full = model->full_shape(*slots[i].tensor, slots[i].layout);
    VLMGEN_CHECK(entry.shape == full, "tensor {} has shape [{}] in checkpoint {} but the config needs [{}]", sources[i],
                 fmt::join(entry.shape, ", "), dir, fmt::join(full, ", "));
    const bool lm_matrix =
        full.size() == 2 && (starts_with(slots[i].name, "model.language_model.") || slots[i].name == "lm_head.weight");
    *slots[i].tensor = streamed.read(checkpoint, sources[i], full, slots[i].layout, parallel.tp_rank(),
                                     parallel.tp_size(), lm_matrix ? dtype : at::kFloat, *slots[i].tensor);
    checkpoint.release(sources[i]);
  }
  streamed.finish();
  if (model->config_.tie_word_embeddings) model->tie_lm_head();
  model->set_kv_cache_dtype(options.kv_cache_dtype);
  return model;
}

void Gemma3::save_checkpoint(const std::string& dir) const {
  std::map<std::string, at::Tensor> tensors;
  for (const WeightSlot& slot : const_cast<Gemma3*>(this)->weight_slots()) {
    at::Tensor full = tp_comm_ == nullptr ? *slot.tensor : detail::gather_shard(*slot.tensor, slot.layout, *tp_comm_);
    tensors.emplace(slot.name, full.to(at::kCPU).contiguous());
  }
  detail::write_checkpoint_once(dir, config_.to_json(), tensors, tp_comm_, parallel_.tp_rank());
}

}  // namespace vlmgen
