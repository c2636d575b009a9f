// LLaVA-NeXT checkpoints: HF config.json + safetensors, in either transformers tensor-name spelling.

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint_folder.h"
#include "qwen_vl_ops.h"
#include "vlmgen/error.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/llava_next.h"
#include "weight_arena.h"

namespace vlmgen {
namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

/// The decoder's own name of a LLaVA-NeXT text weight (`model.language_model.X` -> `model.X`).
std::string decoder_name(const std::string& name) {
  const std::string lm = "model.language_model.";
  return starts_with(name, lm) ? "model." + name.substr(lm.size()) : name;
}

}  // namespace

std::unique_ptr<LlavaNext> LlavaNext::from_checkpoint(const std::string& dir, const ParallelContext& parallel,
                                                      const LoadOptions& options) {
  QwenVl::check_weights_dtype(options.weights_dtype);
  check_kv_cache_dtype(options.kv_cache_dtype, options.device);
  VLMGEN_CHECK(!options.keep_fp8,
               "llava_next: FP8 weights (keep_fp8 / --dtype fp8) are not implemented for this family");
  const std::filesystem::path root(dir);
  LlavaNextConfig config = LlavaNextConfig::from_file((root / "config.json").string());
  SafetensorsCheckpoint checkpoint(dir);
  if (!checkpoint.contains("lm_head.weight") && !checkpoint.contains("language_model.lm_head.weight"))
    config.tie_word_embeddings = true;
  const int64_t parameters = config.parameter_count();
  VLMGEN_CHECK(parameters <= checkpoint.data_bytes() / 2,
               "checkpoint {}: config.json describes {} weights, at least {} bytes as F16/BF16, but its safetensors "
               "files hold only {} bytes of tensor data",
               dir, parameters, parameters * 2, checkpoint.data_bytes());
  const QwenVlConfig lm_config = config.language_model_config();
  QwenVl::check_parallel_config(lm_config, parallel);
  std::unique_ptr<QwenVl> lm(new QwenVl(lm_config, QwenVl::Uninitialized{}, parallel));
  std::unique_ptr<LlavaNext> model(new LlavaNext(config, std::move(lm)));
  QwenVl& decoder = *model->lm_;

  // Every weight this model needs, with its layout under tensor parallelism.
  const std::vector<QwenVl::WeightSlot> slots = model->weight_slots();
  std::vector<std::string> sources(slots.size()), missing;  // checkpoint names
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
               "checkpoint {} lacks {} of the {} tensors the llava_next config needs (either "
               "spelling): {}",
               dir, missing.size(), slots.size(), fmt::join(missing, ", "));
  detail::StreamedWeights streamed(
      detail::decode_streamed(decoder.language_model().layers, decoder.language_model().lm_head), options);
  for (size_t i = 0; i < slots.size(); ++i) {
    const QwenVl::WeightSlot& slot = slots[i];
    const std::string& source = sources[i];
    const SafetensorsEntry& entry = checkpoint.entry(source);
    VLMGEN_CHECK(!entry.fp8, "tensor {} in checkpoint {} is FP8; FP8 checkpoints of llava_next are not implemented",
                 source, dir);
    VLMGEN_CHECK(entry.dtype == at::kFloat || entry.dtype == at::kHalf || entry.dtype == at::kBFloat16,
                 "tensor {} in checkpoint {} is {}; weights must be F32, F16 or BF16", source, dir,
                 c10::toString(entry.dtype));
    const std::vector<int64_t> full = decoder.full_shape(*slot.tensor, slot.layout);
    VLMGEN_CHECK(entry.shape == full, "tensor {} has shape [{}] in checkpoint {} but the config needs [{}]", source,
                 fmt::join(entry.shape, ", "), dir, fmt::join(full, ", "));
    const bool text = starts_with(slot.name, "model.language_model.") || slot.name == "lm_head.weight";
    const bool lm_matrix = text && QwenVl::is_lm_matrix(decoder_name(slot.name), *slot.tensor);
    *slot.tensor = streamed.read(checkpoint, source, full, slot.layout, parallel.tp_rank(), parallel.tp_size(),
                                 lm_matrix ? options.weights_dtype : at::kFloat, *slot.tensor);
    checkpoint.release(source);
  }
  streamed.finish();
  // The decoder's idle tower (never run) gets zeros.
  for (const QwenVl::WeightSlot& slot : decoder.weight_slots()) {
    if (starts_with(slot.name, "visual.")) *slot.tensor = slot.tensor->zero_().to(options.device);
  }
  if (config.tie_word_embeddings) decoder.tie_lm_head();
  model->set_kv_cache_dtype(options.kv_cache_dtype);
  return model;
}

void LlavaNext::save_checkpoint(const std::string& dir) const {
  // Under TP every rank gathers the shards (a collective per weight); rank 0 writes, and all
  // return once the files are written.
  std::map<std::string, at::Tensor> tensors;
  Communicator* comm = lm_->tp_comm_;
  for (const QwenVl::WeightSlot& slot : const_cast<LlavaNext*>(this)->weight_slots()) {
    const at::Tensor full = comm == nullptr ? *slot.tensor : detail::gather_shard(*slot.tensor, slot.layout, *comm);
    tensors.emplace(slot.name, full.to(at::kCPU).contiguous());
  }
  detail::write_checkpoint_once(dir, config_.to_json(), tensors, comm, lm_->parallel().tp_rank());
}

}  // namespace vlmgen
