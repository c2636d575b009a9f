// Writes an FP8 copy of an F32/F16/BF16 checkpoint folder: the language model's linear weights
// as E4M3 with scales from their own absolute maximum (amax / 448), per 128 x 128 block (HF
// fine-grained FP8, as the official Qwen3-VL FP8 releases) or per tensor (ModelOpt FP8). The
// vision tower, norms, biases, the embedding and lm_head stay as they are unless asked.
//
//   vlmgen-quantize --in DIR --out DIR [--format hf-block|modelopt] [--block 128 128]

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "vlmgen/error.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/models/quantization.h"

int main(int argc, char** argv) {
  CLI::App app("FP8 (E4M3) copy of a checkpoint folder, in the HF fine-grained or ModelOpt format");
  std::string in, out, format = "hf-block";
  std::vector<int64_t> block = {128, 128};
  bool embedding = false, lm_head = false, quiet = false, no_check = false;
  app.add_option("--in", in, "checkpoint folder to read (config.json + *.safetensors)")->required();
  app.add_option("--out", out, "folder to write (new, or empty)")->required();
  app.add_option("--format", format,
                 "hf-block: per-block scales (weight_scale_inv); modelopt: per-tensor (weight_scale)")
      ->check(CLI::IsMember({"hf-block", "modelopt"}))
      ->capture_default_str();
  app.add_option("--block", block, "block rows and columns of hf-block")->expected(2)->capture_default_str();
  app.add_flag("--quantize-embedding", embedding, "quantize the token embedding too");
  app.add_flag("--quantize-lm-head", lm_head,
               "quantize the output head too (an untied one; vlmgen's fp8 mode then reads it as bytes)");
  app.add_flag("--no-check", no_check, "do not load the written checkpoint back");
  app.add_flag("--quiet", quiet, "no progress output");
  CLI11_PARSE(app, argc, argv);
  try {
    vlmgen::QuantizeOptions options;
    options.format = format == "modelopt" ? vlmgen::QuantFormat::kModelOpt : vlmgen::QuantFormat::kHfFineGrained;
    options.block = {block[0], block[1]};
    options.quantize_embedding = embedding;
    options.quantize_lm_head = lm_head;
    if (!quiet) {
      options.progress = [](size_t i, size_t n, const std::string& name, bool quantized) {
        const int width = 30;
        const int done = static_cast<int>(width * i / n);
        fmt::print(stderr, "\r[{}{}] {}/{} {:<60.60}", std::string(done, '#'), std::string(width - done, '.'), i, n,
                   fmt::format("{} {}", quantized ? "fp8 " : "copy", name));
        if (i == n) fmt::print(stderr, "\n");
      };
    }
    const vlmgen::QuantizeReport report = vlmgen::quantize_checkpoint(in, out, options);
    fmt::print("{}: {} tensors as FP8 E4M3 ({}), {} kept; tensor data {:.1f} MB -> {:.1f} MB\n", out, report.quantized,
               vlmgen::to_string(options.format), report.kept, report.bytes_in / 1e6, report.bytes_out / 1e6);
    if (!no_check) {
      vlmgen::load_model(out);  // the written folder loads back (vlmgen::Error otherwise)
      fmt::print("loads back: ok\n");
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "\nerror: {}\n", e.what());
    return 1;
  }
  return 0;
}
