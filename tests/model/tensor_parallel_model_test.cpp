// Tensor and sequence parallelism of the reference model, end to end: Qwen2-VL split over two
// ranks (Gloo on loopback, processes started by the test) against the same model in one process,
// through the Generator; sharded checkpoint loading; the SP -> no-cache fallback; a rank that dies
// mid-generation. Every multi-process test is bounded in time (launch timeout + collectives'
// timeout), so a broken group fails instead of hanging.
//
// Workers compare against a TP=1 run computed inside each worker (same seed, same weights), so
// every rank checks its own tokens and its own block of the logits.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "multiprocess_test_util.h"
#include "qwen_test_util.h"
#include "tp_test_util.h"
#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/distributed/tensor_parallel.h"
#include "vlmgen/engine/engine.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/io/safetensors.h"
#include "vlmgen/logging.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/models/llava_next.h"
#include "vlmgen/models/quantization.h"
#include "vlmgen/models/qwen2_vl.h"
#include "vlmgen/parallel.h"
#include "vlmgen/sampling.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)
using namespace tp_test;    // NOLINT(google-build-using-namespace)

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using Clock = std::chrono::steady_clock;
using multiprocess::getenv_or;
using multiprocess::run_workers;
using multiprocess::worker_comm;
using multiprocess::worker_context;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Two rows with an image each, of lengths 13 and 14 (left-padded to 14).
GenerateRequest image_request(const QwenVlConfig& c) {
  return GenerateRequest({image_prompt({1, 2, 3, 4, 5}, 4, {6, 7}), image_prompt({9}, 8, {10, 11, 12})},
                         make_vision(c, {{1, 4, 4}, {1, 4, 8}}, 81));
}

// Two rows of 13 tokens each: a prompt length that does not divide by 2.
GenerateRequest odd_length_request(const QwenVlConfig& c) {
  return GenerateRequest({image_prompt({1, 2, 3, 4, 5}, 4, {6, 7}), image_prompt({9}, 8, {10, 11})},
                         make_vision(c, {{1, 4, 4}, {1, 4, 8}}, 82));
}

// ---------------------------------------------------------------------------------------------
// Workers (run as ranks of a launch; see multiprocess_test_util.h)

TEST(DISABLED_TpModelWorker, GreedyWithImageEqualsTp1WithAndWithoutKvCache) {
  SKIP_UNLESS_WORKER();
  auto [par, counter] = counted_context(/*sequence_parallel=*/false);
  ASSERT_EQ(par.tp_size(), 2);
  double worst = 0.0;
  for (int64_t vision_heads : {2, 1}) {  // the vision tower sharded, then replicated
    const QwenVlConfig config = test_config(vision_heads);
    Qwen2Vl reference(config, 13);
    Qwen2Vl model(config, 13, 0.02, par);
    EXPECT_EQ(model.vision_tower_sharded(), vision_heads == 2);
    EXPECT_TRUE(model.traits().vocab_parallel_logits);
    EXPECT_EQ(model.traits().vocab_size, 96);
    EXPECT_EQ(model.traits().kv_cache.num_kv_heads, 1) << "2 KV heads over 2 ranks";
    EXPECT_EQ(model.language_model().embed_tokens.size(0), 48);
    const GenerateRequest request = image_request(config);
    for (bool kv : {true, false}) {
      const auto gen_config = GenerationConfig().max_new_tokens(8).enable_kv_cache(kv);
      const std::string what = fmt::format("vision heads {}, kv {}", vision_heads, kv);
      RecordedRun tp1 = generate_recorded(reference, ParallelContext::single(), request, gen_config);
      counter->reset();
      RecordedRun tp2 = generate_recorded(model, par, request, gen_config);
      EXPECT_EQ(tp2.result.stats.used_kv_cache, kv);
      EXPECT_EQ(counter->reduce_scatters, 0) << "no sequence parallelism: all-reduces only";
      EXPECT_GT(counter->all_reduces, 0);
      worst = std::max(worst, expect_run_matches_tp1(tp1, tp2, what));
      expect_same_tokens_on_every_rank(tp2.result, *par.tp_group(), 8);
    }
  }
  report("TP=2 vs TP=1 per-step logits (greedy, image, KV cache on/off), max|diff|", worst);
}

// Ranks given different requests (another length, other ids, another option, another picture)
// all raise the same vlmgen::Error before any collective of the model, and stay usable.
TEST(DISABLED_TpModelWorker, RanksGivenDifferentRequestsAllRaise) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = multiprocess::worker_context();
  ASSERT_EQ(par.tp_size(), 2);
  const QwenVlConfig config = test_config(2);
  Qwen2Vl model(config, 13, 0.02, par);
  Generator generator(model, par);
  const GenerateRequest request = image_request(config);
  const auto gen_config = GenerationConfig().max_new_tokens(3);
  const bool odd = par.tp_rank() == 1;
  std::vector<std::pair<std::string, std::function<void(GenerateRequest&, GenerationConfig&)>>> cases = {
      {"longer prompt", [](GenerateRequest& r, GenerationConfig&) { r.prompts[0].push_back(5); }},
      {"other token", [](GenerateRequest& r, GenerationConfig&) { r.prompts[0][0] += 1; }},
      {"other max_new_tokens", [](GenerateRequest&, GenerationConfig& c) { c.max_new_tokens(4); }},
      {"other seed", [](GenerateRequest&, GenerationConfig& c) { c.seed(99); }},
      {"other picture",
       [](GenerateRequest& r, GenerationConfig&) {
         r.vision.pixel_values = r.vision.pixel_values.clone();
         r.vision.pixel_values.view({-1})[7] += 0.5;
       }},
  };
  for (auto& [what, change] : cases) {
    GenerateRequest mine = request;
    GenerationConfig mine_config = gen_config;
    if (odd) change(mine, mine_config);
    try {
      generator.generate(mine, mine_config);
      ADD_FAILURE() << what << ": expected vlmgen::Error on rank " << par.tp_rank();
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr("tensor-parallel ranks were given different requests: rank(s) [1]"))
          << what;
    }
  }
  auto out = generator.generate(request, gen_config);
  expect_same_tokens_on_every_rank(out, *par.tp_group(), 3);
}

TEST(DISABLED_TpModelWorker, SequenceParallelOddPromptEqualsTp1) {
  SKIP_UNLESS_WORKER();
  auto [sp, counter] = counted_context(/*sequence_parallel=*/true);
  const QwenVlConfig config = test_config();
  Qwen2Vl reference(config, 13);
  Qwen2Vl model(config, 13, 0.02, sp);
  EXPECT_TRUE(model.traits().kv_cache_under_sequence_parallel);
  const GenerateRequest request = odd_length_request(config);
  ASSERT_EQ(request.prompts[0].size(), 13u);
  ASSERT_EQ(request.prompts[1].size(), 13u);
  const int64_t layers = config.num_hidden_layers;
  double worst = 0.0;
  struct Case {
    bool kv;
    int64_t chunk;
  };
  for (const Case c : {Case{true, 0}, Case{true, 7}, Case{false, 0}}) {
    const auto gen_config = GenerationConfig().max_new_tokens(6).enable_kv_cache(c.kv).prefill_chunk_size(c.chunk);
    const std::string what = fmt::format("SP, kv {}, prefill chunk {}", c.kv, c.chunk);
    RecordedRun tp1 = generate_recorded(reference, ParallelContext::single(), request, gen_config);
    counter->reset();
    RecordedRun tp2 = generate_recorded(model, sp, request, gen_config);
    EXPECT_EQ(tp2.result.stats.used_kv_cache, c.kv) << "the reference model keeps its KV cache under SP";
    worst = std::max(worst, expect_run_matches_tp1(tp1, tp2, what));
    expect_same_tokens_on_every_rank(tp2.result, *sp.tp_group(), 6);
    // Two reduce-scatters per layer for every window longer than one token; a one-token decode
    // step is not split (it all-reduces).
    int64_t split_windows = 0;
    for (const auto& call : tp2.calls) split_windows += call.window_size() > 1;
    EXPECT_EQ(counter->reduce_scatters, 2 * layers * split_windows) << what;
    if (c.kv && c.chunk == 0) {
      ASSERT_EQ(tp2.calls.size(), 6u);
      EXPECT_EQ(tp2.calls[0].window_size(), 13) << "prefill: odd, padded to 14 for the split";
      for (size_t i = 1; i < tp2.calls.size(); ++i) {
        EXPECT_TRUE(tp2.calls[i].had_context);
        EXPECT_EQ(tp2.calls[i].window_size(), 1);
      }
      EXPECT_EQ(split_windows, 1);
    }
    if (!c.kv) {
      EXPECT_EQ(split_windows, 6) << "every no-cache step recomputes the prefix, split";
    }
    if (c.chunk > 0) {
      EXPECT_GE(split_windows, 2) << "the chunks of the prefill";
    }
  }
  report("TP=2 + SP vs TP=1 per-step logits (odd prompt, KV cache, chunked, no cache), max|diff|", worst);
}

// Qwen2.5-VL (window attention, SwiGLU tower) and Qwen3-VL (DeepStack, q/k norms, interleaved
// M-RoPE) under TP=2 (vision tower sharded) and TP=2 + SP with an odd prompt (prefill whole or
// in chunks, and no cache): per-step logits equal TP=1.
TEST(DISABLED_TpModelWorker, NewFamiliesEqualTp1UnderTpAndSp) {
  SKIP_UNLESS_WORKER();
  auto [par, counter] = counted_context(/*sequence_parallel=*/false);
  auto [sp, sp_counter] = counted_context(/*sequence_parallel=*/true);
  double worst = 0.0;
  for (QwenFamily family : {QwenFamily::kQwen2_5Vl, QwenFamily::kQwen3Vl}) {
    QwenVlConfig config = QwenVlConfig::tiny(family);
    config.max_position_embeddings = 512;
    QwenVl reference(config, 13);
    QwenVl tp_model(config, 13, 0.02, par);
    QwenVl sp_model(config, 13, 0.02, sp);
    EXPECT_TRUE(tp_model.vision_tower_sharded());
    struct Case {
      bool sequence_parallel;
      bool kv;
      int64_t chunk;
    };
    for (const Case c : {Case{false, true, 0}, Case{false, false, 0}, Case{true, true, 0}, Case{true, true, 7},
                         Case{true, false, 0}}) {
      const GenerateRequest request = c.sequence_parallel ? odd_length_request(config) : image_request(config);
      const auto gen_config = GenerationConfig().max_new_tokens(6).enable_kv_cache(c.kv).prefill_chunk_size(c.chunk);
      const std::string what =
          fmt::format("{}, SP {}, kv {}, chunk {}", family_model_type(family), c.sequence_parallel, c.kv, c.chunk);
      RecordedRun tp1 = generate_recorded(reference, ParallelContext::single(), request, gen_config);
      const ParallelContext& p = c.sequence_parallel ? sp : par;
      RecordedRun tp2 = generate_recorded(c.sequence_parallel ? sp_model : tp_model, p, request, gen_config);
      EXPECT_EQ(tp2.result.stats.used_kv_cache, c.kv) << what;
      worst = std::max(worst, expect_run_matches_tp1(tp1, tp2, what));
      expect_same_tokens_on_every_rank(tp2.result, *p.tp_group(), 6);
    }
  }
  EXPECT_GT(sp_counter->reduce_scatters, 0) << "sequence parallelism split the prefill";
  report("Qwen2.5-VL and Qwen3-VL: TP=2 (and + SP) vs TP=1 per-step logits, max|diff|", worst);
}

TEST(DISABLED_TpModelWorker, Gemma3EqualsTp1) {
  // Heads, KV heads, MLP and vocabulary split over two ranks, and the SigLIP tower (2 heads, MLP
  // 48) too. Under SP the generator decodes without a cache (Gemma3 does not split sequences), as
  // a TP=1 no-cache run. vision_tower_tp_test.cpp covers a tower that stays replicated.
  SKIP_UNLESS_WORKER();
  auto [par, counter] = counted_context(/*sequence_parallel=*/false);
  auto [sp, sp_counter] = counted_context(/*sequence_parallel=*/true);
  const Gemma3Config config = Gemma3Config::tiny();
  Gemma3 reference(config, 13);
  Gemma3 tp_model(config, 13, 0.02, par);
  Gemma3 sp_model(config, 13, 0.02, sp);
  ASSERT_TRUE(tp_model.vision_tower_sharded());
  for (Gemma3* model : {&tp_model, &sp_model}) {
    expect_tower_layer_is_this_ranks_slice(model->vision_tower().layers[0], reference.vision_tower().layers[0],
                                           par.tp_rank());
  }
  const GenerateRequest request = gemma3_request();
  double worst = 0.0;
  for (const auto& [sequence_parallel, kv, chunk] :
       {std::tuple<bool, bool, int64_t>{false, true, 0}, {false, false, 0}, {false, true, 3}, {true, true, 0}}) {
    const auto gen_config = GenerationConfig().max_new_tokens(6).enable_kv_cache(kv).prefill_chunk_size(chunk);
    const std::string what = fmt::format("gemma3, SP {}, kv {}, chunk {}", sequence_parallel, kv, chunk);
    const auto tp1_config = GenerationConfig().max_new_tokens(6).enable_kv_cache(kv && !sequence_parallel);
    RecordedRun tp1 =
        generate_recorded(reference, ParallelContext::single(), request, sequence_parallel ? tp1_config : gen_config);
    const ParallelContext& p = sequence_parallel ? sp : par;
    RecordedRun tp2 = generate_recorded(sequence_parallel ? sp_model : tp_model, p, request, gen_config);
    worst = std::max(worst, expect_run_matches_tp1(tp1, tp2, what));
    expect_same_tokens_on_every_rank(tp2.result, *p.tp_group(), 6);
  }
  EXPECT_GT(counter->all_reduces, 0);
  report("Gemma-3: TP=2 (and SP's no-cache fallback) vs TP=1 per-step logits, max|diff|", worst);
}

TEST(DISABLED_TpModelWorker, LlavaNextEqualsTp1) {
  // The text model split over two ranks (QwenVl's decoder), and the CLIP tower's layers (2 heads,
  // MLP 48); the projector replicated. vision_tower_tp_test.cpp covers a replicated tower.
  SKIP_UNLESS_WORKER();
  auto [par, counter] = counted_context(/*sequence_parallel=*/false);
  auto [sp, sp_counter] = counted_context(/*sequence_parallel=*/true);
  const LlavaNextConfig config = LlavaNextConfig::tiny();
  LlavaNext reference(config, 13);
  LlavaNext tp_model(config, 13, 0.02, par);
  LlavaNext sp_model(config, 13, 0.02, sp);
  ASSERT_TRUE(tp_model.vision_tower_sharded());
  for (LlavaNext* model : {&tp_model, &sp_model}) {
    expect_tower_layer_is_this_ranks_slice(model->vision_tower().layers[0], reference.vision_tower().layers[0],
                                           par.tp_rank());
  }
  const GenerateRequest request = llava_next_request(config);
  double worst = 0.0;
  // Row 0 is 21 tokens (odd): under SP the prefill is padded to a multiple of 2 and split.
  for (const auto& [sequence_parallel, kv, chunk] :
       {std::tuple<bool, bool, int64_t>{false, true, 0}, {false, false, 0}, {false, true, 7}, {true, true, 0}}) {
    const auto gen_config = GenerationConfig().max_new_tokens(6).enable_kv_cache(kv).prefill_chunk_size(chunk);
    const std::string what = fmt::format("llava_next, SP {}, kv {}, chunk {}", sequence_parallel, kv, chunk);
    RecordedRun tp1 = generate_recorded(reference, ParallelContext::single(), request, gen_config);
    const ParallelContext& p = sequence_parallel ? sp : par;
    RecordedRun tp2 = generate_recorded(sequence_parallel ? sp_model : tp_model, p, request, gen_config);
    worst = std::max(worst, expect_run_matches_tp1(tp1, tp2, what));
    expect_same_tokens_on_every_rank(tp2.result, *p.tp_group(), 6);
  }
  EXPECT_GT(counter->all_reduces, 0);
  EXPECT_GT(sp_counter->reduce_scatters, 0) << "sequence parallelism split the prefill";
  report("LLaVA-NeXT: TP=2 (and + SP) vs TP=1 per-step logits, max|diff|", worst);
}

// A model that cannot decode with a KV cache under SP: the reference model behind traits that
// say so.
class KvCacheNotUnderSequenceParallel : public CausalVlm {
 public:
  explicit KvCacheNotUnderSequenceParallel(Qwen2Vl& inner) : inner_(inner), traits_(inner.traits()) {
    traits_.kv_cache_under_sequence_parallel = false;
  }
  const ModelTraits& traits() const override { return traits_; }
  at::Tensor forward(const ForwardArgs& args) override { return inner_.forward(args); }
  bool can_encode_images() const override { return inner_.can_encode_images(); }
  at::Tensor encode_images(const VisionInputs& vision) override { return inner_.encode_images(vision); }
  RopePlan plan_positions(const at::Tensor& ids, const at::Tensor& mask, const VisionInputs& vision) const override {
    return inner_.plan_positions(ids, mask, vision);
  }

 private:
  Qwen2Vl& inner_;
  ModelTraits traits_;
};

TEST(DISABLED_TpModelWorker, NoCacheFallbackUnderSpReplaysVisionEveryStep) {
  SKIP_UNLESS_WORKER();
  ParallelContext sp = worker_context();
  sp.sequence_parallel(true);
  Communicator& comm = worker_comm();
  const QwenVlConfig config = test_config();
  Qwen2Vl reference(config, 13);
  Qwen2Vl model(config, 13, 0.02, sp);
  KvCacheNotUnderSequenceParallel legacy(model);
  testing::ForwardSpy spy(legacy);
  const GenerateRequest request = image_request(config);
  const auto expected = Generator(reference).generate(request, GenerationConfig().max_new_tokens(6));
  ASSERT_TRUE(expected.stats.used_kv_cache);

  std::vector<std::string> warnings;
  LogSink previous = set_log_sink([&](LogLevel level, const std::string& message) {
    if (level == LogLevel::kWarning) warnings.push_back(message);
  });
  Generator generator(spy, sp);
  for (bool encoder_cache : {true, false}) {
    spy.clear();
    const int64_t tower_runs = model.vision_tower_calls();
    auto out = generator.generate(
        request, GenerationConfig().max_new_tokens(6).enable_kv_cache(true).encoder_cache(encoder_cache));
    EXPECT_FALSE(out.stats.used_kv_cache);
    ASSERT_EQ(spy.calls().size(), 6u);
    int64_t with_vision = 0;
    for (const auto& call : spy.calls()) {
      EXPECT_FALSE(call.had_context) << ::testing::PrintToString(call);
      EXPECT_EQ(call.window_start, 0) << ::testing::PrintToString(call);
      EXPECT_EQ(call.images, (std::vector<int64_t>{0, 1})) << ::testing::PrintToString(call);
      const bool sent = encoder_cache ? call.image_embeddings_shape.has_value() : call.has_pixel_values();
      EXPECT_TRUE(sent) << ::testing::PrintToString(call);
      with_vision += sent;
    }
    EXPECT_EQ(model.vision_tower_calls() - tower_runs, encoder_cache ? 1 : 6)
        << "the encoder cache runs the tower once; without it every step reruns it";
    for (size_t r = 0; r < request.prompts.size(); ++r) {
      EXPECT_EQ(out.sequences[r].tokens, expected.sequences[r].tokens) << "row " << r;
    }
    // Every rank saw the same: all six calls with both images.
    at::Tensor mine = at::tensor(std::vector<int64_t>{static_cast<int64_t>(spy.calls().size()), with_vision});
    at::Tensor all = comm.all_gather(mine.unsqueeze(0), 0);
    EXPECT_TRUE(at::equal(all, at::full({comm.size(), 2}, 6, at::kLong))) << all;
  }
  set_log_sink(previous);
  ASSERT_EQ(warnings.size(), 1u) << "the fallback is logged once per Generator";
  EXPECT_THAT(warnings[0], AllOf(HasSubstr("sequence parallelism"), HasSubstr("replayed at every step")));
}

// Prompt log-probabilities, top-k log-probabilities and returned logits come from the whole
// vocabulary under TP=2 (gathered from the ranks' blocks) and equal TP=1's.
TEST(DISABLED_TpModelWorker, ScoresEqualTp1) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = worker_context();
  const QwenVlConfig config = test_config();
  Qwen2Vl reference(config, 13);
  Qwen2Vl model(config, 13, 0.02, par);
  const GenerateRequest request = image_request(config);
  for (bool kv : {true, false}) {
    const auto gen_config = GenerationConfig()
                                .max_new_tokens(4)
                                .enable_kv_cache(kv)
                                .prompt_logprobs(true)
                                .top_logprobs(5)
                                .return_logits(true)
                                .prefill_chunk_size(kv ? 7 : 0);
    auto tp1 = Generator(reference).generate(request, gen_config);
    auto tp2 = Generator(model, par).generate(request, gen_config);
    for (size_t r = 0; r < tp1.sequences.size(); ++r) {
      const auto& a = tp1.sequences[r];
      const auto& b = tp2.sequences[r];
      ASSERT_EQ(a.tokens, b.tokens);
      ASSERT_EQ(a.prompt_logprobs.size(), request.prompts[r].size());
      ASSERT_EQ(b.prompt_logprobs.size(), a.prompt_logprobs.size());
      EXPECT_TRUE(std::isnan(b.prompt_logprobs[0]));
      for (size_t i = 1; i < a.prompt_logprobs.size(); ++i) {
        EXPECT_NEAR(b.prompt_logprobs[i], a.prompt_logprobs[i], kTpTolerance) << "row " << r << " token " << i;
        EXPECT_LT(a.prompt_logprobs[i], 0.0f);
      }
      ASSERT_EQ(b.top_logprobs.size(), a.top_logprobs.size());
      for (size_t s = 0; s < a.top_logprobs.size(); ++s) {
        ASSERT_EQ(b.top_logprobs[s].size(), 5u);
        EXPECT_EQ(b.top_logprobs[s][0].first, a.top_logprobs[s][0].first);
        for (size_t j = 0; j < 5; ++j)
          EXPECT_NEAR(b.top_logprobs[s][j].second, a.top_logprobs[s][j].second, kTpTolerance);
      }
      ASSERT_EQ(b.logits.sizes(), (at::IntArrayRef{4, config.vocab_size})) << "gathered to the whole vocabulary";
      EXPECT_LE((b.logits - a.logits).abs().max().item<double>(), kTpTolerance);
      // And TP=1's numbers are the log-softmax of the logits the tokens were chosen from.
      at::Tensor lp = at::log_softmax(a.logits, -1);
      for (size_t s = 0; s < a.tokens.size(); ++s) {
        EXPECT_NEAR(a.top_logprobs[s][0].second, lp[static_cast<int64_t>(s)].max().item<float>(), 1e-6);
      }
    }
  }
}

TEST(DISABLED_TpModelWorker, SeededSamplingEqualsTp1) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = worker_context();
  const QwenVlConfig config = test_config();
  Qwen2Vl reference(config, 13);
  Qwen2Vl model(config, 13, 0.02, par);
  const GenerateRequest request = image_request(config);
  double worst = 0.0;
  const std::vector<GenerationConfig> configs = {
      GenerationConfig().max_new_tokens(8).temperature(0.9).top_k(40).top_p(0.95).seed(1234).return_logprobs(true),
      GenerationConfig().max_new_tokens(8).temperature(1.5).row_seeds({7, 8}).enable_kv_cache(false),
      GenerationConfig().max_new_tokens(8).return_logprobs(true),  // greedy, logprobs gathered
  };
  for (size_t i = 0; i < configs.size(); ++i) {
    RecordedRun tp1 = generate_recorded(reference, ParallelContext::single(), request, configs[i]);
    RecordedRun tp2 = generate_recorded(model, par, request, configs[i]);
    worst = std::max(worst, expect_run_matches_tp1(tp1, tp2, fmt::format("sampling config {}", i)));
    expect_same_tokens_on_every_rank(tp2.result, *par.tp_group(), 8);
  }
  // The seed matters (so the equality above is not a coincidence of near-greedy sampling).
  RecordedRun other = generate_recorded(model, par, request, GenerationConfig(configs[0]).seed(99));
  RecordedRun first = generate_recorded(model, par, request, configs[0]);
  EXPECT_NE(other.result.sequences[0].tokens, first.result.sequences[0].tokens);
  report("TP=2 vs TP=1 per-step logits (seeded sampling), max|diff|", worst);
}

TEST(DISABLED_TpModelWorker, SamplerOnVocabShardsEqualsSamplerOnFullVocabulary) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = worker_comm();
  const int64_t tp = comm.size();
  const int64_t block = 48;
  const int64_t vocab = block * tp - 3;  // the last block ends in 3 padding columns
  at::Generator gen = detail::make_cpu_generator(5);
  at::Tensor full = at::randn({4, block * tp}, gen, at::kFloat);
  full[0][vocab - 2] = 50.0f;       // suppressed, in the last block
  full[1][block * tp - 1] = 90.0f;  // padding: never chosen
  full[2][3] = 50.0f;               // suppressed, in the first block
  full[3].fill_(1.0f);              // a tie over the whole vocabulary: the lowest id
  SamplingOptions options;
  options.suppressed_tokens = {vocab - 2, 3};
  const at::Tensor local = full.narrow(1, comm.rank() * block, block);
  const VocabShard shard{comm.rank() * block, vocab, &comm};
  const std::vector<bool> active = {true, true, true, true};

  std::vector<int64_t> greedy = Sampler(options, 4).choose_vocab_parallel(local, shard, active);
  std::vector<int64_t> expected = Sampler(options, 4).choose(full.narrow(1, 0, vocab), active);
  EXPECT_EQ(greedy, expected);
  EXPECT_NE(greedy[0], vocab - 2);
  EXPECT_LT(greedy[1], vocab);
  EXPECT_NE(greedy[2], 3);
  EXPECT_EQ(greedy[3], 0);
  EXPECT_EQ(Sampler(options, 4).choose_vocab_parallel(local, shard, {true, false, true, false}),
            (std::vector<int64_t>{expected[0], -1, expected[2], -1}));

  options.temperature = 3.0;  // flat enough that the draws spread over many ids
  options.seed = 17;
  Sampler sharded(options, 4);
  Sampler whole(options, 4);
  for (int step = 0; step < 20; ++step) {
    std::vector<float> lp_sharded;
    std::vector<float> lp_whole;
    std::vector<int64_t> a = sharded.choose_vocab_parallel(local, shard, active, &lp_sharded);
    std::vector<int64_t> b = whole.choose(full.narrow(1, 0, vocab), active, &lp_whole);
    EXPECT_EQ(a, b) << "step " << step;
    EXPECT_EQ(lp_sharded, lp_whole) << "step " << step;
    for (int64_t id : a) EXPECT_TRUE(id != vocab - 2 && id != 3 && id < vocab) << id;
  }
}

TEST(DISABLED_TpModelWorker, CheckpointLoadsThisRanksSlicesAndSavesWhole) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = worker_context();
  const std::string dir = getenv_or("VLMGEN_TEST_CHECKPOINT", "");
  ASSERT_FALSE(dir.empty()) << "the launching test passes VLMGEN_TEST_CHECKPOINT";
  auto reference = Qwen2Vl::from_checkpoint(dir);
  auto model = Qwen2Vl::from_checkpoint(dir, par);
  ASSERT_TRUE(model->tied_embeddings());
  EXPECT_TRUE(model->language_model().lm_head.is_same(model->language_model().embed_tokens))
      << "a tied lm_head is the same shard as the embedding";
  std::map<std::string, const at::Tensor*> full;
  for (const auto& [name, t] : reference->named_weights()) full[name] = t;
  const auto local = model->named_weights();
  ASSERT_EQ(local.size(), full.size());
  int64_t split = 0;
  for (const auto& [name, t] : local) {
    const ShardLayout layout = model->shard_layout(name);
    EXPECT_EQ(layout, layout_by_name(name)) << name;
    split += layout != ShardLayout::kReplicated;
    EXPECT_TRUE(t->equal(expected_slice(*full.at(name), layout, par.tp_rank(), par.tp_size()))) << name;
  }
  EXPECT_GT(split, 20);

  const GenerateRequest request = image_request(reference->config());
  const auto gen_config = GenerationConfig().max_new_tokens(6);
  RecordedRun tp1 = generate_recorded(*reference, ParallelContext::single(), request, gen_config);
  RecordedRun tp2 = generate_recorded(*model, par, request, gen_config);
  expect_run_matches_tp1(tp1, tp2, "loaded from a checkpoint");

  // Saving gathers the shards: the same tensors as the checkpoint they came from, bit for bit.
  const std::string again = dir + "/saved-by-tp";
  model->save_checkpoint(again);
  SafetensorsCheckpoint original(dir);
  SafetensorsCheckpoint saved(again);
  EXPECT_EQ(saved.names(), original.names());
  for (const std::string& name : original.names()) {
    if (saved.contains(name)) {
      EXPECT_TRUE(saved.tensor(name).equal(original.tensor(name))) << name;
    }
  }
}

TEST(DISABLED_TpModelFailureWorker, RankKilledMidGenerationRaisesOnTheOther) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = worker_context();
  const int64_t exiting = std::stoll(getenv_or("VLMGEN_TEST_EXITING_RANK", "1"));
  const QwenVlConfig config = test_config();
  Qwen2Vl model(config, 13, 0.02, par);
  GenerateRequest request = image_request(config);
  request.on_token = [&](const TokenEvent& e) {
    if (par.tp_rank() == exiting && e.step == 2) std::_Exit(0);  // dies between two steps
    return true;
  };
  Generator generator(model, par);
  const auto start = Clock::now();
  try {
    generator.generate(request, GenerationConfig().max_new_tokens(16));
    ADD_FAILURE() << "rank " << par.tp_rank() << ": generate returned although rank " << exiting << " died";
  } catch (const Error& e) {
    std::cerr << "rank " << par.tp_rank() << " got the expected error: " << e.what() << "\n";
    EXPECT_THAT(e.what(), HasSubstr("failed on rank " + std::to_string(par.tp_rank())));
  }
  const double elapsed = seconds_since(start);
  report("seconds until the surviving rank raised", elapsed);
  EXPECT_LT(elapsed, multiprocess::worker_timeout().count() / 1000.0 + 5.0);
}

// The engine under TP=2 (and TP=2 + SP): rank 0 takes the requests and sends each step's plan,
// rank 1 runs it. Requests with and without images and KV cache, greedy and seeded sampling, a
// repeated prompt (a prefix-cache hit on both ranks), and one cancelled from rank 0 mid-decode,
// submitted while others run: each request's tokens equal the TP=1 Generator running it alone,
// and both ranks stepped the same (an unsynchronised step would deadlock or fail a collective).
TEST(DISABLED_TpModelWorker, EngineEqualsTp1Generator) {
  SKIP_UNLESS_WORKER();
  const QwenVlConfig config = test_config();
  Qwen2Vl reference(config, 13);
  const std::vector<int64_t> single = image_prompt({1, 2, 3, 4, 5}, 4, {6, 7});
  struct Job {
    GenerateRequest request;
    GenerationConfig config;
  };
  const std::vector<Job> jobs = {
      {image_request(config), GenerationConfig().max_new_tokens(8)},
      {image_request(config), GenerationConfig().max_new_tokens(6).enable_kv_cache(false)},
      {odd_length_request(config), GenerationConfig().max_new_tokens(8).temperature(0.9).seed(7)},
      {GenerateRequest({{3, 4, 5, 6, 7, 8, 9}}), GenerationConfig().max_new_tokens(200)},
      {GenerateRequest({single}, make_vision(config, {{1, 4, 4}}, 90)), GenerationConfig().max_new_tokens(7)},
      {GenerateRequest({single}, make_vision(config, {{1, 4, 4}}, 90)), GenerationConfig().max_new_tokens(7)},
      {GenerateRequest({single}, make_vision(config, {{1, 4, 4}}, 91)), GenerationConfig().max_new_tokens(7)},
      {image_request(config), GenerationConfig().max_new_tokens(8)},
      {GenerateRequest({{5, 6, 7}}), GenerationConfig().max_new_tokens(8)},
      {GenerateRequest({{4, 5, 6}}), GenerationConfig().max_new_tokens(5)},
  };
  const size_t cancelled = 3;    // cancelled by rank 0 once it has 3 tokens
  const size_t row_stopped = 7;  // its streaming callback stops row 1 at its second token
  const size_t threw = 8;        // its streaming callback throws at the second token
  const size_t threw_last = 9;   // its streaming callback throws at the last token
  for (bool sequence_parallel : {false, true}) {
    auto [par, counter] = counted_context(sequence_parallel);
    Qwen2Vl model(config, 13, 0.02, par);
    const auto options =
        EngineOptions().max_running(3).prefix_block_columns(4).idle_plan_interval(std::chrono::milliseconds(20));
    const std::string what = fmt::format("SP {}", sequence_parallel);
    EngineMetrics metrics;
    if (par.tp_rank() == 0) {
      std::vector<GenerationResult> results(jobs.size());
      {
        Engine engine(model, options, par);
        std::vector<std::shared_ptr<RequestHandle>> handles;
        std::promise<void> three_tokens;
        int64_t seen = 0;
        for (size_t i = 0; i < jobs.size(); ++i) {
          GenerateRequest request = jobs[i].request;
          if (i == cancelled) {
            request.on_token = [&](const TokenEvent&) {
              if (++seen == 3) three_tokens.set_value();
              return true;
            };
          }
          if (i == row_stopped) {
            request.on_token = [](const TokenEvent& e) { return !(e.row == 1 && e.step == 1); };
          }
          if (i == threw || i == threw_last) {
            const int64_t at_step = i == threw ? 1 : jobs[i].config.max_new_tokens() - 1;
            request.on_token = [at_step](const TokenEvent& e) {
              if (e.step == at_step) throw std::runtime_error("the client went away");
              return true;
            };
          }
          if (i == 5) handles[4]->wait();  // the repeat comes once its first run is cached
          handles.push_back(engine.submit(request, jobs[i].config));
          if (i == cancelled) {
            three_tokens.get_future().wait();
            handles[cancelled]->cancel();
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(30));  // arrive while others run
        }
        for (size_t i = 0; i < jobs.size(); ++i) {
          if (i == threw || i == threw_last) {
            EXPECT_THROW(handles[i]->wait(), std::runtime_error) << what << ", request " << i;
            continue;
          }
          results[i] = handles[i]->wait();
        }
        metrics = engine.metrics();
        EXPECT_TRUE(engine.broken().empty()) << what << ": " << engine.broken();
      }
      for (size_t i = 0; i < jobs.size(); ++i) {
        if (i == threw || i == threw_last) continue;
        const GenerationResult alone = Generator(reference).generate(jobs[i].request, jobs[i].config);
        ASSERT_EQ(results[i].sequences.size(), alone.sequences.size()) << what << ", request " << i;
        for (size_t r = 0; r < alone.sequences.size(); ++r) {
          const auto& got = results[i].sequences[r].tokens;
          const auto& want = alone.sequences[r].tokens;
          if (i == row_stopped && r == 1) {
            EXPECT_EQ(results[i].sequences[r].finish_reason, FinishReason::kCancelled) << what;
            EXPECT_EQ(got, std::vector<int64_t>(want.begin(), want.begin() + 2)) << what;
          } else if (i == cancelled) {
            EXPECT_EQ(results[i].sequences[r].finish_reason, FinishReason::kCancelled) << what;
            ASSERT_GE(got.size(), 3u) << what;
            ASSERT_LT(got.size(), want.size()) << what;
            EXPECT_EQ(got, std::vector<int64_t>(want.begin(), want.begin() + static_cast<int64_t>(got.size()))) << what;
          } else {
            EXPECT_EQ(got, want) << what << ", request " << i << ", row " << r;
          }
        }
      }
      EXPECT_GE(metrics.prefix_cache_hits, 1) << what << ": the repeated prompt and picture";
    } else {
      Engine engine(model, options, par);
      EXPECT_THAT([&] { engine.submit(jobs[0].request, jobs[0].config); },
                  ThrowsMessage<Error>(HasSubstr("submit requests to rank 0's engine")));
      engine.join();
      metrics = engine.metrics();
    }
    EXPECT_GT(counter->all_reduces, 0) << what;
    if (sequence_parallel) {
      EXPECT_GT(counter->reduce_scatters, 0) << what;
    }
    // Both ranks stepped alike: the same steps, fused batches, tokens, cache hits and ended
    // requests.
    at::Tensor mine = at::tensor(std::vector<int64_t>{metrics.steps, metrics.decode_batches, metrics.generated_tokens,
                                                      metrics.prefix_cache_hit_columns, metrics.encoder_cache_hits,
                                                      metrics.finished + metrics.failed},
                                 at::kLong)
                          .reshape({1, 6});
    at::Tensor all = worker_comm().all_gather(mine, 0);
    EXPECT_TRUE(at::equal(all[0], all[1])) << what << ": " << all;
    EXPECT_GT(metrics.steps, 0) << what;
    EXPECT_EQ(metrics.finished + metrics.failed, static_cast<int64_t>(jobs.size())) << what;
    // The callback that threw mid-request ends it on every rank; the one that threw at the last
    // token fails it on rank 0 only (the others finished it with the same tokens).
    EXPECT_EQ(metrics.failed, par.tp_rank() == 0 ? 2 : 1) << what;
  }
}

// A request refused at start on one rank only (here rank 1's model allows shorter sequences, as a
// rank with less free memory might refuse a KV cache) ends on every rank before its first
// forward call, with an error that says so; the requests around it are served as usual.
TEST(DISABLED_TpModelWorker, ARequestRefusedOnOneRankEndsOnEveryRank) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = worker_context();
  const QwenVlConfig config = test_config();
  Qwen2Vl reference(config, 13);
  Qwen2Vl model(config, 13, 0.02, par);
  class ShorterSequences : public testing::ForwardingVlm {
   public:
    explicit ShorterSequences(CausalVlm& inner) : ForwardingVlm(inner), traits_(inner.traits()) {
      traits_.max_sequence_length = 40;
    }
    const ModelTraits& traits() const override { return traits_; }

   private:
    ModelTraits traits_;
  };
  ShorterSequences shorter(model);
  CausalVlm& mine = par.tp_rank() == 1 ? static_cast<CausalVlm&>(shorter) : model;
  Engine engine(mine, EngineOptions(), par);
  if (par.tp_rank() == 1) {
    engine.join();
    EXPECT_EQ(engine.metrics().failed, 1);
    return;
  }
  std::vector<int64_t> long_prompt(30);
  for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = 3 + static_cast<int64_t>(i % 20);
  const GenerateRequest short_request({{3, 4, 5, 6}});
  const auto short_config = GenerationConfig().max_new_tokens(6);
  auto refused = engine.submit(GenerateRequest({long_prompt}), GenerationConfig().max_new_tokens(20));
  auto served = engine.submit(short_request, short_config);
  EXPECT_THAT([&] { refused->wait(); },
              ThrowsMessage<Error>(HasSubstr("could not start on every tensor-parallel rank")));
  const GenerationResult alone = Generator(reference).generate(short_request, short_config);
  EXPECT_EQ(served->wait().sequences[0].tokens, alone.sequences[0].tokens);
  EXPECT_EQ(engine.submit(short_request, short_config)->wait().sequences[0].tokens, alone.sequences[0].tokens)
      << "a request after the refused one";
  EXPECT_EQ(engine.metrics().failed, 1);
  EXPECT_TRUE(engine.broken().empty());
}

// Engines built with other options drift apart: rank 1 refuses the first plan, before any
// collective of the model, naming the option; rank 0 learns it from the plan's answer and ends
// the request at once (not at the communicator's timeout), then refuses what comes next.
TEST(DISABLED_TpModelFailureWorker, EnginesWithOtherOptionsFailInsteadOfHanging) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = worker_context();
  const QwenVlConfig config = test_config();
  Qwen2Vl model(config, 13, 0.02, par);
  auto options = EngineOptions();
  if (par.tp_rank() == 1) options.prefill_columns_per_step(64);
  Engine engine(model, options, par);
  if (par.tp_rank() == 1) {
    EXPECT_THAT([&] { engine.join(); }, ThrowsMessage<Error>(AllOf(HasSubstr("rank 1's engine drifted from rank 0's"),
                                                                   HasSubstr("prefill_columns_per_step 64 vs 512"))));
    return;
  }
  const auto start = Clock::now();
  auto first = engine.submit(image_request(config), GenerationConfig().max_new_tokens(4));
  EXPECT_THAT([&] { first->wait(); },
              ThrowsMessage<Error>(HasSubstr("tensor-parallel rank(s) [1] could not run rank 0's step plan")));
  EXPECT_THAT([&] { engine.submit(image_request(config), GenerationConfig().max_new_tokens(4)); },
              ThrowsMessage<Error>(HasSubstr("the engine stopped")));
  EXPECT_FALSE(engine.broken().empty());
  EXPECT_LT(seconds_since(start), 4.0) << "the communicator's timeout is 5 s: rank 0 must not wait for it";
}

// A request that fails on rank 1 only, after the step's collectives (as copying its KV prefix
// into the cache might, for lack of memory), would leave the ranks with different requests: the
// check after the step finds the difference and stops the engine on both ranks. (A failure in
// the middle of a step's collectives mispairs them instead, which hangs or aborts.) Here every
// rank gathers the full vocabulary inside forward, so sampling needs no collective, and rank 1
// then fails the 23-column prefill.
TEST(DISABLED_TpModelFailureWorker, AFailureOnOneRankOnlyStopsTheEngineOnEveryRank) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = worker_context();
  const QwenVlConfig config = test_config();
  Qwen2Vl model(config, 13, 0.02, par);
  class GatheredLogits : public testing::ForwardingVlm {
   public:
    GatheredLogits(CausalVlm& inner, Communicator& group, bool fail_prefill)
        : ForwardingVlm(inner), group_(group), fail_prefill_(fail_prefill), traits_(inner.traits()) {
      traits_.vocab_parallel_logits = false;
    }
    const ModelTraits& traits() const override { return traits_; }
    at::Tensor forward(const ForwardArgs& args) override {
      at::Tensor logits = group_.all_gather(inner_.forward(args), -1);
      if (fail_prefill_ && args.input_ids.size(-1) == 23) throw Error("out of memory on this rank (simulated)");
      return logits;
    }
    std::vector<at::Tensor> forward_batch(const std::vector<const ForwardArgs*>& calls) override {
      std::vector<at::Tensor> out;
      for (const ForwardArgs* call : calls) out.push_back(forward(*call));
      return out;
    }

   private:
    Communicator& group_;
    bool fail_prefill_;
    ModelTraits traits_;
  };
  GatheredLogits mine(model, *par.tp_group(), /*fail_prefill=*/par.tp_rank() == 1);
  Engine engine(mine, EngineOptions(), par);
  if (par.tp_rank() == 1) {
    EXPECT_THAT([&] { engine.join(); }, ThrowsMessage<Error>(HasSubstr("sets of requests failing in one step")));
    return;
  }
  std::vector<int64_t> prompt(23);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = 3 + static_cast<int64_t>(i % 20);
  auto handle = engine.submit(GenerateRequest({prompt}), GenerationConfig().max_new_tokens(5));
  EXPECT_THAT([&] { handle->wait(); },
              ThrowsMessage<Error>(HasSubstr("the tensor-parallel ranks can no longer step together")));
  EXPECT_THAT(engine.broken(), HasSubstr("a request failed on some ranks only"));
  EXPECT_THAT(
      [&] {
        engine.submit(GenerateRequest({{3, 4, 5}}), GenerationConfig());
      },
      ThrowsMessage<Error>(HasSubstr("the engine stopped")));
}

// ---------------------------------------------------------------------------------------------
// The launching tests: two ranks (two_rank_env).

TEST(TensorParallelModel, GreedyTp2EqualsTp1WithAndWithoutKvCache) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.GreedyWithImageEqualsTp1WithAndWithoutKvCache", two_rank_env()), 0);
}

TEST(TensorParallelModel, Qwen2_5VlAndQwen3VlEqualTp1UnderTpAndSp) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.NewFamiliesEqualTp1UnderTpAndSp", two_rank_env()), 0);
}

TEST(TensorParallelModel, Gemma3Tp2EqualsTp1) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.Gemma3EqualsTp1", two_rank_env()), 0);
}

TEST(TensorParallelModel, LlavaNextTp2EqualsTp1) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.LlavaNextEqualsTp1", two_rank_env()), 0);
}

TEST(TensorParallelModel, EngineTp2EqualsTp1Generator) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.EngineEqualsTp1Generator", two_rank_env()), 0);
}

TEST(TensorParallelModel, ARequestRefusedOnOneRankEndsOnEveryRank) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.ARequestRefusedOnOneRankEndsOnEveryRank", two_rank_env()), 0);
}

TEST(TensorParallelModel, ScoresTp2EqualTp1) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.ScoresEqualTp1", two_rank_env()), 0);
}

TEST(TensorParallelModel, RanksGivenDifferentRequestsAllRaise) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.RanksGivenDifferentRequestsAllRaise", two_rank_env()), 0);
}

TEST(TensorParallelModel, SequenceParallelWithOddPromptEqualsTp1) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.SequenceParallelOddPromptEqualsTp1", two_rank_env()), 0);
}

TEST(TensorParallelModel, NoCacheFallbackUnderSpReplaysVisionOnEveryRank) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.NoCacheFallbackUnderSpReplaysVisionEveryStep", two_rank_env()), 0);
}

TEST(TensorParallelModel, SeededSamplingTp2EqualsTp1) {
  // Both sampling workers in one launch: one process start-up for two tests.
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.SeededSamplingEqualsTp1", two_rank_env()), 0);
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.SamplerOnVocabShardsEqualsSamplerOnFullVocabulary", two_rank_env()),
            0);
}

TEST(TensorParallelModel, CheckpointShardedAtLoadGatheredAtSave) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("vlmgen_tp_checkpoint_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  QwenVlConfig config = test_config();
  config.tie_word_embeddings = true;
  Qwen2Vl(config, 21).save_checkpoint(dir.string());
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.CheckpointLoadsThisRanksSlicesAndSavesWhole",
                        two_rank_env({{"VLMGEN_TEST_CHECKPOINT", dir.string()}})),
            0);
  std::filesystem::remove_all(dir);
}

// An FP8 checkpoint whose scale blocks (24 x 40) the TP=2 shard boundaries cut through: each
// rank dequantizes whole tensors and keeps its slice, so per-step logits equal TP=1's.
TEST(DISABLED_TpModelWorker, Fp8CheckpointEqualsTp1) {
  SKIP_UNLESS_WORKER();
  const ParallelContext& par = worker_context();
  const std::string dir = getenv_or("VLMGEN_TEST_CHECKPOINT", "");
  ASSERT_FALSE(dir.empty()) << "the launching test passes VLMGEN_TEST_CHECKPOINT";
  LoadOptions options;
  options.keep_fp8 = getenv_or("VLMGEN_TEST_KEEP_FP8", "0") == "1";  // compute from the bytes, sharded
  auto reference = QwenVl::from_checkpoint(dir, ParallelContext::single(), options);
  auto model = QwenVl::from_checkpoint(dir, par, options);
  EXPECT_EQ(model->keeps_fp8(), options.keep_fp8);
  EXPECT_EQ(reference->keeps_fp8(), options.keep_fp8);
  const GenerateRequest request = image_request(reference->config());
  double worst = 0.0;
  for (const bool kv : {true, false}) {
    const auto gen_config = GenerationConfig().max_new_tokens(6).enable_kv_cache(kv);
    RecordedRun tp1 = generate_recorded(*reference, ParallelContext::single(), request, gen_config);
    RecordedRun tp2 = generate_recorded(*model, par, request, gen_config);
    worst = std::max(worst, expect_run_matches_tp1(tp1, tp2, kv ? "FP8, KV cache" : "FP8, no cache"));
    expect_same_tokens_on_every_rank(tp2.result, *par.tp_group(), 6);
  }
  report("FP8 checkpoint: TP=2 vs TP=1 per-step logits, max|diff|", worst);
}

TEST(TensorParallelModel, Fp8CheckpointTp2EqualsTp1) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("vlmgen_tp_fp8_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  Qwen2Vl(test_config(), 23).save_checkpoint((dir / "f32").string());
  QuantizeOptions options;
  options.block = {24, 40};
  quantize_checkpoint((dir / "f32").string(), (dir / "fp8").string(), options);
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.Fp8CheckpointEqualsTp1",
                        two_rank_env({{"VLMGEN_TEST_CHECKPOINT", (dir / "fp8").string()}})),
            0);
  // Blocks of 16 x 16 split evenly at every shard edge: each rank keeps its slice of the bytes and
  // of the scale grid (LoadOptions::keep_fp8) and computes from them.
  options.block = {16, 16};
  quantize_checkpoint((dir / "f32").string(), (dir / "fp8-16").string(), options);
  EXPECT_EQ(
      run_workers(2, "DISABLED_TpModelWorker.Fp8CheckpointEqualsTp1",
                  two_rank_env({{"VLMGEN_TEST_CHECKPOINT", (dir / "fp8-16").string()}, {"VLMGEN_TEST_KEEP_FP8", "1"}})),
      0);
  std::filesystem::remove_all(dir);
}

TEST(TensorParallelModel, EnginesWithOtherOptionsFailInsteadOfHanging) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelFailureWorker.EnginesWithOtherOptionsFailInsteadOfHanging",
                        {{"VLMGEN_TEST_TP", "2"}, {"VLMGEN_TEST_TIMEOUT_MS", "5000"}}, std::chrono::seconds(45)),
            0);
}

TEST(TensorParallelModel, AFailureOnOneRankOnlyStopsTheEngineOnEveryRank) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelFailureWorker.AFailureOnOneRankOnlyStopsTheEngineOnEveryRank",
                        {{"VLMGEN_TEST_TP", "2"}, {"VLMGEN_TEST_TIMEOUT_MS", "5000"}}, std::chrono::seconds(45)),
            0);
}

TEST(TensorParallelModel, RankKilledMidGenerationRaisesOnTheOther) {
  for (const char* exiting : {"1", "0"}) {  // a peer, then the rank serving the store
    const auto start = Clock::now();
    EXPECT_EQ(run_workers(
                  2, "DISABLED_TpModelFailureWorker.RankKilledMidGenerationRaisesOnTheOther",
                  {{"VLMGEN_TEST_TP", "2"}, {"VLMGEN_TEST_TIMEOUT_MS", "5000"}, {"VLMGEN_TEST_EXITING_RANK", exiting}},
                  std::chrono::seconds(45)),
              0)
        << "exiting rank " << exiting;
    EXPECT_LT(seconds_since(start), 30.0) << "exiting rank " << exiting;
  }
}

// ---------------------------------------------------------------------------------------------
// In this process: layouts and load-time checks, with a group that must not be used.

TEST(TensorParallelModelTest, HeadsThatDoNotDivideAreAnErrorBeforeAnyWork) {
  const QwenVlConfig config = test_config();  // 4 heads, 2 KV heads, MLP 96, vocabulary 96
  EXPECT_THAT([&] { Qwen2Vl(config, 0, 0.02, without_collectives(0, 3)); },
              ThrowsMessage<Error>(AllOf(HasSubstr("tensor-parallel size 3"), HasSubstr("num_attention_heads 4"),
                                         HasSubstr("not divisible by 3"))));
  EXPECT_THAT([&] { Qwen2Vl(config, 0, 0.02, without_collectives(1, 4)); },
              ThrowsMessage<Error>(AllOf(HasSubstr("num_key_value_heads 2"), HasSubstr("not divisible by 4"))));
  QwenVlConfig odd_vocab = config;
  odd_vocab.vocab_size = 95;
  EXPECT_THAT([&] { Qwen2Vl(odd_vocab, 0, 0.02, without_collectives(0, 2)); },
              ThrowsMessage<Error>(AllOf(HasSubstr("vocab_size 95"), HasSubstr("not divisible by 2"))));

  // At load: right after config.json, before the weights are even opened (this directory has
  // none) and without any collective.
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("vlmgen_tp_config_only_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  {
    std::FILE* f = std::fopen((dir / "config.json").c_str(), "wb");
    ASSERT_NE(f, nullptr);
    const std::string json = config.to_json();
    std::fwrite(json.data(), 1, json.size(), f);
    std::fclose(f);
  }
  EXPECT_THAT([&] { Qwen2Vl::from_checkpoint(dir.string(), without_collectives(2, 3)); },
              ThrowsMessage<Error>(AllOf(HasSubstr("num_attention_heads 4"), HasSubstr("tensor-parallel size 3"))));
  EXPECT_THAT([&] { Qwen2Vl::from_checkpoint(dir.string()); },
              ThrowsMessage<Error>(HasSubstr("neither model.safetensors")));
  std::filesystem::remove_all(dir);
}

TEST(TensorParallelModelTest, RandomInitGivesEachRankSlicesOfTheSameModel) {
  for (int64_t vision_heads : {2, 1}) {
    const QwenVlConfig config = test_config(vision_heads);
    Qwen2Vl whole(config, 5);
    std::map<std::string, const at::Tensor*> full;
    for (const auto& [name, t] : whole.named_weights()) full[name] = t;
    for (int64_t rank : {0, 1}) {
      Qwen2Vl part(config, 5, 0.02, without_collectives(rank, 2));  // no collective on construction
      EXPECT_EQ(part.vision_tower_sharded(), vision_heads == 2);
      for (const auto& [name, t] : part.named_weights()) {
        const bool vision = name.rfind("visual.", 0) == 0;
        const ShardLayout layout = vision && vision_heads == 1 ? ShardLayout::kReplicated : layout_by_name(name);
        EXPECT_EQ(part.shard_layout(name), layout) << name;
        EXPECT_TRUE(t->equal(expected_slice(*full.at(name), layout, rank, 2)))
            << name << " on rank " << rank << " (vision heads " << vision_heads << ")";
      }
    }
  }
  // Single process: every weight whole.
  Qwen2Vl single(test_config(), 5);
  EXPECT_EQ(single.shard_layout("model.layers.0.self_attn.q_proj.weight"), ShardLayout::kReplicated);
  EXPECT_FALSE(single.traits().vocab_parallel_logits);
  EXPECT_THAT([&] { single.shard_layout("model.no_such.weight"); },
              ThrowsMessage<Error>(HasSubstr("no weight named 'model.no_such.weight'")));
}

TEST(TensorParallelModelTest, GeneratorWithoutTheModelsParallelContextIsAnError) {
  // A rank's shard driven by a Generator that was not given the group: logits cover half the
  // vocabulary, which the generator refuses with the numbers instead of sampling from them.
  class HalfVocabulary : public CausalVlm {
   public:
    HalfVocabulary() {
      traits_.vocab_size = 96;
      traits_.vocab_parallel_logits = true;
      traits_.supports_kv_cache = false;
    }
    const ModelTraits& traits() const override { return traits_; }
    at::Tensor forward(const ForwardArgs& args) override {
      return at::zeros({args.input_ids.size(0), args.input_ids.size(1), 48});
    }

   private:
    ModelTraits traits_;
  };
  HalfVocabulary model;
  EXPECT_THAT(
      [&] {
        Generator(model).generate(GenerateRequest(std::vector<std::vector<int64_t>>{{1, 2, 3}}),
                                  GenerationConfig().enable_kv_cache(false));
      },
      ThrowsMessage<Error>(AllOf(HasSubstr("[1, 3, 48]"), HasSubstr(">= 96"),
                                 HasSubstr("give the Generator the model's ParallelContext"))));
}

}  // namespace
}  // namespace vlmgen
