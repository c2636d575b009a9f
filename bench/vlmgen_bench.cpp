// vlmgen-bench: speed figures of the generation loop and the reference model.
//
//   vlmgen-bench --report [--json out.json] [--quick] [--threads N]   one table of figures and ratios
//   vlmgen-bench --tokenizer [--mb 10] [--rounds 3]     tokenizer vs the JS implementation
//   vlmgen-bench --families [--rounds 3] [--threads N]   decode ms/token of the 100M LM per model family (ctx
//   128/512/2048) vlmgen-bench --speed [--rounds 3] [--threads N] [--json out.json]   decode/prefill/memory, f32 vs
//   bf16 vlmgen-bench --engine [--rounds 3] [--threads N] [--json out.json]  the engine: 1/4/16 streams, TTFT
//   vlmgen-bench --engine-load --clients C [--requests K] [--prompt-tokens P] [--new-tokens M] [--threads N]
//                                                        engine-only side of bench/serve_load.py (one JSON line)
//   vlmgen-bench --write-checkpoint DIR                  the 100M model as an HF checkpoint (for peers)
//   vlmgen-bench --memory f32|bf16|fp8 --checkpoint DIR  peak RSS of one loaded model (one JSON line)
//   vlmgen-bench [--benchmark_filter=...]               Google Benchmark micro benchmarks
//
// The report measures, in one run: KV-cache and no-cache decode time per token at several
// context lengths (a ~100M-parameter Qwen2-VL config), no-cache generation with an image
// (pixels replayed vs the encoder cache vs a text-only prompt of the same length), the
// generator's overhead over the model's own forward time, and the 100M config's decode speed
// against the memory-bandwidth ceiling measured in the same run.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench_models.h"
#include "vlmgen/build_info.h"
#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/generator.h"
#include "vlmgen/image_spans.h"
#include "vlmgen/models/qwen2_vl.h"
#include "vlmgen/replay_policy.h"
#include "vlmgen/sampling.h"

namespace vlmgen::bench {

int run_tokenizer_report(int64_t megabytes, int rounds);  // tokenizer_report.cpp

namespace {

/// Copy bandwidth in bytes/s (read + write) over a buffer far larger than the caches.
double measure_copy_bandwidth() {
  at::Tensor src = at::rand({64 * 1024 * 1024}), dst = at::empty_like(src);  // 256 MB each
  dst.copy_(src);
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    auto t = Clock::now();
    dst.copy_(src);
    best = std::min(best, seconds_since(t));
  }
  return 2.0 * static_cast<double>(src.nbytes()) / best;
}

struct DecodeFigures {
  double ms_per_token = 0;  // mean forward time of the decode calls (prefill excluded)
  double generate_s = 0;
  double forward_s = 0;
};

/// Generates `new_tokens` after a text prompt of `context` tokens; times the decode calls.
DecodeFigures decode(CausalVlm& model, int64_t context, int64_t new_tokens, bool kv) {
  TimedModel timed(model);
  Generator generator(timed);
  auto prompt = text_prompt(context, first_special_id(model), static_cast<uint64_t>(context));
  auto config = GenerationConfig().max_new_tokens(new_tokens).enable_kv_cache(kv);
  generator.generate({{prompt}}, GenerationConfig().max_new_tokens(2).enable_kv_cache(kv));  // warm-up
  timed.reset();
  auto t = Clock::now();
  generator.generate({{prompt}}, config);
  DecodeFigures f;
  f.generate_s = seconds_since(t);
  f.forward_s = timed.model_seconds();
  const auto& calls = timed.forward_seconds();
  double decode_s = 0;
  for (size_t i = 1; i < calls.size(); ++i) decode_s += calls[i];
  f.ms_per_token = calls.size() > 1 ? 1e3 * decode_s / static_cast<double>(calls.size() - 1) : 0;
  return f;
}

/// Decode ms/token at contexts 128, 512 and 2048 of the 100M LM in each family, in interleaved
/// rounds (medians): DeepStack adds work only to windows that hold image tokens, so a Qwen3-VL
/// decode step should cost what a Qwen2-VL one does (q/k norms aside); Gemma-3's sliding layers
/// (window 512, 5 of every 6 layers) read only their window of keys, so its decode at 2048 should
/// grow less over 128 than the other families' and than the same Gemma-3 with every layer global.
void family_decode_table(int rounds, nlohmann::json& out) {
  const QwenFamily families[] = {QwenFamily::kQwen2Vl, QwenFamily::kQwen2_5Vl, QwenFamily::kQwen3Vl};
  std::vector<std::pair<std::string, std::unique_ptr<CausalVlm>>> models;
  for (QwenFamily f : families) models.emplace_back(family_model_type(f), std::make_unique<QwenVl>(config_100m(f), 1));
  models.emplace_back("gemma3", std::make_unique<Gemma3>(gemma3_100m(), 1));
  Gemma3Config all_global = gemma3_100m();  // the same model without sliding layers, for comparison
  std::fill(all_global.sliding_layers.begin(), all_global.sliding_layers.end(), false);
  models.emplace_back("gemma3_all_global", std::make_unique<Gemma3>(all_global, 1));
  models.emplace_back("llava_next", std::make_unique<LlavaNext>(llava_next_100m(), 1));
  const std::vector<int64_t> contexts = {128, 512, 2048};
  std::map<std::string, std::map<int64_t, std::vector<double>>> runs;
  for (int round = 0; round < rounds; ++round) {
    for (int64_t ctx : contexts) {
      // Each pass starts two models later than the one before: a model's figure then does not
      // always follow the same neighbour's allocations (glibc's heap and mmap threshold carry
      // over from one model to the next).
      std::rotate(models.begin(), models.begin() + 2, models.end());
      for (auto& [name, m] : models) runs[name][ctx].push_back(decode(*m, ctx, 16, true).ms_per_token);
    }
  }
  fmt::print("\n{:<34}{:>12}{:>12}{:>12}{:>12}\n", "decode ms/token by family (100M LM)", "context 128", "512", "2048",
             "2048 / 128");
  std::map<std::string, std::map<std::string, double>> medians;
  for (auto& [name, by_context] : runs) {
    for (auto& [ctx, v] : by_context) {
      std::sort(v.begin(), v.end());
      medians[name][std::to_string(ctx)] = v[v.size() / 2];
    }
    auto& m = medians[name];
    m["2048_over_128"] = m["2048"] / m["128"];
    fmt::print("{:<34}{:>12.2f}{:>12.2f}{:>12.2f}{:>11.2f}x\n", "  " + name, m["128"], m["512"], m["2048"],
               m["2048_over_128"]);
  }
  const double q3_ratio = medians["qwen3_vl"]["512"] / medians["qwen2_vl"]["512"];
  fmt::print("  qwen3_vl / qwen2_vl at 512 = {:.3f}x (target <= 1.05x); medians of {} interleaved rounds\n", q3_ratio,
             rounds);
  out["decode_ms_per_token_by_family"] = medians;
  out["qwen3_over_qwen2_decode"] = q3_ratio;
}

int run_report(bool quick, const std::string& json_path, int threads) {
  vlmgen::bench::set_all_threads(threads);
  nlohmann::json out;
  out["build"] = build_info();
  out["threads"] = at::get_num_threads();
  const char* wait = std::getenv("OMP_WAIT_POLICY");
  fmt::print("vlmgen-bench report ({}; {} threads; OMP_WAIT_POLICY={})\n", build_info(), at::get_num_threads(),
             wait != nullptr ? wait : "unset");

  auto t_build = Clock::now();
  Qwen2Vl big(config_100m(), 1);
  const int64_t lm_params = count_params(big, true);
  fmt::print("100M config: {:.1f}M LM parameters, {:.1f}M in the vision tower (built in {:.1f} s)\n", lm_params / 1e6,
             (count_params(big, false) - lm_params) / 1e6, seconds_since(t_build));
  out["lm_parameters"] = lm_params;

  // 1. Decode time per token against context length.
  std::vector<int64_t> contexts = {128, 512, 2048};
  std::map<std::string, double> ms;
  fmt::print("\n{:<34}{:>12}{:>12}\n", "decode ms/token (100M config)", "KV cache", "no cache");
  for (int64_t ctx : contexts) {
    DecodeFigures kv = decode(big, ctx, 16, true);
    double nocache = -1;
    if (!(quick && ctx > 512)) nocache = decode(big, ctx, ctx >= 2048 ? 3 : 6, false).ms_per_token;
    ms[fmt::format("kv_{}", ctx)] = kv.ms_per_token;
    ms[fmt::format("nocache_{}", ctx)] = nocache;
    fmt::print("{:<34}{:>12.2f}{:>12}\n", fmt::format("  context {}", ctx), kv.ms_per_token,
               nocache < 0 ? std::string("skipped") : fmt::format("{:.1f}", nocache));
  }
  out["decode_ms_per_token"] = ms;
  const double kv_ratio = ms["kv_2048"] / ms["kv_128"];
  fmt::print("  KV decode 2048 / 128 = {:.2f}x (target <= 1.5x)\n", kv_ratio);
  out["kv_decode_2048_over_128"] = kv_ratio;

  // 1b. The same LM size in each family.
  family_decode_table(quick ? 1 : 5, out);

  // 2. No-cache generation with an image: pixels replayed, encoder cache, text only.
  {
    const QwenVlConfig& c = big.config();
    const int64_t grid_h = 16, grid_w = 16;  // a 224 x 224 image: 256 patches, 64 LM tokens
    const int64_t tokens = grid_h * grid_w / 4;
    at::Tensor pixels = at::rand({grid_h * grid_w, 3 * 2 * 14 * 14});
    auto vision = VisionInputs::patch_flattened(
        pixels, at::tensor(std::vector<int64_t>{1, grid_h, grid_w}, at::kLong).view({1, 3}));
    std::vector<int64_t> prompt = text_prompt(16, c, 5);
    prompt.push_back(c.vision_start_token_id);
    prompt.insert(prompt.end(), static_cast<size_t>(tokens), c.image_token_id);
    prompt.push_back(c.vision_end_token_id);
    auto tail = text_prompt(46, c, 6);
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    auto text = text_prompt(static_cast<int64_t>(prompt.size()), c, 7);
    const int64_t steps = quick ? 4 : 8;
    auto timed_run = [&](const std::vector<int64_t>& p, const VisionInputs& v, bool encoder_cache) {
      Generator g(big);
      auto cfg = GenerationConfig().max_new_tokens(steps).enable_kv_cache(false).encoder_cache(encoder_cache);
      g.generate({{p}, v}, GenerationConfig(cfg).max_new_tokens(1));  // warm-up
      double best = 1e30;
      for (int i = 0; i < 2; ++i) {
        auto t = Clock::now();
        g.generate({{p}, v}, cfg);
        best = std::min(best, seconds_since(t));
      }
      return best;
    };
    const double replay = timed_run(prompt, vision, false);
    const double cached = timed_run(prompt, vision, true);
    const double text_only = timed_run(text, {}, true);
    fmt::print("\nno-cache generation, {} tokens after a {}-token prompt with a 224x224 image\n", steps, prompt.size());
    fmt::print("  pixels replayed (vision tower every step) {:>8.3f} s  ({:.2f}x text-only)\n", replay,
               replay / text_only);
    fmt::print("  encoder cache (tower once)                {:>8.3f} s  ({:.2f}x text-only, target <= 1.1x)\n", cached,
               cached / text_only);
    fmt::print("  text-only prompt of the same length       {:>8.3f} s\n", text_only);
    out["nocache_image"] = {{"pixels_replayed_s", replay},
                            {"encoder_cache_s", cached},
                            {"text_only_s", text_only},
                            {"encoder_cache_over_text", cached / text_only},
                            {"replay_over_text", replay / text_only}};
  }

  // 3. Generator overhead: generate() wall time against the model's own forward time.
  fmt::print("\ngenerator overhead (generate wall time vs summed forward time, KV cache)\n");
  {
    Qwen2Vl tiny(QwenVlConfig::tiny(), 1);
    for (auto* m : {&tiny, &big}) {
      const bool is_big = m == &big;
      DecodeFigures f = decode(*m, 128, is_big ? 32 : 64, true);
      const double overhead = (f.generate_s - f.forward_s) / f.forward_s;
      fmt::print("  {:<12} generate {:>8.4f} s, forward {:>8.4f} s, overhead {:>6.2f}%{}\n",
                 is_big ? "100M config" : "tiny config", f.generate_s, f.forward_s, 100 * overhead,
                 is_big ? " (target <= 3%)" : "");
      out[is_big ? "overhead_100m" : "overhead_tiny"] = overhead;
    }
  }

  // 4. Decode against the memory-bandwidth ceiling.
  {
    const double bandwidth = measure_copy_bandwidth();
    const int64_t bytes = decode_weight_bytes(big);
    const double ceiling = bandwidth / static_cast<double>(bytes);
    const double achieved = 1e3 / ms["kv_128"];
    fmt::print("\nmemory bandwidth: copy {:.2f} GB/s; weights read per token {:.1f} MB; ceiling {:.1f} tokens/s\n",
               bandwidth / 1e9, bytes / 1e6, ceiling);
    fmt::print("  100M decode at context 128: {:.1f} tokens/s = {:.0f}% of the ceiling (target >= 60%)\n", achieved,
               100 * achieved / ceiling);
    out["bandwidth"] = {{"copy_bytes_per_s", bandwidth},
                        {"weight_bytes_per_token", bytes},
                        {"ceiling_tokens_per_s", ceiling},
                        {"decode_tokens_per_s", achieved},
                        {"fraction_of_ceiling", achieved / ceiling}};
  }

  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << out.dump(2) << "\n";
    VLMGEN_CHECK(f.good(), "could not write {}", json_path);
    fmt::print("\nwrote {}\n", json_path);
  }
  return 0;
}

// ---- micro benchmarks of the core's pure pieces ----

std::vector<ImageSpan> many_spans(int64_t images) {
  std::vector<ImageSpan> spans;
  for (int64_t i = 0; i < images; ++i) spans.push_back({i, 0, 100 * i + 10, 100 * i + 74});
  return spans;
}

void BM_ImagesForWindow(benchmark::State& state) {
  auto spans = many_spans(state.range(0));
  ReplayPolicy policy;
  for (auto _ : state) {
    benchmark::DoNotOptimize(policy.images_for_window({0, 100 * state.range(0)}, spans, 3));
  }
}
BENCHMARK(BM_ImagesForWindow)->Arg(1)->Arg(16);

void BM_FindImageSpans(benchmark::State& state) {
  std::vector<int64_t> row(4096, 7);
  std::fill(row.begin() + 100, row.begin() + 100 + 1024, 99);
  for (auto _ : state) benchmark::DoNotOptimize(find_image_spans({row}, 99, {256, 256, 256, 256}));
}
BENCHMARK(BM_FindImageSpans);

void BM_SelectImages(benchmark::State& state) {
  auto v = VisionInputs::patch_flattened(
      at::rand({4 * 1024, 1176}), at::tensor({1, 32, 32, 1, 32, 32, 1, 32, 32, 1, 32, 32}, at::kLong).view({4, 3}));
  for (auto _ : state) benchmark::DoNotOptimize(v.select({1, 3}));
}
BENCHMARK(BM_SelectImages);

void BM_SampleTopP(benchmark::State& state) {
  SamplingOptions o;
  o.temperature = 0.8;
  o.top_p = 0.9;
  o.seed = 1;
  Sampler sampler(o, 1);
  // Peaked like a trained LM's logits (arg 1 = 0: flat, the slow path that sorts everything).
  at::Tensor logits = at::randn({1, state.range(0)}) * (state.range(1) ? 6.0 : 1.0);
  for (auto _ : state) benchmark::DoNotOptimize(sampler.choose(logits, {true}));
}
BENCHMARK(BM_SampleTopP)->Args({32000, 1})->Args({152064, 1})->Args({152064, 0});

void BM_Greedy(benchmark::State& state) {
  Sampler sampler(SamplingOptions{}, 8);
  at::Tensor logits = at::randn({8, state.range(0)});
  std::vector<bool> active(8, true);
  for (auto _ : state) benchmark::DoNotOptimize(sampler.choose(logits, active));
}
BENCHMARK(BM_Greedy)->Arg(152064);

}  // namespace
}  // namespace vlmgen::bench

int main(int argc, char** argv) {
  vlmgen::detail::prefer_passive_openmp_wait(argv);
  bool report = false, quick = false, tokenizer = false, families = false, speed = false, write_checkpoint = false,
       engine = false, engine_load = false;
  vlmgen::bench::EngineLoad load;
  int64_t megabytes = 10;
  int rounds = 3;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::string json, checkpoint, memory;
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--report") == 0) {
      report = true;
    } else if (std::strcmp(argv[i], "--write-checkpoint") == 0 || std::strcmp(argv[i], "--checkpoint") == 0) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "error: %s needs a folder\n", argv[i]);
        return 2;
      }
      if (std::strcmp(argv[i], "--write-checkpoint") == 0) write_checkpoint = true;
      checkpoint = argv[++i];
    } else if (std::strcmp(argv[i], "--memory") == 0) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "error: --memory needs a dtype (f32, bf16 or fp8)\n");
        return 2;
      }
      memory = argv[++i];
    } else if (std::strcmp(argv[i], "--speed") == 0) {
      speed = true;
    } else if (std::strcmp(argv[i], "--engine") == 0) {
      engine = true;
    } else if (std::strcmp(argv[i], "--engine-load") == 0) {
      engine_load = true;
    } else if (std::strcmp(argv[i], "--clients") == 0 && i + 1 < argc) {
      load.clients = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--requests") == 0 && i + 1 < argc) {
      load.requests_per_client = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--prompt-tokens") == 0 && i + 1 < argc) {
      load.prompt_tokens = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--new-tokens") == 0 && i + 1 < argc) {
      load.new_tokens = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--families") == 0) {
      families = true;
    } else if (std::strcmp(argv[i], "--tokenizer") == 0) {
      tokenizer = true;
    } else if (std::strcmp(argv[i], "--mb") == 0 && i + 1 < argc) {
      megabytes = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json = argv[++i];
    } else {
      rest.push_back(argv[i]);
    }
  }
  try {
    if (tokenizer) return vlmgen::bench::run_tokenizer_report(megabytes, rounds);
    if (!memory.empty()) {
      if (checkpoint.empty()) throw vlmgen::Error("--memory needs --checkpoint DIR");
      vlmgen::bench::set_all_threads(threads);
      return vlmgen::bench::run_memory_report(memory, checkpoint);
    }
    if (write_checkpoint) {  // the 100M model of the reports, for peers (bench/side_by_side.py)
      vlmgen::QwenVl(vlmgen::bench::config_100m(), 1).save_checkpoint(checkpoint);
      std::printf("wrote the 100M Qwen2-VL bench model (seed 1, float32) to %s\n", checkpoint.c_str());
      return 0;
    }
    if (report) return vlmgen::bench::run_report(quick, json, threads);
    if (speed) {
      vlmgen::bench::set_all_threads(threads);
      return vlmgen::bench::run_speed_report(rounds, json);
    }
    if (engine_load) {
      vlmgen::bench::set_all_threads(threads);
      return vlmgen::bench::run_engine_load(load);
    }
    if (engine) {
      vlmgen::bench::set_all_threads(threads);
      return vlmgen::bench::run_engine_report(rounds, json);
    }
    if (families) {
      vlmgen::bench::set_all_threads(threads);
      nlohmann::json out;
      vlmgen::bench::family_decode_table(rounds, out);
      return 0;
    }
  } catch (const vlmgen::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  if (benchmark::ReportUnrecognizedArguments(n, rest.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
