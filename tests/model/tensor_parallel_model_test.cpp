// Tensor and sequence parallelism of the reference model, end to end: Qwen2-VL, Qwen2.5-VL,
// Qwen3-VL, Gemma-3 and LLaVA-NeXT split over two ranks (Gloo on loopback, processes started by the
// test) against the same model in one process, through the Generator; the SP -> no-cache fallback.
// Every multi-process test is bounded in time (launch timeout + collectives' timeout), so a broken
// group fails instead of hanging.
//
// Workers compare against a TP=1 run computed inside each worker (same seed, same weights), so
// every rank checks its own tokens and its own block of the logits.
//
// More of tensor parallelism: tensor_parallel_generator_test.cpp (scores, sampling, ranks given
// different requests or killed), tensor_parallel_engine_test.cpp (the engine) and
// tensor_parallel_sharding_test.cpp (checkpoints, shard layouts and load-time checks).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "multiprocess_test_util.h"
#include "qwen_test_util.h"
#include "tp_test_util.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/generator.h"
#include "vlmgen/logging.h"
#include "vlmgen/models/gemma3.h"
#include "vlmgen/models/llava_next.h"
#include "vlmgen/models/qwen2_vl.h"
#include "vlmgen/parallel.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)
using namespace tp_test;    // NOLINT(google-build-using-namespace)

using multiprocess::run_workers;
using multiprocess::worker_comm;
using multiprocess::worker_context;
using ::testing::AllOf;
using ::testing::HasSubstr;

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

TEST(TensorParallelModel, SequenceParallelWithOddPromptEqualsTp1) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.SequenceParallelOddPromptEqualsTp1", two_rank_env()), 0);
}

TEST(TensorParallelModel, NoCacheFallbackUnderSpReplaysVisionOnEveryRank) {
  EXPECT_EQ(run_workers(2, "DISABLED_TpModelWorker.NoCacheFallbackUnderSpReplaysVisionEveryStep", two_rank_env()), 0);
}

}  // namespace
}  // namespace vlmgen
