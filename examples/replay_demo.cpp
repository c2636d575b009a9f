// Runs the generator on the fake VLM and prints, for every forward call, the window it computed
// and which vision tensors it received: with a KV cache, without one, without one under the
// legacy step-0 gate, and under sequence parallelism (which falls back to no cache).
//
//   vlmgen-replay-demo [--new-tokens N]

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/generator.h"
#include "vlmgen/testing/fake_vlm.h"
#include "vlmgen/testing/forward_spy.h"

namespace {

struct Arm {
  const char* name;
  bool kv_cache;
  vlmgen::ReplayMode mode;
  bool sequence_parallel;
};

int parse_new_tokens(int argc, char** argv) {
  int n = 5;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--new-tokens") == 0 && i + 1 < argc) {
      n = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf("usage: %s [--new-tokens N]  (N in 1..64, default 5)\n", argv[0]);
      std::exit(0);
    } else {
      std::fprintf(stderr, "unknown argument '%s'; try --help\n", argv[i]);
      std::exit(2);
    }
  }
  if (n < 1 || n > 64) {
    std::fprintf(stderr, "--new-tokens must be in 1..64, got %d\n", n);
    std::exit(2);
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  const int new_tokens = parse_new_tokens(argc, argv);
  vlmgen::testing::FakeVlm model;
  const int64_t image = *model.traits().image_token_id;

  // "describe" <image: 4 placeholders> "please": one image of grid (1, 4, 4) merged 2x2.
  std::vector<int64_t> prompt = {5, 17, image, image, image, image, 23};
  at::Generator gen = vlmgen::detail::make_cpu_generator(2024);
  auto vision =
      vlmgen::VisionInputs::patch_flattened(at::rand({16, 12}, gen), at::tensor({1, 4, 4}, at::kLong).view({1, 3}),
                                            at::tensor({56, 56}, at::kLong).view({1, 2}));

  const Arm arms[] = {
      {"KV cache, span-aware replay", true, vlmgen::ReplayMode::kSpanAware, false},
      {"no KV cache, span-aware replay", false, vlmgen::ReplayMode::kSpanAware, false},
      {"no KV cache, legacy step-0 gate (WRONG)", false, vlmgen::ReplayMode::kStepZero, false},
      {"KV cache requested under sequence parallelism", true, vlmgen::ReplayMode::kSpanAware, true},
  };
  std::vector<std::vector<int64_t>> outputs;
  for (const Arm& arm : arms) {
    vlmgen::testing::ForwardSpy spy(model);
    vlmgen::Generator generator(spy, vlmgen::ParallelContext::single().sequence_parallel(arm.sequence_parallel));
    auto config =
        vlmgen::GenerationConfig().max_new_tokens(new_tokens).enable_kv_cache(arm.kv_cache).replay_mode(arm.mode);
    std::fflush(stdout);  // keep the fallback warning (stderr) next to its arm
    auto result = generator.generate({{prompt}, vision}, config);
    fmt::print("\n== {} ==\n", arm.name);
    fmt::print("{:>4}  {:>9}  {:>5}  {:>14}  {:>8}  {:>8}\n", "step", "window", "cache", "pixel_values", "grid_thw",
               "sizes");
    for (const auto& c : spy.calls()) {
      fmt::print(
          "{:>4}  {:>9}  {:>5}  {:>14}  {:>8}  {:>8}\n", c.step, fmt::format("[{},{})", c.window_start, c.window_end),
          c.had_context ? "yes" : "no", vlmgen::testing::format_shape(c.pixel_values_shape),
          vlmgen::testing::format_shape(c.image_grid_thw_shape), vlmgen::testing::format_shape(c.image_sizes_shape));
    }
    fmt::print("tokens: [{}]\n", fmt::join(result.sequences[0].tokens, ", "));
    outputs.push_back(result.sequences[0].tokens);
  }
  fmt::print("\nKV cache vs no KV cache (span-aware): {}\n", outputs[0] == outputs[1] ? "same tokens" : "DIFFERENT");
  fmt::print("legacy step-0 gate vs span-aware:     {}\n",
             outputs[2] == outputs[1] ? "same tokens" : "different tokens: the image was dropped from step 1 on");
  fmt::print("sequence-parallel fallback vs no KV:  {}\n", outputs[3] == outputs[1] ? "same tokens" : "DIFFERENT");
  return outputs[0] == outputs[1] && outputs[3] == outputs[1] ? 0 : 1;
}
