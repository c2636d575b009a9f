// vlmgen-bench --engine: the continuous-batching engine on the 100M Qwen2-VL config, medians of
// interleaved rounds:
//   aggregate decode tokens/s with 1, 4 and 16 requests running at once (the steady state: from
//   the moment every request has its first token to the moment the first one ends);
//   time to first token of two requests that share a 512-token system prompt with a 448x448
//   image (the second one finds the prompt's KV blocks and the image's embeddings cached);
//   the engine's own time per step against the model's forward time at 16 streams.
//
// vlmgen-bench --engine-load: the engine-only side of bench/serve_load.py (the same closed loop
// of clients the HTTP load generator runs against vlmgen-serve), as one JSON line.

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "bench_models.h"
#include "vlmgen/engine/engine.h"
#include "vlmgen/models/qwen2_vl.h"

namespace vlmgen::bench {
namespace {

struct StreamsRun {
  double decode_tokens_per_s = 0;  // steady state, all streams running
  double overhead = 0;             // engine time outside the model / model time, whole run
};

/// `streams` requests of a 32-token prompt and 48 new tokens each, submitted at once.
StreamsRun run_streams(QwenVl& model, int64_t streams, uint64_t seed) {
  TimedModel timed(model);
  const int64_t new_tokens = 48;
  std::vector<std::vector<Clock::time_point>> stamps(static_cast<size_t>(streams));
  std::vector<std::shared_ptr<RequestHandle>> handles;
  Clock::time_point start, end;
  {
    Engine engine(timed, EngineOptions().max_running(streams).prefix_cache_bytes(0));
    start = Clock::now();
    for (int64_t i = 0; i < streams; ++i) {
      GenerateRequest request;
      request.prompts = {text_prompt(32, model.config(), seed + static_cast<uint64_t>(i))};
      request.on_token = [&stamps, i](const TokenEvent&) {
        stamps[static_cast<size_t>(i)].push_back(Clock::now());
        return true;
      };
      handles.push_back(engine.submit(std::move(request), GenerationConfig().max_new_tokens(new_tokens)));
    }
    for (auto& h : handles) h->wait();
    end = Clock::now();
  }
  // Steady state: after the last first token, before the first request's last token.
  Clock::time_point from = start, to = end;
  for (const auto& s : stamps) {
    from = std::max(from, s.front());
    to = std::min(to, s.back());
  }
  int64_t tokens = 0;
  for (const auto& s : stamps) tokens += std::count_if(s.begin(), s.end(), [&](auto t) { return t > from && t <= to; });
  StreamsRun run;
  const double window = std::chrono::duration<double>(to - from).count();
  run.decode_tokens_per_s = window > 0 ? static_cast<double>(tokens) / window : 0.0;
  const double wall = std::chrono::duration<double>(end - start).count();
  run.overhead = (wall - timed.model_seconds()) / timed.model_seconds();
  return run;
}

/// Time to first token of two requests sharing a 512-column system prompt that holds a 448x448
/// image (256 placeholders), each with its own 16-token question, on a fresh engine.
std::pair<double, double> run_shared_prompt(QwenVl& model, uint64_t seed) {
  const QwenVlConfig& c = model.config();
  const int64_t grid = 448 / c.vision.patch_size;  // patches per side
  const int64_t placeholders = grid * grid / (c.vision.spatial_merge_size * c.vision.spatial_merge_size);
  const int64_t patch = c.vision.in_channels * c.vision.temporal_patch_size * c.vision.patch_size * c.vision.patch_size;
  const VisionInputs image = VisionInputs::patch_flattened(
      at::randn({grid * grid, patch}), at::tensor({int64_t{1}, grid, grid}, at::kLong).view({1, 3}));
  std::vector<int64_t> system = text_prompt(512 - placeholders - 2 - 16, c, seed);
  system.push_back(c.vision_start_token_id);
  system.insert(system.end(), static_cast<size_t>(placeholders), c.image_token_id);
  system.push_back(c.vision_end_token_id);
  const std::vector<int64_t> tail = text_prompt(16, c, seed + 7);
  system.insert(system.end(), tail.begin(), tail.end());  // 512 columns
  std::vector<double> ttft;
  Engine engine(model);
  for (int k = 0; k < 2; ++k) {
    GenerateRequest request;
    request.prompts = {system};
    const std::vector<int64_t> question = text_prompt(16, c, seed + 100 + static_cast<uint64_t>(k));
    request.prompts[0].insert(request.prompts[0].end(), question.begin(), question.end());
    request.vision = image;
    std::optional<Clock::time_point> first;
    request.on_token = [&first](const TokenEvent&) {
      if (!first) first = Clock::now();
      return true;
    };
    const auto submitted = Clock::now();  // from submit: validation, cache lookups and queueing count
    engine.submit(request, GenerationConfig().max_new_tokens(2))->wait();
    ttft.push_back(std::chrono::duration<double>(*first - submitted).count());
  }
  const EngineMetrics m = engine.metrics();
  fmt::print(stderr, "shared prompt: {} prefix-cache columns served, {} encoder-cache hits, {} misses\n",
             m.prefix_cache_hit_columns, m.encoder_cache_hits, m.encoder_cache_misses);
  return {ttft[0], ttft[1]};
}

}  // namespace

int run_engine_report(int rounds, const std::string& json_path) {
  Qwen2Vl model(config_100m(), 1);
  const std::vector<int64_t> stream_counts = {1, 4, 16};
  std::map<int64_t, std::vector<double>> rate, overhead;
  std::vector<double> first_ttft, second_ttft;
  run_streams(model, 4, 999);  // warm-up
  for (int r = 0; r < rounds; ++r) {
    for (int64_t n : stream_counts) {
      const StreamsRun run = run_streams(model, n, 1000 * static_cast<uint64_t>(r + 1));
      rate[n].push_back(run.decode_tokens_per_s);
      overhead[n].push_back(run.overhead);
      fmt::print(stderr, "round {}: {} streams {:.1f} tok/s, overhead {:.1f}%\n", r + 1, n, run.decode_tokens_per_s,
                 100 * run.overhead);
    }
    const auto [first, second] = run_shared_prompt(model, 77 + static_cast<uint64_t>(r));
    first_ttft.push_back(first);
    second_ttft.push_back(second);
    fmt::print(stderr, "round {}: shared prompt TTFT {:.0f} ms then {:.0f} ms\n", r + 1, 1e3 * first, 1e3 * second);
  }
  nlohmann::json out;
  fmt::print("\nengine, 100M Qwen2-VL f32, {} threads, medians of {} rounds\n", at::get_num_threads(), rounds);
  fmt::print("{:<48}{:>12}{:>14}\n", "figure", "value", "target");
  for (int64_t n : stream_counts) {
    const double tps = median(rate[n]);
    out["decode_tokens_per_s"][std::to_string(n)] = tps;
    fmt::print("{:<48}{:>12.1f}{:>14}\n", fmt::format("aggregate decode tok/s, {} streams", n), tps, "");
  }
  const double scale16 = median(rate[16]) / median(rate[1]);
  fmt::print("{:<48}{:>11.2f}x{:>14}\n", "16 streams / 1 stream", scale16, ">= 6x");
  const double ttft_ratio = median(second_ttft) / median(first_ttft);
  fmt::print("{:<48}{:>12.0f}{:>14}\n", "TTFT ms, 512-token prompt + 448px image, cold", 1e3 * median(first_ttft), "");
  fmt::print("{:<48}{:>12.0f}{:>14}\n", "TTFT ms, same prompt and image again", 1e3 * median(second_ttft), "");
  fmt::print("{:<48}{:>12.3f}{:>14}\n", "second / first", ttft_ratio, "<= 0.2");
  fmt::print("{:<48}{:>11.1f}%{:>14}\n", "engine time over model time, 16 streams", 100 * median(overhead[16]),
             "<= 3%");
  out["scale_16_over_1"] = scale16;
  out["ttft_first_s"] = median(first_ttft);
  out["ttft_second_s"] = median(second_ttft);
  out["ttft_ratio"] = ttft_ratio;
  for (int64_t n : stream_counts) out["overhead"][std::to_string(n)] = median(overhead[n]);
  out["threads"] = at::get_num_threads();
  out["rounds"] = rounds;
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}

int run_engine_load(const EngineLoad& load) {
  Qwen2Vl model(config_100m(), 1);
  std::vector<double> ttft;
  std::mutex mutex;
  int64_t tokens = 0;
  Clock::time_point start;
  {
    Engine engine(model, EngineOptions().max_running(std::max<int64_t>(load.clients, 1)));
    {  // warm-up: one request, as the load generator's first (calibrating) request warms the server
      GenerateRequest request;
      request.prompts = {text_prompt(load.prompt_tokens, model.config(), 1)};
      engine.submit(std::move(request), GenerationConfig().max_new_tokens(load.new_tokens))->wait();
    }
    start = Clock::now();
    std::vector<std::thread> clients;
    for (int64_t c = 0; c < load.clients; ++c) {
      clients.emplace_back([&, c] {
        for (int64_t k = 0; k < load.requests_per_client; ++k) {
          GenerateRequest request;
          request.prompts = {text_prompt(load.prompt_tokens, model.config(),
                                         100 + 1000 * static_cast<uint64_t>(c) + static_cast<uint64_t>(k))};
          std::optional<Clock::time_point> first;
          request.on_token = [&first](const TokenEvent&) {
            if (!first) first = Clock::now();
            return true;
          };
          const auto submitted = Clock::now();
          const GenerationResult result =
              engine.submit(std::move(request), GenerationConfig().max_new_tokens(load.new_tokens))->wait();
          std::lock_guard<std::mutex> lock(mutex);
          tokens += result.stats.generated_tokens;
          if (first) ttft.push_back(std::chrono::duration<double>(*first - submitted).count());
        }
      });
    }
    for (auto& t : clients) t.join();
  }
  const double wall = seconds_since(start);
  std::sort(ttft.begin(), ttft.end());
  const auto quantile = [&](double q) {
    if (ttft.empty()) return 0.0;
    return ttft[static_cast<size_t>(
        std::min<double>(std::ceil(q * static_cast<double>(ttft.size())) - 1, static_cast<double>(ttft.size() - 1)))];
  };
  nlohmann::json out = {{"clients", load.clients},
                        {"requests", load.clients * load.requests_per_client},
                        {"prompt_tokens", load.prompt_tokens},
                        {"tokens", tokens},
                        {"wall_s", wall},
                        {"tokens_per_s", static_cast<double>(tokens) / wall},
                        {"requests_per_s", static_cast<double>(load.clients * load.requests_per_client) / wall},
                        {"ttft_p50_s", quantile(0.5)},
                        {"ttft_p99_s", quantile(0.99)},
                        {"threads", at::get_num_threads()}};
  fmt::print("{}\n", out.dump());
  return 0;
}

}  // namespace vlmgen::bench
