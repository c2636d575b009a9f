// vlmgen-bench --speed: the model's own forward times on the 100M config, the decode step and the
// prefill as issue "Speed" lists them, per weights dtype, medians of interleaved rounds:
//   KV decode ms/token at contexts 128, 512, 2048 (batch 1); decode throughput at batch 1, 4, 16
//   (context 128); prefill tokens/s of 512- and 2048-token prompts; resident memory against the
//   weights' bytes; the read bandwidth of this machine measured in the same run, and the share of
//   it a decode step reaches (weights + KV bytes read per token). Weights dtypes: f32, bf16 (the
//   same weights rounded) and fp8 (the same weights through vlmgen's quantizer, 128 x 128 blocks,
//   decoder linears and the output head kept as bytes; embedding bf16), each loaded from a
//   checkpoint as a user loads it; bf16 and fp8 again over a bfloat16 and over an FP8 KV cache
//   (kv_cache_dtype), for the decode times over a context.
// vlmgen-bench --memory DTYPE --checkpoint DIR: peak resident memory of one model loaded from DIR
//   (f32, bf16 or fp8) after a 512-token prompt and 9 decode steps, against its weights + KV.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_models.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/kernels/cpu.h"
#include "vlmgen/models/quantization.h"

namespace vlmgen::bench {
namespace {

/// VmRSS (current) and VmHWM (peak) of this process, in MB of 10^6 bytes like the weights' sizes
/// (the kernel's "kB" are KiB; until stop 41 these were MiB, which made the ratios to the weights
/// 4.6% too small).
std::pair<double, double> rss_mb() {
  std::ifstream in("/proc/self/status");
  std::string key;
  double rss = 0, hwm = 0;
  while (in >> key) {
    double kb = 0;
    if (key == "VmRSS:" && in >> kb) rss = kb * 1024.0 / 1e6;
    if (key == "VmHWM:" && in >> kb) hwm = kb * 1024.0 / 1e6;
  }
  return {rss, hwm};
}

/// GB/s of a summing read over a buffer far larger than the caches, on the bench's threads.
double read_bandwidth_gbs() {
  at::Tensor buffer = at::ones({64 * 1024 * 1024});  // 256 MiB
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    auto t = Clock::now();
    volatile float sink = buffer.sum().item<float>();
    (void)sink;
    best = std::max(best, static_cast<double>(buffer.nbytes()) / 1e9 / seconds_since(t));
  }
  return best;
}

/// Forward of `s` tokens per row after `context` cached ones; positions as for text.
at::Tensor step(QwenVl& model, InferenceContext& ctx, const at::Tensor& ids) {
  const int64_t b = ids.size(0), s = ids.size(1), start = ctx.length();
  ForwardArgs args;
  args.input_ids = ids;
  args.position_ids = at::arange(start, start + s, at::kLong).view({1, 1, s}).expand({3, b, s}).contiguous();
  args.attention_mask = at::ones({b, start + s}, at::kLong);
  args.context = &ctx;
  args.window_start = start;
  args.last_column_logits = true;
  at::Tensor logits = model.forward(args);
  ctx.commit(ids, at::ones({b, s}, at::kLong));
  return logits;
}

at::Tensor prompt_ids(const QwenVlConfig& c, int64_t b, int64_t s, uint64_t seed) {
  std::vector<int64_t> flat;
  for (int64_t r = 0; r < b; ++r) {
    std::vector<int64_t> row = text_prompt(s, c, seed + static_cast<uint64_t>(r));
    flat.insert(flat.end(), row.begin(), row.end());
  }
  return at::tensor(flat, at::kLong).view({b, s});
}

/// Mean ms of one KV decode step of `b` rows after a `context`-token prompt (8 steps timed).
double decode_ms(QwenVl& model, int64_t b, int64_t context) {
  const int64_t steps = 8;
  InferenceContext ctx(model.traits().kv_cache, b, context + steps + 1);
  step(model, ctx, prompt_ids(model.config(), b, context, 7));
  at::Tensor next = prompt_ids(model.config(), b, 1, 11);
  step(model, ctx, next);  // warm-up
  auto t = Clock::now();
  for (int64_t i = 0; i < steps; ++i) step(model, ctx, next);
  return seconds_since(t) * 1000.0 / steps;
}

double prefill_tokens_per_s(QwenVl& model, int64_t s) {
  InferenceContext ctx(model.traits().kv_cache, 1, s);
  auto t = Clock::now();
  step(model, ctx, prompt_ids(model.config(), 1, s, 5));
  return static_cast<double>(s) / seconds_since(t);
}

/// Every dtype loaded from a checkpoint of the same weights, as a user loads a model (the loader
/// puts the decode weights on huge pages); FP8 through the quantizer (blocks of 128 x 128, the
/// output head too), computed from the bytes; bf16 and fp8 again over a bfloat16 ("_kv16") and
/// an FP8 ("_kv8") KV cache.
void load_models(std::map<std::string, std::unique_ptr<QwenVl>>& models, std::map<std::string, double>& weight_mb) {
  const std::filesystem::path scratch =
      std::filesystem::temp_directory_path() / fmt::format("vlmgen-bench-{}", static_cast<long>(::getpid()));
  QwenVl(config_100m(), 1).save_checkpoint((scratch / "f32").string());
  QuantizeOptions fp8;
  fp8.quantize_lm_head = true;
  quantize_checkpoint((scratch / "f32").string(), (scratch / "fp8").string(), fp8);
  for (const char* dtype : {"f32", "bf16", "fp8"}) {
    const std::string from = (scratch / (std::string(dtype) == "fp8" ? "fp8" : "f32")).string();
    models[dtype] = QwenVl::from_checkpoint(from, ParallelContext::single(), load_options_for_dtype(dtype));
    weight_mb[dtype] = static_cast<double>(model_bytes(*models[dtype])) / 1e6;
    if (std::string(dtype) == "f32") continue;
    for (const auto& [suffix, kv_dtype] : {std::pair{"_kv16", at::kBFloat16}, std::pair{"_kv8", at::kByte}}) {
      LoadOptions options = load_options_for_dtype(dtype);  // the same weights over a smaller KV cache
      options.kv_cache_dtype = kv_dtype;
      models[dtype + std::string(suffix)] = QwenVl::from_checkpoint(from, ParallelContext::single(), options);
      weight_mb[dtype + std::string(suffix)] = weight_mb[dtype];
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(scratch, ec);
}

/// The decode times of the bfloat16- and FP8-cache models, printed against f32's (and FP8 weights
/// over an FP8 cache against bf16 weights over a bfloat16 one) and added to `out`.
void report_small_kv(std::map<std::string, std::map<std::string, std::vector<double>>>& runs, nlohmann::json& out) {
  for (const auto& [suffix, title] : {std::pair{"_kv16", "with a bfloat16 KV cache (medians)"},
                                      std::pair{"_kv8", "with an FP8 KV cache (medians)"}}) {
    const std::string bf16 = std::string("bf16") + suffix, fp8 = std::string("fp8") + suffix;
    fmt::print("\n{:<34}{:>10}{:>10}{:>10}{:>10}\n", title, "bf16", "speedup", "fp8", "speedup");
    for (const int64_t ctx : {128, 512, 2048}) {
      const std::string name = fmt::format("decode ms/token, context {}", ctx);
      const double f = median(runs[name]["f32"]), h = median(runs[name][bf16]), e = median(runs[name][fp8]);
      fmt::print("{:<34}{:>10.2f}{:>9.2f}x{:>10.2f}{:>9.2f}x\n", name, h, f / h, e, f / e);
      for (const std::string& dtype : {bf16, fp8}) {
        out[name][dtype] = median(runs[name][dtype]);
        out[name]["rounds_" + dtype] = runs[name][dtype];
      }
    }
  }
  for (const int64_t ctx : {128, 512, 2048}) {
    const std::string name = fmt::format("decode ms/token, context {}", ctx);
    fmt::print("context {}: fp8 weights over an FP8 cache {:.2f}x the speed of bf16 weights over a bfloat16 one\n", ctx,
               median(runs[name]["bf16_kv16"]) / median(runs[name]["fp8_kv8"]));
  }
}

}  // namespace

int run_memory_report(const std::string& dtype, const std::string& checkpoint) {
  const auto [rss_start, hwm_start] = rss_mb();
  std::unique_ptr<QwenVl> model =
      QwenVl::from_checkpoint(checkpoint, ParallelContext::single(), load_options_for_dtype(dtype));
  const double weights = static_cast<double>(model_bytes(*model)) / 1e6;
  const QwenVlConfig& c = model->config();
  const int64_t context = 512;
  decode_ms(*model, 1, context);  // a prompt, a warm-up step and 8 decode steps: context + 9 columns
  const double kv = 2.0 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * (context + 9) * 4 / 1e6;
  const auto [rss, hwm] = rss_mb();
  nlohmann::json out = {{"dtype", dtype},
                        {"peak_rss_mb", hwm},
                        {"start_rss_mb", rss_start},
                        {"weights_mb", weights},
                        {"kv_mb", kv},
                        {"context", context},
                        {"peak_over_weights_and_kv", (hwm - rss_start) / (weights + kv)}};
  fmt::print("{}\n", out.dump());
  return 0;
}

int run_speed_report(int rounds, const std::string& json_path) {
  fmt::print(
      "vlmgen-bench --speed: 100M Qwen2-VL LM, {} thread(s) (ATen and OpenBLAS), kernels: {} (supported: {}), few-row "
      "products {}\n",
      at::get_num_threads(), kernels_enabled() ? kernels::isa_name(kernels::active_isa()) : "off (ATen)",
      fmt::join(supported_isa_names(), ", "),
      kernels::streams_weight_rows() ? "stream weight rows" : "read tiles of weight rows");
  const double bandwidth = read_bandwidth_gbs();
  const auto [rss_before, hwm_before] = rss_mb();
  std::map<std::string, std::unique_ptr<QwenVl>> models;
  std::map<std::string, double> weight_mb;
  load_models(models, weight_mb);
  const auto [rss_after, hwm_after] = rss_mb();

  // figure -> dtype -> rounds
  std::map<std::string, std::map<std::string, std::vector<double>>> runs;
  const std::vector<std::pair<std::string, std::function<double(QwenVl&)>>> figures = {
      {"decode ms/token, context 128", [](QwenVl& m) { return decode_ms(m, 1, 128); }},
      {"decode ms/token, context 512", [](QwenVl& m) { return decode_ms(m, 1, 512); }},
      {"decode ms/token, context 2048", [](QwenVl& m) { return decode_ms(m, 1, 2048); }},
      {"decode tokens/s, batch 1", [](QwenVl& m) { return 1000.0 / decode_ms(m, 1, 128); }},
      {"decode tokens/s, batch 4", [](QwenVl& m) { return 4 * 1000.0 / decode_ms(m, 4, 128); }},
      {"decode tokens/s, batch 16", [](QwenVl& m) { return 16 * 1000.0 / decode_ms(m, 16, 128); }},
      {"prefill tokens/s, 512 tokens", [](QwenVl& m) { return prefill_tokens_per_s(m, 512); }},
      {"prefill tokens/s, 2048 tokens", [](QwenVl& m) { return prefill_tokens_per_s(m, 2048); }},
  };
  for (auto& [dtype, m] : models) decode_ms(*m, 1, 128);  // first touch of every buffer, not timed
  for (int round = 0; round < rounds; ++round) {
    for (auto& [name, fn] : figures) {
      for (auto& [dtype, m] : models) {
        // The bfloat16- and FP8-cache models: the decode times over a context only.
        if (dtype.find("_kv") != std::string::npos && name.find("context") == std::string::npos) continue;
        runs[name][dtype].push_back(fn(*m));
      }
    }
  }
  nlohmann::json out;
  fmt::print("\n{:<34}{:>10}{:>10}{:>10}{:>11}{:>11}\n", "figure (medians)", "f32", "bf16", "fp8", "speedup",
             "speedup");
  fmt::print("{:<34}{:>30}{:>11}{:>11}\n", "", "", "bf16", "fp8");
  for (auto& [name, fn] : figures) {
    const double f = median(runs[name]["f32"]), h = median(runs[name]["bf16"]), e = median(runs[name]["fp8"]);
    const bool time = name.find("ms/") != std::string::npos;
    fmt::print("{:<34}{:>10.2f}{:>10.2f}{:>10.2f}{:>10.2f}x{:>10.2f}x\n", name, f, h, e, time ? f / h : h / f,
               time ? f / e : e / f);
    out[name] = {{"f32", f},
                 {"bf16", h},
                 {"fp8", e},
                 {"rounds_f32", runs[name]["f32"]},
                 {"rounds_bf16", runs[name]["bf16"]},
                 {"rounds_fp8", runs[name]["fp8"]}};
  }
  report_small_kv(runs, out);
  auto ratio = [&](const std::string& a, const std::string& b, const char* dtype) {
    return median(runs[a][dtype]) / median(runs[b][dtype]);
  };
  for (const char* dtype : {"f32", "bf16"}) {
    fmt::print(
        "{}: decode 2048 / 128 = {:.2f}x (target <= 1.25x); batch 4 / 1 = {:.2f}x (>= 3x), batch 16 / 1 = "
        "{:.2f}x (>= 8x)\n",
        dtype, ratio("decode ms/token, context 2048", "decode ms/token, context 128", dtype),
        ratio("decode tokens/s, batch 4", "decode tokens/s, batch 1", dtype),
        ratio("decode tokens/s, batch 16", "decode tokens/s, batch 1", dtype));
  }
  // Bytes one decode step reads: the LM's matrices and norms (one embedding row) plus K and V.
  const QwenVlConfig c = config_100m();
  for (int64_t ctx : {128, 2048}) {
    const double kv_mb = 2.0 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * ctx * 4 / 1e6;
    for (const char* dtype : {"f32", "bf16", "fp8"}) {
      const double mb = decode_bytes(*models[dtype]) / 1e6 + kv_mb;
      const double ms = median(runs[fmt::format("decode ms/token, context {}", ctx)][dtype]);
      fmt::print("{} context {}: {:.0f} MB read per token at {:.1f} GB/s = {:.0f}% of the {:.1f} GB/s read bandwidth\n",
                 dtype, ctx, mb, mb / ms, 100.0 * mb / ms / bandwidth, bandwidth);
    }
  }
  double all_weights = 0;
  for (const auto& [dtype, mb] : weight_mb) all_weights += mb;
  fmt::print(
      "memory: weights of the {} models {:.0f} MB (f32 {:.0f} MB, bf16 {:.0f} MB, fp8 {:.0f} MB, the _kv16 and "
      "_kv8 ones again); RSS {:.0f} MB before the models, {:.0f} MB after (peak {:.0f} MB): {:.2f}x the weights\n",
      weight_mb.size(), all_weights, weight_mb["f32"], weight_mb["bf16"], weight_mb["fp8"], rss_before, rss_after,
      hwm_after, (rss_after - rss_before) / all_weights);
  out["read_bandwidth_gbs"] = bandwidth;
  out["rss_mb"] = {{"before", rss_before}, {"after", rss_after}, {"peak", hwm_after}};
  out["weights_mb"] = weight_mb;
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}

}  // namespace vlmgen::bench
