// FP8 checkpoint formats: detection (config.json, hf_quant_config.json), exclusion rules, scale
// checks and dequantization. The quantizer that writes them is in quantizer.cpp.

#include "vlmgen/models/quantization.h"

#define PCRE2_CODE_UNIT_WIDTH 8

#include <fmt/format.h>
#include <fnmatch.h>
#include <pcre2.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <memory>

#include "../io/json_parse.h"
#include "quantization_internal.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/io/files.h"

namespace vlmgen {
namespace {

using Json = nlohmann::json;
using detail::kMaxQuantConfigBytes;

std::vector<std::string> string_list(const Json& object, const char* key, const std::string& where) {
  std::vector<std::string> out;
  if (!object.contains(key) || object.at(key).is_null()) return out;
  const Json& list = object.at(key);
  VLMGEN_CHECK(list.is_array(), "{}: {} must be a list of module names, got {}", where, key,
               detail::json_excerpt(list));
  for (const Json& item : list) {
    VLMGEN_CHECK(item.is_string(), "{}: {} must hold strings, got {}", where, key, detail::json_excerpt(item));
    out.push_back(item.get<std::string>());
  }
  return out;
}

std::string string_or(const Json& object, const char* key, const std::string& fallback, const std::string& where) {
  if (!object.contains(key) || object.at(key).is_null()) return fallback;
  VLMGEN_CHECK(object.at(key).is_string(), "{}: {} must be a string, got {}", where, key,
               detail::json_excerpt(object.at(key)));
  return object.at(key).get<std::string>();
}

std::array<int64_t, 2> block_of(const Json& value, const std::string& where, const char* key) {
  VLMGEN_CHECK(value.is_array() && value.size() == 2 && value[0].is_number_integer() && value[1].is_number_integer(),
               "{}: {} must be two positive integers [rows, columns], got {}", where, key, detail::json_excerpt(value));
  const std::array<int64_t, 2> block = {value[0].get<int64_t>(), value[1].get<int64_t>()};
  VLMGEN_CHECK(block[0] >= 1 && block[1] >= 1 && block[0] <= (1 << 16) && block[1] <= (1 << 16),
               "{}: {} must be two integers in [1, 65536], got [{}, {}]", where, key, block[0], block[1]);
  return block;
}

/// PCRE2's message for an error code.
std::string pcre2_text(int code) {
  PCRE2_UCHAR buffer[256];
  return pcre2_get_error_message(code, buffer, sizeof buffer) < 0 ? fmt::format("error {}", code)
                                                                  : reinterpret_cast<const char*>(buffer);
}

/// A compressed-tensors "re:" pattern (a Python regular expression applied with re.match) as
/// Python reads it: anchored at the module name's start only, "(?i)" and the like inline. "{,n}"
/// (0 to n times in Python, a literal in this PCRE2) is refused rather than read otherwise. PCRE2 with a match limit: a
/// pattern that backtracks without end (such as "(.|.)*#", which kept std::regex busy for minutes on one name) is a
/// vlmgen::Error naming it, not a hang.
class ModulePattern {
 public:
  ModulePattern(const std::string& pattern, const std::string& what) : pattern_(pattern), what_(what) {
    VLMGEN_CHECK(pattern.size() <= kMaxPatternBytes, "{} is {} bytes long; expected at most {}", what, pattern.size(),
                 kMaxPatternBytes);
    VLMGEN_CHECK(pattern.find("{,") == std::string::npos,
                 "{} '{}' uses {{,n}}, which this regex engine reads as text where Python reads 0 to n times; "
                 "write {{0,n}}",
                 what, quote_excerpt(pattern, 60));
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_ANCHORED | PCRE2_UTF,
                              &error, &offset, nullptr));
    VLMGEN_CHECK(code_ != nullptr, "{} '{}' is not a regular expression vlmgen can read: {} at offset {}", what,
                 quote_excerpt(pattern, 60), pcre2_text(error), offset);
  }

  bool matches(const std::string& module) const {
    const std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> data(
        pcre2_match_data_create_from_pattern(code_.get(), nullptr), pcre2_match_data_free);
    const std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> context(
        pcre2_match_context_create(nullptr), pcre2_match_context_free);
    VLMGEN_CHECK(data != nullptr && context != nullptr, "{}: out of memory for a regex match", what_);
    pcre2_set_match_limit(context.get(), kMatchLimit);
    pcre2_set_depth_limit(context.get(), kMatchLimit);
    const int rc = pcre2_match(code_.get(), reinterpret_cast<PCRE2_SPTR>(module.data()), module.size(), 0, 0,
                               data.get(), context.get());
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    VLMGEN_CHECK(rc >= 0, "{} '{}' could not be matched against module {}: {} (a pattern that backtracks too much?)",
                 what_, quote_excerpt(pattern_, 60), quote_excerpt(module, 60), pcre2_text(rc));
    return true;
  }

 private:
  static constexpr size_t kMaxPatternBytes = 4096;
  static constexpr uint32_t kMatchLimit = 1000000;  // backtracking steps a name; real patterns take a few hundred
  std::unique_ptr<pcre2_code, decltype(&pcre2_code_free)> code_{nullptr, pcre2_code_free};
  std::string pattern_, what_;
};

const char* kSupported =
    "vlmgen loads FP8 weights in three formats: quant_method 'fp8' (HF fine-grained, per block), ModelOpt "
    "quant_algo FP8, FP8_PER_CHANNEL_PER_TOKEN or FP8_PB_WO, and compressed-tensors with 8-bit float weights";

QuantizationScheme hf_fine_grained(const Json& q, const std::string& where) {
  QuantizationScheme s;
  s.format = QuantFormat::kHfFineGrained;
  s.algorithm = "fp8";
  const std::string fmt_name = string_or(q, "fmt", "e4m3", where);
  VLMGEN_CHECK(fmt_name == "e4m3" || fmt_name == "e5m2", "{}: fmt must be 'e4m3' or 'e5m2', got '{}'", where, fmt_name);
  s.fp8 = fmt_name == "e4m3" ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
  const std::string activations = string_or(q, "activation_scheme", "dynamic", where);
  VLMGEN_CHECK(activations == "dynamic" || activations == "static",
               "{}: activation_scheme must be 'dynamic' or 'static', got '{}'", where, quote_excerpt(activations, 20));
  if (q.contains("weight_block_size") && !q.at("weight_block_size").is_null()) {
    // HF's fine-grained FP8: a scale per block, named weight_scale_inv.
    s.granularity = ScaleGranularity::kPerBlock;
    s.block = block_of(q.at("weight_block_size"), where, "weight_block_size");
    s.scale_suffix = "weight_scale_inv";
  } else {
    // Without a block size (vLLM's and AutoFP8's "fp8"): one weight_scale per tensor.
    s.granularity = ScaleGranularity::kPerTensor;
    s.scale_suffix = "weight_scale";
  }
  s.excluded = string_list(q, "modules_to_not_convert", where);
  for (const std::string& m : string_list(q, "ignored_layers", where)) s.excluded.push_back(m);
  return s;
}

QuantizationScheme modelopt(const Json& q, const std::string& where) {
  QuantizationScheme s;
  s.format = QuantFormat::kModelOpt;
  VLMGEN_CHECK(q.contains("quant_algo") && q.at("quant_algo").is_string(), "{}: quant_algo (a string) is missing",
               where);
  s.algorithm = q.at("quant_algo").get<std::string>();
  std::string algo = s.algorithm;
  for (char& c : algo) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  s.scale_suffix = "weight_scale";
  if (algo == "FP8") {
    s.granularity = ScaleGranularity::kPerTensor;
  } else if (algo == "FP8_PER_CHANNEL_PER_TOKEN") {
    s.granularity = ScaleGranularity::kPerChannel;
  } else if (algo == "FP8_PB_WO") {
    s.granularity = ScaleGranularity::kPerBlock;
    if (q.contains("group_size") && !q.at("group_size").is_null()) {  // square blocks, as ModelOpt records them
      VLMGEN_CHECK(q.at("group_size").is_number_integer(), "{}: group_size must be an integer", where);
      s.block = block_of(Json::array({q.at("group_size"), q.at("group_size")}), where, "group_size");
    }
    for (const char* key : {"block_size", "weight_block_size"}) {
      if (q.contains(key) && !q.at(key).is_null()) s.block = block_of(q.at(key), where, key);
    }
  } else {
    VLMGEN_FAIL("{}: ModelOpt quant_algo '{}' is not supported; {}", where, quote_excerpt(s.algorithm, 40), kSupported);
  }
  s.excluded = string_list(q, "exclude_modules", where);
  for (const std::string& m : string_list(q, "ignore", where)) s.excluded.push_back(m);
  return s;
}

QuantizationScheme compressed_tensors(const Json& q, const std::string& where) {
  QuantizationScheme s;
  s.format = QuantFormat::kCompressedTensors;
  s.scale_suffix = "weight_scale";
  const std::string format = string_or(q, "format", "float-quantized", where);
  VLMGEN_CHECK(format == "float-quantized" || format == "naive-quantized",
               "{}: compressed-tensors format '{}' is not supported (FP8 checkpoints are 'float-quantized'); {}", where,
               quote_excerpt(format, 40), kSupported);
  VLMGEN_CHECK(q.contains("config_groups") && q.at("config_groups").is_object() && !q.at("config_groups").empty(),
               "{}: config_groups (an object of quantization groups) is missing", where);
  bool first = true;
  for (const auto& [group_name, group] : q.at("config_groups").items()) {
    const std::string at = fmt::format("{}: config_groups.{}", where, quote_excerpt(group_name, 40));
    VLMGEN_CHECK(group.is_object() && group.contains("weights") && group.at("weights").is_object(),
                 "{}: weights (an object) is missing", at);
    const Json& w = group.at("weights");
    const int64_t bits =
        w.contains("num_bits") && w.at("num_bits").is_number_integer() ? w.at("num_bits").get<int64_t>() : 0;
    const std::string type = string_or(w, "type", "", at);
    VLMGEN_CHECK(bits == 8 && type == "float", "{}: weights of {} bits of type '{}' are not supported; {}", at, bits,
                 quote_excerpt(type, 20), kSupported);
    const std::string strategy = string_or(w, "strategy", "tensor", at);
    ScaleGranularity g;
    std::array<int64_t, 2> block = {128, 128};
    if (strategy == "tensor") {
      g = ScaleGranularity::kPerTensor;
    } else if (strategy == "channel") {
      g = ScaleGranularity::kPerChannel;
    } else if (strategy == "block") {
      g = ScaleGranularity::kPerBlock;
      VLMGEN_CHECK(w.contains("block_structure"), "{}: strategy 'block' needs block_structure", at);
      block = block_of(w.at("block_structure"), at, "block_structure");
    } else {
      VLMGEN_FAIL("{}: weight strategy '{}' is not supported (tensor, channel or block)", at,
                  quote_excerpt(strategy, 20));
    }
    if (group.contains("input_activations") && !group.at("input_activations").is_null()) {
      const Json& a = group.at("input_activations");
      const int64_t abits =
          a.contains("num_bits") && a.at("num_bits").is_number_integer() ? a.at("num_bits").get<int64_t>() : 0;
      VLMGEN_CHECK(abits == 8 && string_or(a, "type", "", at) == "float",
                   "{}: input activations other than 8-bit float are not supported", at);
    }
    VLMGEN_CHECK(first || (g == s.granularity && block == s.block),
                 "{}: the groups quantize weights differently ({} vs {}); vlmgen loads one scheme per checkpoint", at,
                 strategy, s.algorithm);
    s.granularity = g;
    s.block = block;
    s.algorithm = strategy;
    first = false;
  }
  s.excluded = string_list(q, "ignore", where);
  for (const std::string& p : s.excluded) {
    if (p.rfind("re:", 0) == 0) ModulePattern(p.substr(3), where + ": ignore pattern");
  }
  return s;
}

// Shell-wildcard match (ModelOpt's exclude_modules).
bool glob_match(const std::string& pattern, const std::string& name) {
  return ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

}  // namespace

const char* to_string(QuantFormat format) {
  switch (format) {
    case QuantFormat::kHfFineGrained: return "HF fine-grained FP8";
    case QuantFormat::kModelOpt: return "ModelOpt FP8";
    case QuantFormat::kCompressedTensors: return "compressed-tensors FP8";
  }
  return "?";
}

bool QuantizationScheme::is_excluded(const std::string& module) const {
  for (const std::string& p : excluded) {
    switch (format) {
      case QuantFormat::kHfFineGrained:
        if (module.find(p) != std::string::npos) return true;
        break;
      case QuantFormat::kModelOpt:
        if (glob_match(p, module)) return true;
        break;
      case QuantFormat::kCompressedTensors:
        if (p.rfind("re:", 0) == 0) {
          if (ModulePattern(p.substr(3), "compressed-tensors ignore pattern").matches(module)) {
            return true;
          }
        } else if (module == p) {
          return true;
        }
        break;
    }
  }
  return false;
}

std::optional<QuantizationScheme> QuantizationScheme::from_json(const std::string& config_json,
                                                                const std::string& hf_quant_json) {
  if (!config_json.empty()) {
    const Json config = detail::parse_json(config_json, "config.json");
    if (config.is_object() && config.contains("quantization_config") && !config.at("quantization_config").is_null()) {
      const Json& q = config.at("quantization_config");
      const std::string where = "config.json quantization_config";
      VLMGEN_CHECK(q.is_object(), "{} must be an object, got {}", where, detail::json_excerpt(q));
      const std::string method = string_or(q, "quant_method", "", where);
      // Older ModelOpt exports name the library, not a method; hf_quant_config.json says the rest.
      if (method.empty() && string_or(q, "quant_library", "", where) == "modelopt") {
        if (!hf_quant_json.empty()) return from_json("", hf_quant_json);
        return modelopt(q, where);
      }
      if (method == "fp8") return hf_fine_grained(q, where);
      if (method == "modelopt") return modelopt(q, where);
      if (method == "compressed-tensors") return compressed_tensors(q, where);
      VLMGEN_FAIL("{}: quant_method '{}' is not supported; {}", where, quote_excerpt(method, 40), kSupported);
    }
  }
  if (!hf_quant_json.empty()) {
    const Json hf = detail::parse_json(hf_quant_json, "hf_quant_config.json");
    const std::string where = "hf_quant_config.json quantization";
    VLMGEN_CHECK(hf.is_object() && hf.contains("quantization") && hf.at("quantization").is_object(),
                 "hf_quant_config.json must hold a 'quantization' object");
    return modelopt(hf.at("quantization"), where);
  }
  return std::nullopt;
}

std::optional<QuantizationScheme> QuantizationScheme::from_checkpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path root(dir);
  const std::string config =
      read_regular_file((root / "config.json").string(), "config file", kMaxQuantConfigBytes * 16);
  std::string hf_quant;
  if (file_exists((root / "hf_quant_config.json").string(), "hf_quant_config.json")) {
    hf_quant =
        read_regular_file((root / "hf_quant_config.json").string(), "hf_quant_config.json", kMaxQuantConfigBytes);
  }
  try {
    return from_json(config, hf_quant);
  } catch (const Error& e) {
    VLMGEN_FAIL("checkpoint {}: {}", dir, e.what());
  }
}

std::vector<int64_t> QuantizationScheme::scale_shape(const std::vector<int64_t>& weight_shape) const {
  switch (granularity) {
    case ScaleGranularity::kPerTensor: return {};
    case ScaleGranularity::kPerChannel: return {weight_shape.at(0)};
    case ScaleGranularity::kPerBlock:
      return {(weight_shape.at(0) + block[0] - 1) / block[0], (weight_shape.at(1) + block[1] - 1) / block[1]};
  }
  return {};
}

at::Tensor QuantizationScheme::checked_scale(const std::vector<int64_t>& shape, const at::Tensor& scale,
                                             const std::string& name) const {
  VLMGEN_CHECK(scale.defined() && at::isFloatingType(scale.scalar_type()),
               "the scale of FP8 tensor {} must be a float tensor, got {}", name,
               scale.defined() ? c10::toString(scale.scalar_type()) : "none");
  VLMGEN_CHECK(granularity == ScaleGranularity::kPerTensor || shape.size() == 2,
               "FP8 tensor {} is [{}]; {} scales ({}) need a 2-D weight", name, fmt::join(shape, ", "),
               granularity == ScaleGranularity::kPerBlock ? "per-block" : "per-channel", algorithm);
  const std::vector<int64_t> want = scale_shape(shape);
  at::Tensor s = scale.to(at::kCPU, at::kFloat);
  // Producers write a per-tensor scale as [] or [1], and a per-channel one as [out] or [out, 1].
  bool ok = s.sizes().vec() == want;
  if (!ok && granularity == ScaleGranularity::kPerTensor) ok = s.numel() == 1;
  if (!ok && granularity == ScaleGranularity::kPerChannel) ok = s.dim() == 2 && s.size(0) == shape[0] && s.size(1) == 1;
  VLMGEN_CHECK(ok, "the scale of FP8 tensor {} ([{}]) is {} but {} {} scales need [{}]{}", name, fmt::join(shape, ", "),
               detail::shape_str(scale), to_string(format), algorithm, fmt::join(want, ", "),
               granularity == ScaleGranularity::kPerBlock
                   ? fmt::format(" (blocks of {} x {}, rounded up)", block[0], block[1])
                   : std::string());
  if (s.numel() > 0) {
    const auto [lo, hi] = at::aminmax(s);
    const double min = lo.item<double>(), max = hi.item<double>();
    VLMGEN_CHECK(std::isfinite(min) && std::isfinite(max) && min >= 0.0,
                 "the scale of FP8 tensor {} must be finite and >= 0, got values in [{}, {}]", name, min, max);
  }
  return s;
}

Fp8ScaleGrid QuantizationScheme::scale_grid(const std::vector<int64_t>& shape, const at::Tensor& scale,
                                            const std::string& name) const {
  VLMGEN_CHECK(shape.size() == 2, "FP8 tensor {} is [{}]; its bytes are kept only for a 2-D weight", name,
               fmt::join(shape, ", "));
  at::Tensor s = checked_scale(shape, scale, name);
  if (scale_use == ScaleUse::kDivide) s = s.reciprocal();  // a zero scale gives inf, as dividing would
  switch (granularity) {
    case ScaleGranularity::kPerTensor: return {s.reshape({1, 1}).contiguous(), shape[0], shape[1]};
    case ScaleGranularity::kPerChannel: return {s.reshape({shape[0], 1}).contiguous(), 1, shape[1]};
    case ScaleGranularity::kPerBlock: return {s.contiguous(), block[0], block[1]};
  }
  VLMGEN_FAIL("unknown scale granularity of FP8 tensor {}", name);
}

at::Tensor QuantizationScheme::dequantize(const at::Tensor& bytes, const at::Tensor& scale,
                                          const std::string& name) const {
  const std::vector<int64_t> shape = bytes.sizes().vec();
  at::Tensor s = checked_scale(shape, scale, name);
  at::Tensor w = fp8_decode(bytes, fp8);
  if (s.numel() == 0 || w.numel() == 0) return w;
  auto apply = [&](at::Tensor part, const at::Tensor& k) {
    if (scale_use == ScaleUse::kMultiply) {
      part.mul_(k);
    } else {
      part.div_(k);
    }
  };
  switch (granularity) {
    case ScaleGranularity::kPerTensor: apply(w, s.reshape({})); break;
    case ScaleGranularity::kPerChannel: apply(w, s.reshape({shape[0], 1})); break;
    case ScaleGranularity::kPerBlock:
      // One strip of block rows at a time: the scales are expanded along the columns only, so no
      // weight-sized scale tensor is ever made.
      for (int64_t i = 0; i * block[0] < shape[0]; ++i) {
        const int64_t rows = std::min(block[0], shape[0] - i * block[0]);
        apply(w.narrow(0, i * block[0], rows), s[i].repeat_interleave(block[1]).narrow(0, 0, shape[1]));
      }
      break;
  }
  return w;
}

}  // namespace vlmgen
