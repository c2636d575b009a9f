// Qwen2-VL checkpoints: HF config.json + safetensors, in either HF tensor-name spelling.

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint_folder.h"
#include "qwen_vl_ops.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/error.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/logging.h"
#include "vlmgen/models/quantization.h"
#include "vlmgen/models/qwen_vl.h"
#include "weight_arena.h"

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

/// The scheme (with the file's FP8 format) and scale tensor name of FP8 tensor `name`, checked:
/// the checkpoint declares a scheme, the tensor is a weight of a module the scheme quantizes, and
/// its scale is there.
std::pair<QuantizationScheme, std::string> fp8_scheme_of(const SafetensorsCheckpoint& checkpoint,
                                                         const std::string& name, Fp8Format format,
                                                         const std::optional<QuantizationScheme>& quantization,
                                                         const std::string& dir) {
  VLMGEN_CHECK(quantization.has_value(),
               "tensor {} in checkpoint {} is {} but the checkpoint declares no quantization (config.json "
               "quantization_config or hf_quant_config.json), so its scales cannot be read",
               name, dir, fp8_dtype_name(format));
  VLMGEN_CHECK(name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0,
               "tensor {} in checkpoint {} is {}, but vlmgen reads FP8 only for weights (X.weight with a scale)", name,
               dir, fp8_dtype_name(format));
  const std::string module = name.substr(0, name.size() - 7);
  VLMGEN_CHECK(!quantization->is_excluded(module),
               "tensor {} in checkpoint {} is {} but the checkpoint's {} excludes module {} from quantization", name,
               dir, fp8_dtype_name(format), to_string(quantization->format), module);
  const std::string scale_name = module + "." + quantization->scale_suffix;
  VLMGEN_CHECK(checkpoint.contains(scale_name), "FP8 tensor {} in checkpoint {} has no scale {} ({})", name, dir,
               scale_name, to_string(quantization->format));
  QuantizationScheme scheme = *quantization;
  scheme.fp8 = format;  // the file's dtype says which of the two formats the bytes are
  return {scheme, scale_name};
}

/// The float32 weight of FP8 tensor `name`: its bytes decoded and multiplied by its scale, as the
/// checkpoint's scheme says. The whole tensor is dequantized, then sharded like any weight, so a
/// per-block scale grid never has to split at a tensor-parallel boundary.
at::Tensor read_fp8_weight(const SafetensorsCheckpoint& checkpoint, const std::string& name, Fp8Format format,
                           const std::optional<QuantizationScheme>& quantization, const std::string& dir) {
  const auto [scheme, scale_name] = fp8_scheme_of(checkpoint, name, format, quantization, dir);
  return scheme.dequantize(checkpoint.tensor(name), checkpoint.tensor(scale_name), name);
}

/// Whether E4M3 bytes hold a NaN (0x7f or 0xff), counted in place: tensor-sized temporaries for
/// every weight would leave holes in the heap that the rest of the load could not reuse (6 MB a
/// layer of the 100M bench model).
bool has_e4m3_nan(const at::Tensor& bytes) {
  const at::Tensor b = bytes.contiguous();
  const uint8_t* p = b.data_ptr<uint8_t>();
  uint8_t nan = 0;
  for (int64_t i = 0, n = b.numel(); i < n; ++i) nan |= static_cast<uint8_t>((p[i] & 0x7f) == 0x7f);
  return nan != 0;
}

/// This rank's slice of FP8 weight `name` as its bytes with their scales (LoadOptions::keep_fp8),
/// read straight into the place `streamed` gives `target` (no second copy of the bytes), or false
/// when its scale blocks do not allow computing from the bytes: an input block that is not a
/// multiple of 16 (the kernels' vector width) or a block that tensor parallelism would split.
bool read_fp8_bytes(const SafetensorsCheckpoint& checkpoint, const std::string& name, Fp8Format format,
                    const std::optional<QuantizationScheme>& quantization, const std::string& dir,
                    qwen_vl::ShardLayout layout, int64_t rank, int64_t tp, detail::StreamedWeights& streamed,
                    const at::Tensor& target, qwen_vl::Linear& linear) {
  const auto [scheme, scale_name] = fp8_scheme_of(checkpoint, name, format, quantization, dir);
  const std::vector<int64_t>& full = checkpoint.entry(name).shape;
  if (full.size() != 2) return false;
  const int64_t out = full[0], in = full[1];
  Fp8ScaleGrid g = scheme.scale_grid({out, in}, checkpoint.tensor(scale_name), name);
  if (g.block_in % 16 != 0 && g.block_in < in) return false;
  if (layout == qwen_vl::ShardLayout::kRows && g.block_out < out) {
    if ((out / tp) % g.block_out != 0) return false;
    g.grid = shard_rows(g.grid, rank, tp);
  } else if (layout == qwen_vl::ShardLayout::kColumns && g.block_in < in) {
    if ((in / tp) % g.block_in != 0) return false;
    g.grid = shard_cols(g.grid, rank, tp);
  } else if (layout == qwen_vl::ShardLayout::kStackedRows && tp > 1) {
    return false;
  }
  const at::Tensor bytes = streamed.read(checkpoint, name, full, layout, rank, tp, at::kByte, target);
  if (format == Fp8Format::kE4M3) {  // the kernels read bytes as halves, where E4M3's NaN would be a number
    // Every rank checks the whole tensor, so all refuse it together (none waits in a collective).
    VLMGEN_CHECK(!has_e4m3_nan(tp > 1 ? checkpoint.tensor(name) : bytes),
                 "FP8 tensor {} in checkpoint {} holds NaN bytes (0x7f or 0xff); E4M3 weights must be finite", name,
                 dir);
  }
  linear.weight = bytes;
  linear.fp8 = kernels::Fp8Scales{g.grid.contiguous(), g.block_out, g.block_in, format == Fp8Format::kE5M2};
  return true;
}

}  // namespace

std::unique_ptr<QwenVl> QwenVl::from_checkpoint(const std::string& dir, const ParallelContext& parallel,
                                                const LoadOptions& options) {
  check_weights_dtype(options.weights_dtype);
  check_kv_cache_dtype(options.kv_cache_dtype, options.device);
  VLMGEN_CHECK(options.device.is_cpu() || !options.keep_fp8,
               "FP8 weights kept as bytes (keep_fp8 / --dtype fp8) compute on the CPU only, but device {} was asked "
               "for; load with --dtype bf16 to dequantize them for that device",
               options.device.str());
  const std::filesystem::path root(dir);
  QwenVlConfig config = QwenVlConfig::from_file((root / "config.json").string());
  // Bounds every size before any arithmetic on it, and a TP size that does not divide the heads
  // fails right away: both before the (possibly large) files are mapped.
  config.validate();
  QwenVl::check_parallel_config(config, parallel);
  const std::optional<QuantizationScheme> quantization = QuantizationScheme::from_checkpoint(dir);
  VLMGEN_CHECK(!options.keep_fp8 || quantization.has_value(),
               "checkpoint {} is not FP8 (config.json declares no quantization_config and there is no "
               "hf_quant_config.json), so its weights cannot be kept as FP8 bytes (keep_fp8 / --dtype fp8); write an "
               "FP8 copy with vlmgen-quantize, or load it as f32/bf16",
               dir);
  SafetensorsCheckpoint checkpoint(dir);
  // Some tied checkpoints leave tie_word_embeddings unset but ship no head: use the embedding.
  if (!checkpoint.contains("lm_head.weight")) config.tie_word_embeddings = true;
  // A config.json that promises more weights than the files hold is refused before the model
  // allocates them (at 2 bytes per weight, the smallest dtype loaded; 1 for FP8 checkpoints).
  const int64_t parameters = config.parameter_count();
  const int64_t min_bytes = quantization ? 1 : 2;
  VLMGEN_CHECK(parameters <= checkpoint.data_bytes() / min_bytes,
               "checkpoint {}: config.json describes {} weights, at least {} bytes as {}, but its safetensors "
               "files hold only {} bytes of tensor data",
               dir, parameters, parameters * min_bytes, quantization ? "FP8" : "F16/BF16", checkpoint.data_bytes());
  std::unique_ptr<QwenVl> model(new QwenVl(config, Uninitialized{}, parallel));

  std::vector<WeightSlot> weights = model->weight_slots();
  std::vector<std::string> sources(weights.size());
  std::vector<std::string> missing;
  for (size_t i = 0; i < weights.size(); ++i) {
    for (const std::string& candidate : name_candidates(weights[i].name)) {
      if (checkpoint.contains(candidate)) {
        sources[i] = candidate;
        break;
      }
    }
    if (sources[i].empty()) missing.push_back(weights[i].name);
  }
  VLMGEN_CHECK(missing.empty(), "checkpoint {} lacks {} of the {} tensors the config needs (either spelling): {}", dir,
               missing.size(), weights.size(), fmt::join(missing, ", "));

  const int64_t rank = parallel.tp_rank();
  const int64_t tp = parallel.tp_size();
  int64_t fp8_kept = 0, fp8_dequantized = 0;
  detail::StreamedWeights streamed(detail::decode_streamed(model->lm_.layers, model->lm_.lm_head), options);
  for (size_t i = 0; i < weights.size(); ++i) {
    at::Tensor* target = weights[i].tensor;
    const SafetensorsEntry& entry = checkpoint.entry(sources[i]);
    const std::vector<int64_t> full = model->full_shape(*target, weights[i].layout);
    VLMGEN_CHECK(entry.shape == full, "tensor {} has shape [{}] in checkpoint {} but the config needs [{}]", sources[i],
                 fmt::join(entry.shape, ", "), dir, fmt::join(full, ", "));
    // The language model's matrices in weights_dtype, read straight into it (no float32 copy of a
    // 16-bit checkpoint); everything else in float32.
    const at::ScalarType dtype = is_lm_matrix(weights[i].name, *target) ? options.weights_dtype : at::kFloat;
    if (entry.fp8 && options.keep_fp8) {
      qwen_vl::Linear head;  // a quantized output head: its bytes and scales, read like a linear's
      qwen_vl::Linear* linear = weights[i].name == "lm_head.weight" ? &head : model->decoder_linear(weights[i].name);
      if (linear != nullptr && read_fp8_bytes(checkpoint, sources[i], *entry.fp8, quantization, dir, weights[i].layout,
                                              rank, tp, streamed, *target, *linear)) {
        if (linear == &head) {
          model->lm_.lm_head = head.weight;
          model->lm_.lm_head_fp8 = head.fp8;
        }
        checkpoint.release(sources[i]);
        ++fp8_kept;
        continue;
      }
      if (linear != nullptr) ++fp8_dequantized;
    }
    if (entry.fp8) {
      *target = detail::take_shard(read_fp8_weight(checkpoint, sources[i], *entry.fp8, quantization, dir),
                                   weights[i].layout, rank, tp)
                    .to(options.device, dtype)
                    .contiguous();
      *target = streamed.place(target, *target);
      checkpoint.release(sources[i]);
      continue;
    }
    VLMGEN_CHECK(entry.dtype == at::kFloat || entry.dtype == at::kHalf || entry.dtype == at::kBFloat16,
                 "tensor {} in checkpoint {} is {}; weights must be F32, F16, BF16 or FP8", sources[i], dir,
                 c10::toString(entry.dtype));
    *target = streamed.read(checkpoint, sources[i], full, weights[i].layout, rank, tp, dtype, *target);
    checkpoint.release(sources[i]);  // copied out: the file's pages need not stay resident beside it
  }
  if (fp8_dequantized > 0) {
    log(LogLevel::kWarning,
        "{}: {} of {} FP8 decoder linears dequantized to {} (their scale blocks do not suit the kernels: an input "
        "block not a multiple of 16, or blocks a tensor-parallel shard of {} ranks would split); {} kept as bytes",
        dir, fp8_dequantized, fp8_kept + fp8_dequantized, c10::toString(options.weights_dtype), tp, fp8_kept);
  }
  streamed.finish();
  if (model->config_.tie_word_embeddings) model->tie_lm_head();
  model->set_kv_cache_dtype(options.kv_cache_dtype);
  return model;
}

void QwenVl::save_checkpoint(const std::string& dir) const {
  // Under TP every rank takes part in gathering each weight; rank 0 writes.
  std::map<std::string, at::Tensor> tensors;
  for (const WeightSlot& slot : const_cast<QwenVl*>(this)->weight_slots()) {
    at::Tensor local = *slot.tensor;
    const qwen_vl::Linear* linear = const_cast<QwenVl*>(this)->decoder_linear(slot.name);
    if (linear != nullptr && linear->fp8.defined())  // written dequantized: the file gets no scales
      local = kernels::widen_on(kernels::active_isa(), local, linear->fp8);
    if (slot.tensor == &lm_.lm_head && lm_.lm_head_fp8.defined())
      local = kernels::widen_on(kernels::active_isa(), local, lm_.lm_head_fp8);
    at::Tensor full = tp_comm_ == nullptr ? local : detail::gather_shard(local, slot.layout, *tp_comm_);
    tensors.emplace(slot.name, full.to(at::kCPU).contiguous());
  }
  write_checkpoint(dir, tensors);
}

void QwenVl::write_checkpoint(const std::string& dir, const std::map<std::string, at::Tensor>& tensors) const {
  detail::write_checkpoint_once(dir, config_.to_json(), tensors, tp_comm_, parallel_.tp_rank());
}

}  // namespace vlmgen
