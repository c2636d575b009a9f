// LLaVA-NeXT checkpoints: HF config.json + safetensors, in either transformers tensor-name spelling.

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint_folder.h"
#include "qwen_vl_ops.h"
#include "vlmgen/error.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/llava_next.h"

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

  // Every weight this model needs, with its layout under tensor parallelism (the tower and the
  // projector are replicated).
  std::map<std::string, QwenVl::WeightSlot> decoder_slots;
  for (const QwenVl::WeightSlot& slot : decoder.weight_slots()) decoder_slots.emplace(slot.name, slot);
  std::vector<std::string> missing;
  std::vector<std::pair<std::string, std::string>> sources;  // (our name, checkpoint name)
  for (const auto& [name, tensor] : model->named_weights()) {
    std::string found;
    for (const std::string& candidate : detail::multimodal_name_candidates(name)) {
      if (checkpoint.contains(candidate)) {
        found = candidate;
        break;
      }
    }
    if (found.empty()) missing.push_back(name);
    sources.emplace_back(name, found);
  }
  VLMGEN_CHECK(missing.empty(),
               "checkpoint {} lacks {} of the {} tensors the llava_next config needs (either "
               "spelling): {}",
               dir, missing.size(), sources.size(), fmt::join(missing, ", "));
  const auto weights = model->named_weights();
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto& [name, target] = weights[i];
    const std::string& source = sources[i].second;
    const SafetensorsEntry& entry = checkpoint.entry(source);
    VLMGEN_CHECK(!entry.fp8, "tensor {} in checkpoint {} is FP8; FP8 checkpoints of llava_next are not implemented",
                 source, dir);
    VLMGEN_CHECK(entry.dtype == at::kFloat || entry.dtype == at::kHalf || entry.dtype == at::kBFloat16,
                 "tensor {} in checkpoint {} is {}; weights must be F32, F16 or BF16", source, dir,
                 c10::toString(entry.dtype));
    const auto slot = decoder_slots.find(decoder_name(name));
    const qwen_vl::ShardLayout layout =
        slot == decoder_slots.end() ? qwen_vl::ShardLayout::kReplicated : slot->second.layout;
    const std::vector<int64_t> full = decoder.full_shape(*target, layout);
    VLMGEN_CHECK(entry.shape == full, "tensor {} has shape [{}] in checkpoint {} but the config needs [{}]", source,
                 fmt::join(entry.shape, ", "), dir, fmt::join(full, ", "));
    const bool lm_matrix = slot != decoder_slots.end() && QwenVl::is_lm_matrix(slot->first, *target);
    *target = detail::take_shard(checkpoint.tensor(source), layout, parallel.tp_rank(), parallel.tp_size())
                  .to(options.device, lm_matrix ? options.weights_dtype : at::kFloat)
                  .contiguous();
    checkpoint.release(source);
  }
  // The decoder's idle tower (never run) gets zeros.
  for (const QwenVl::WeightSlot& slot : decoder.weight_slots()) {
    if (starts_with(slot.name, "visual.")) *slot.tensor = slot.tensor->zero_().to(options.device);
  }
  if (config.tie_word_embeddings) decoder.tie_lm_head();
  return model;
}

void LlavaNext::save_checkpoint(const std::string& dir) const {
  // Under TP the decoder gathers its shards; rank 0 writes.
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, qwen_vl::ShardLayout> layouts;
  for (const QwenVl::WeightSlot& slot : lm_->weight_slots()) layouts.emplace(slot.name, slot.layout);
  for (const auto& [name, tensor] : const_cast<LlavaNext*>(this)->named_weights()) {
    const auto layout = layouts.find(decoder_name(name));
    Communicator* comm = lm_->tp_comm_;
    at::Tensor full =
        comm == nullptr || layout == layouts.end() ? *tensor : detail::gather_shard(*tensor, layout->second, *comm);
    tensors.emplace(name, full.to(at::kCPU).contiguous());
  }
  if (lm_->parallel().tp_rank() != 0) return;
  const std::filesystem::path root(dir);
  std::error_code ec;
  std::filesystem::create_directories(root, ec);
  VLMGEN_CHECK(!ec, "cannot create checkpoint directory {}: {}", dir, ec.message());
  const std::string path = (root / "config.json").string();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  VLMGEN_CHECK(out.good(), "cannot open {} for writing", path);
  out << config_.to_json();
  out.close();
  VLMGEN_CHECK(!out.fail(), "writing {} failed", path);
  save_safetensors((root / "model.safetensors").string(), tensors, {{"format", "pt"}});
}

}  // namespace vlmgen
