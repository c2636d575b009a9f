#pragma once
// FP8 checkpoints: the three formats people download, mapped to one description, and the
// quantizer that writes them.
//
//   HF fine-grained FP8 (config.json quantization_config: quant_method "fp8", weight_block_size
//     [128, 128], modules_to_not_convert): `X.weight` F8_E4M3, `X.weight_scale_inv` F32 with one
//     scale per block ([ceil(out/128), ceil(in/128)]) — the official Qwen3-VL FP8 releases.
//     Without weight_block_size (vLLM's and AutoFP8's "fp8"; ignored_layers): one `X.weight_scale`
//     per tensor.
//   ModelOpt FP8 (hf_quant_config.json, or quantization_config with quant_method "modelopt" or
//     quant_library "modelopt"; quant_algo FP8 | FP8_PER_CHANNEL_PER_TOKEN | FP8_PB_WO with
//     group_size, exclude_modules or ignore): `X.weight_scale` per tensor, per output channel or
//     per block, `X.input_scale` for FP8.
//   compressed-tensors (quant_method "compressed-tensors", format float-quantized, config_groups
//     with 8-bit float weights, strategy tensor | channel | block, ignore): `X.weight_scale`.
//
// In all three the stored scale multiplies the decoded FP8 value: w = fp8(byte) * scale. vlmgen
// dequantizes the weights when it loads them; activations stay in the compute dtype, so input
// scales (static activation quantization) and FP8 KV-cache scales are read past, not applied —
// keeping activations and the KV cache in higher precision than the format asks for.

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "vlmgen/io/fp8.h"

namespace vlmgen {

enum class QuantFormat { kHfFineGrained, kModelOpt, kCompressedTensors };
enum class ScaleGranularity { kPerTensor, kPerChannel, kPerBlock };
/// How a stored scale turns a decoded FP8 value into the weight.
enum class ScaleUse { kMultiply, kDivide };

const char* to_string(QuantFormat format);

/// An FP8 weight's scales as multipliers on a grid of blocks: weight(o, i) = fp8(byte) *
/// grid[o / block_out][i / block_in] (per tensor: one block of the whole weight; per output
/// channel: blocks of one row).
struct Fp8ScaleGrid {
  at::Tensor grid;  ///< [ceil(out / block_out), ceil(in / block_in)], float32, CPU
  int64_t block_out = 1;
  int64_t block_in = 1;
};

/// One checkpoint's FP8 scheme.
struct QuantizationScheme {
  QuantFormat format = QuantFormat::kHfFineGrained;
  Fp8Format fp8 = Fp8Format::kE4M3;
  ScaleGranularity granularity = ScaleGranularity::kPerBlock;
  std::array<int64_t, 2> block = {128, 128};      ///< [output rows, input columns] per scale (kPerBlock)
  std::string scale_suffix = "weight_scale_inv";  ///< next to `weight`: `X.weight` -> `X.<suffix>`
  ScaleUse scale_use = ScaleUse::kMultiply;
  std::string algorithm;  ///< as the file names it (quant_method / quant_algo / strategy), for messages

  /// Module patterns the checkpoint keeps unquantized, in the format's own matching rule: HF
  /// matches a pattern anywhere in the module name, ModelOpt with shell wildcards (fnmatch),
  /// compressed-tensors by exact name or, with a "re:" prefix, by a regular expression matched
  /// from the start of the name (Python's re.match).
  std::vector<std::string> excluded;
  bool is_excluded(const std::string& module) const;

  /// The scheme of checkpoint folder `dir` (config.json's quantization_config, else
  /// hf_quant_config.json), or nullopt for an unquantized checkpoint. A scheme vlmgen cannot load
  /// faithfully (INT4/INT8, NVFP4, MXFP8, ...) is a vlmgen::Error naming it.
  static std::optional<QuantizationScheme> from_checkpoint(const std::string& dir);
  /// The same from the two files' text (either may be empty).
  static std::optional<QuantizationScheme> from_json(const std::string& config_json, const std::string& hf_quant_json);

  /// The shape the scale of a [rows, cols] weight must have (a scalar: {}).
  std::vector<int64_t> scale_shape(const std::vector<int64_t>& weight_shape) const;

  /// Float32 weights from FP8 bytes ([rows, cols], or any shape per tensor) and their scale.
  /// Checks the scale's shape and values (finite, >= 0), naming `name`.
  at::Tensor dequantize(const at::Tensor& bytes, const at::Tensor& scale, const std::string& name) const;

  /// The scale of a 2-D FP8 weight of `shape` as a multiplier grid (a dividing scale inverted),
  /// checked like dequantize does, for computing from the bytes as they are.
  Fp8ScaleGrid scale_grid(const std::vector<int64_t>& shape, const at::Tensor& scale, const std::string& name) const;

  /// `scale` as float32 on the CPU, its shape and values checked for a weight of `shape`.
  at::Tensor checked_scale(const std::vector<int64_t>& shape, const at::Tensor& scale, const std::string& name) const;
};

/// Options of quantize_checkpoint.
struct QuantizeOptions {
  /// kHfFineGrained (per block) or kModelOpt (per tensor, with quant_algo FP8).
  QuantFormat format = QuantFormat::kHfFineGrained;
  std::array<int64_t, 2> block = {128, 128};
  /// Quantize the token embedding too (it stays in its dtype by default).
  bool quantize_embedding = false;
  /// Quantize the output head too (it stays in its dtype by default, as the official FP8
  /// releases keep it; a tied head is stored nowhere and stays the embedding). vlmgen's fp8 mode
  /// then reads it as bytes too: a decode step's largest single read halves against bf16.
  bool quantize_lm_head = false;
  /// Called after each tensor: (index from 1, count, name, quantized or copied).
  std::function<void(size_t, size_t, const std::string&, bool)> progress;
};

/// What quantize_checkpoint wrote.
struct QuantizeReport {
  int64_t quantized = 0;  ///< tensors written as FP8
  int64_t kept = 0;       ///< tensors copied in their dtype
  int64_t bytes_in = 0;
  int64_t bytes_out = 0;
};

/// Writes an FP8 copy of the F32/F16/BF16 checkpoint in `in_dir` to `out_dir` (a new or empty
/// folder): the 2-D linear
/// weights of the language model as E4M3 with scales from their own absolute maximum
/// (scale = amax / 448 per block or per tensor; an all-zero block gets scale 1), everything
/// else (vision tower, norms, biases, the embedding and lm_head unless asked) in its dtype. A
/// tied lm_head (stored nowhere) is left alone. config.json gets the format's
/// quantization_config (ModelOpt: hf_quant_config.json too); the folder's other files
/// (tokenizer, preprocessor and chat settings) are copied.
QuantizeReport quantize_checkpoint(const std::string& in_dir, const std::string& out_dir,
                                   const QuantizeOptions& options = QuantizeOptions());

}  // namespace vlmgen
