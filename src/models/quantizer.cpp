// The FP8 quantizer (vlmgen-quantize): an F32/F16/BF16 checkpoint copied with its linear weights
// in E4M3, written in the HF fine-grained (per block) or ModelOpt (per tensor) format. The formats
// themselves (detection, dequantization) are in quantization.cpp.

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include "../io/json_parse.h"
#include "quantization_internal.h"
#include "vlmgen/error.h"
#include "vlmgen/io/files.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/models/quantization.h"
#include "vlmgen/version.h"

namespace vlmgen {
namespace {

using Json = nlohmann::json;
using detail::kMaxQuantConfigBytes;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

struct Quantized {
  at::Tensor bytes;  // uint8 E4M3
  at::Tensor scale;  // F32: [] per tensor, [rows/b0, cols/b1] per block
};

Quantized quantize_weight(const at::Tensor& weight, const QuantizeOptions& options) {
  const at::Tensor w = weight.to(at::kCPU, at::kFloat).contiguous();
  if (options.format == QuantFormat::kModelOpt) {
    const float amax = w.abs().max().item<float>();
    const float scale = amax > 0.0f ? amax / kE4M3Max : 1.0f;
    return {fp8_encode_e4m3(w / scale), at::full({}, scale, at::kFloat)};
  }
  const int64_t rows = w.size(0), cols = w.size(1);
  const int64_t b0 = options.block[0], b1 = options.block[1];
  const int64_t gr = (rows + b0 - 1) / b0, gc = (cols + b1 - 1) / b1;
  at::Tensor scale = at::empty({gr, gc}, at::kFloat);
  auto sa = scale.accessor<float, 2>();
  for (int64_t i = 0; i < gr; ++i) {
    for (int64_t j = 0; j < gc; ++j) {
      const at::Tensor block =
          w.narrow(0, i * b0, std::min(b0, rows - i * b0)).narrow(1, j * b1, std::min(b1, cols - j * b1));
      const float amax = block.abs().max().item<float>();
      sa[i][j] = amax > 0.0f ? amax / kE4M3Max : 1.0f;
    }
  }
  const at::Tensor expanded =
      scale.repeat_interleave(b0, 0).narrow(0, 0, rows).repeat_interleave(b1, 1).narrow(1, 0, cols);
  return {fp8_encode_e4m3(w / expanded), scale};
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  VLMGEN_CHECK(out.good(), "cannot open {} for writing", path.string());
  out << text;
  out.close();
  VLMGEN_CHECK(!out.fail(), "writing {} failed", path.string());
}

// The modules a quantized copy of a checkpoint with tensors `names` keeps in their dtype, as
// options.format writes its exclusion patterns.
std::vector<std::string> excluded_modules(const std::vector<std::string>& names, const QuantizeOptions& options) {
  // The module prefixes of those parts as this checkpoint spells them (visual. or model.visual.,
  // model.embed_tokens or model.language_model.embed_tokens): full prefixes match under every
  // rule readers use (substring, start-anchored or wildcard).
  std::vector<std::string> excluded;
  if (!options.quantize_lm_head) excluded.push_back("lm_head");
  auto add_prefix = [&](const std::string& prefix) {
    for (const std::string& name : names) {
      if (name.rfind(prefix + ".", 0) == 0 || name == prefix + ".weight") {
        if (std::find(excluded.begin(), excluded.end(), prefix) == excluded.end()) excluded.push_back(prefix);
        return;
      }
    }
  };
  for (const char* p : {"visual", "model.visual"}) add_prefix(p);
  if (!options.quantize_embedding) {
    for (const char* p : {"model.embed_tokens", "model.language_model.embed_tokens"}) add_prefix(p);
  }
  if (options.format == QuantFormat::kModelOpt) {
    for (std::string& p : excluded) p = p == "lm_head" ? p : p + "*";
  }
  return excluded;
}

}  // namespace

QuantizeReport quantize_checkpoint(const std::string& in_dir, const std::string& out_dir,
                                   const QuantizeOptions& options) {
  namespace fs = std::filesystem;
  VLMGEN_CHECK(options.format == QuantFormat::kHfFineGrained || options.format == QuantFormat::kModelOpt,
               "vlmgen-quantize writes the HF fine-grained (per block) or ModelOpt (per tensor) format, not {}",
               to_string(options.format));
  VLMGEN_CHECK(options.block[0] >= 1 && options.block[1] >= 1 && options.block[0] <= 65536 && options.block[1] <= 65536,
               "block size must be two integers in [1, 65536], got [{}, {}]", options.block[0], options.block[1]);
  const fs::path in(in_dir), out(out_dir);
  std::error_code ec;
  VLMGEN_CHECK(fs::weakly_canonical(in, ec) != fs::weakly_canonical(out, ec),
               "the output folder must differ from the input folder ({})", in_dir);
  const std::string config_text =
      read_regular_file((in / "config.json").string(), "config file", kMaxQuantConfigBytes * 16);
  Json config = detail::parse_json(config_text, "config.json");
  VLMGEN_CHECK(config.is_object(), "{}/config.json must be a JSON object", in_dir);
  VLMGEN_CHECK(!config.contains("quantization_config") &&
                   !file_exists((in / "hf_quant_config.json").string(), "hf_quant_config.json"),
               "checkpoint {} is already quantized; quantize an F32/F16/BF16 checkpoint", in_dir);
  // A fresh folder only: stale shards, indexes or quantization files would mix with the new ones.
  VLMGEN_CHECK(!fs::exists(out, ec) || (fs::is_directory(out, ec) && fs::is_empty(out, ec)),
               "output folder {} exists and is not empty; give a new folder (or remove it)", out_dir);

  // What stays in its dtype: the vision tower, the output head and the embedding unless asked;
  // written as the format's own exclusion patterns, so a loader (vlmgen's or another) agrees.
  SafetensorsCheckpoint checkpoint(in_dir);
  const std::vector<std::string> names = checkpoint.names();
  const std::vector<std::string> excluded = excluded_modules(names, options);
  QuantizationScheme scheme;
  scheme.format = options.format;
  scheme.excluded = excluded;

  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, Fp8Format> fp8;
  QuantizeReport report;
  report.bytes_in = checkpoint.data_bytes();
  const std::string suffix = options.format == QuantFormat::kHfFineGrained ? "weight_scale_inv" : "weight_scale";
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    const SafetensorsEntry& entry = checkpoint.entry(name);
    VLMGEN_CHECK(!entry.fp8, "tensor {} of checkpoint {} is already FP8", name, in_dir);
    // A scale tensor in the input would be written over the scale computed for its weight.
    for (const char* scale : {".weight_scale_inv", ".weight_scale", ".input_scale"})
      VLMGEN_CHECK(!ends_with(name, scale),
                   "tensor {} of checkpoint {} is named like an FP8 scale; expected an F32/F16/BF16 checkpoint without "
                   "quantization tensors",
                   name, in_dir);
    const std::string module = ends_with(name, ".weight") ? name.substr(0, name.size() - 7) : name;
    const bool quantize = ends_with(name, ".weight") && entry.shape.size() == 2 && entry.shape[0] > 0 &&
                          entry.shape[1] > 0 && at::isFloatingType(entry.dtype) &&
                          name.find("norm") == std::string::npos && !scheme.is_excluded(module);
    if (quantize) {
      Quantized q = quantize_weight(checkpoint.tensor(name), options);
      tensors[name] = q.bytes;
      fp8[name] = Fp8Format::kE4M3;
      tensors[module + "." + suffix] = q.scale;
      ++report.quantized;
    } else {
      tensors[name] = checkpoint.tensor(name);
      ++report.kept;
    }
    if (options.progress) options.progress(i + 1, names.size(), name, quantize);
  }
  VLMGEN_CHECK(report.quantized > 0, "checkpoint {} has no 2-D linear weight outside the excluded modules ({})", in_dir,
               fmt::join(excluded, ", "));

  fs::create_directories(out, ec);
  VLMGEN_CHECK(!ec, "cannot create {}: {}", out_dir, ec.message());
  // The folder's other files (tokenizer, preprocessor and chat settings, vocabularies).
  for (const auto& item : fs::directory_iterator(in)) {
    const std::string file = item.path().filename().string();
    if (!item.is_regular_file() || file == "config.json" || ends_with(file, ".safetensors") ||
        file == "model.safetensors.index.json")
      continue;
    fs::copy_file(item.path(), out / file, fs::copy_options::overwrite_existing, ec);
    VLMGEN_CHECK(!ec, "cannot copy {} to {}: {}", item.path().string(), out_dir, ec.message());
  }
  const std::string version = fmt::format("{}.{}.{}", VLMGEN_VERSION_MAJOR, VLMGEN_VERSION_MINOR, VLMGEN_VERSION_PATCH);
  if (options.format == QuantFormat::kHfFineGrained) {
    config["quantization_config"] = {{"quant_method", "fp8"},
                                     {"fmt", "e4m3"},
                                     {"activation_scheme", "dynamic"},
                                     {"weight_block_size", {options.block[0], options.block[1]}},
                                     {"modules_to_not_convert", excluded}};
  } else {
    const Json quantization = {{"quant_algo", "FP8"}, {"kv_cache_quant_algo", nullptr}, {"exclude_modules", excluded}};
    Json hf_quant = {{"producer", {{"name", "vlmgen-quantize"}, {"version", version}}}, {"quantization", quantization}};
    write_text(out / "hf_quant_config.json", hf_quant.dump(2) + "\n");
    Json q = quantization;
    q["quant_method"] = "modelopt";
    config["quantization_config"] = q;
  }
  write_text(out / "config.json", config.dump(2) + "\n");
  save_safetensors((out / "model.safetensors").string(), tensors, {{"format", "pt"}}, fp8);
  for (const auto& [name, t] : tensors) report.bytes_out += static_cast<int64_t>(t.nbytes());
  return report;
}

}  // namespace vlmgen
