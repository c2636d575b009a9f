// The fused CPU decode step of the Qwen-family decoders against the same layers run op by op
// (VLMGEN_FUSED_DECODE=0): logits and KV caches equal bit for bit in each family, with float32,
// bfloat16 and FP8 weights, a ragged batch with an image, and the engine's several requests in
// one step; and the fused step does run: its ATen calls do not grow with the layer count.

#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "qwen_test_util.h"
#include "vlmgen/generator.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/models/quantization.h"
#include "vlmgen/models/qwen_vl.h"
#include "vlmgen/testing/forward_spy.h"

namespace vlmgen {
namespace {

using namespace qwen_test;  // NOLINT(google-build-using-namespace)

/// Sets VLMGEN_FUSED_DECODE for its lifetime (the model reads it at every step).
class FusedDecodeSetting {
 public:
  explicit FusedDecodeSetting(const char* value) {
    const char* before = std::getenv(kName);
    if (before != nullptr) before_ = before;
    setenv(kName, value, 1);
  }
  ~FusedDecodeSetting() {
    if (before_) {
      setenv(kName, before_->c_str(), 1);
    } else {
      unsetenv(kName);
    }
  }

 private:
  static constexpr const char* kName = "VLMGEN_FUSED_DECODE";
  std::optional<std::string> before_;
};

/// The ATen calls `fn` makes on this thread.
template <class F>
int64_t count_aten_calls(F&& fn) {
  static std::atomic<int64_t> calls{0};
  calls = 0;
  const at::CallbackHandle handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction&) -> std::unique_ptr<at::ObserverContext> {
        ++calls;
        return nullptr;
      }).scopes({at::RecordScope::FUNCTION}));
  fn();
  at::removeCallback(handle);
  return calls.load();
}

/// What a generation leaves: the logits of every call and the KV cache it filled.
struct Run {
  std::vector<at::Tensor> logits;
  std::vector<at::Tensor> keys, values;  // per layer, the committed columns
  std::vector<std::vector<int64_t>> tokens;
  int64_t aten_calls = 0;
};

/// Greedy generation over a ragged batch with an image in its first row, into a context of the
/// caller's (so its K/V can be compared).
Run generate(QwenVl& model, bool fused) {
  const QwenVlConfig& c = model.config();
  std::optional<FusedDecodeSetting> setting;
  if (!fused) setting.emplace("0");
  const std::vector<std::vector<int64_t>> prompts = {image_prompt({1, 2}, 4, {3, 4, 5}), {6, 7, 8}, {9, 10, 11, 12}};
  const VisionInputs vision = make_vision(c, {{1, 4, 4}}, 21);
  auto context = InferenceContext::allocate(model.traits().kv_cache, 3, 32);
  testing::ForwardSpy spy(model);
  spy.record_tensors(true);
  GenerationResult result;
  Run run;
  run.aten_calls = count_aten_calls([&] {
    result = Generator(spy).generate(make_request(prompts, vision, context.get()),
                                     GenerationConfig().max_new_tokens(7).enable_kv_cache(true));
  });
  for (const auto& call : spy.calls()) run.logits.push_back(call.logits);
  for (int64_t layer = 0; layer < context->num_layers(); ++layer) {
    auto [k, v] = context->kv(layer);
    run.keys.push_back(k.clone());
    run.values.push_back(v.clone());
  }
  for (const auto& row : result.sequences) run.tokens.push_back(row.tokens);
  return run;
}

void expect_identical(const Run& fused, const Run& op_by_op, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(fused.logits.size(), op_by_op.logits.size());
  ASSERT_GE(fused.logits.size(), 7u);  // the prefill and six decode steps
  for (size_t i = 0; i < fused.logits.size(); ++i)
    EXPECT_TRUE(at::equal(fused.logits[i], op_by_op.logits[i]))
        << "call " << i << ": max |diff| " << max_abs_diff(fused.logits[i], op_by_op.logits[i]);
  for (size_t layer = 0; layer < fused.keys.size(); ++layer) {
    EXPECT_TRUE(at::equal(fused.keys[layer], op_by_op.keys[layer])) << "keys of layer " << layer;
    EXPECT_TRUE(at::equal(fused.values[layer], op_by_op.values[layer])) << "values of layer " << layer;
  }
  EXPECT_EQ(fused.tokens, op_by_op.tokens);
  // And the fused step ran: op by op, each of the six decode steps makes ~80 ATen calls a layer.
  const auto layers = static_cast<int64_t>(fused.keys.size());
  EXPECT_LT(fused.aten_calls + 6 * 40 * layers, op_by_op.aten_calls)
      << "fused " << fused.aten_calls << ", op by op " << op_by_op.aten_calls;
}

using DecodeRun = Run;  // inside a test fixture Run names testing::Test::Run

class FusedDecodeTest : public ::testing::TestWithParam<QwenFamily> {
 protected:
  FusedDecodeTest() : config_(QwenVlConfig::tiny(GetParam())), model_(config_, 0) {
    fill_hashed_weights(model_);
    model_.save_checkpoint(scratch_.dir("f32"));
  }
  std::unique_ptr<QwenVl> load(const std::string& dir, LoadOptions options) {
    std::unique_ptr<CausalVlm> m = load_model(dir, ParallelContext::single(), options);
    auto* qwen = dynamic_cast<QwenVl*>(m.get());
    if (qwen == nullptr) {
      ADD_FAILURE() << dir << " did not load as a QwenVl";
      return nullptr;
    }
    m.release();
    return std::unique_ptr<QwenVl>(qwen);
  }

  /// The float32 checkpoint over a `kv_dtype` cache: its fused step writes and reads the cache as
  /// the layers op by op do, bit for bit, with float32 weights, in the engine's several-request
  /// step, and with FP8 weights. Returns the model and its fused run (null if it did not load).
  std::pair<std::unique_ptr<QwenVl>, DecodeRun> expect_fused_like_op_by_op_over(at::ScalarType kv_dtype,
                                                                                const std::string& cache);

  QwenVlConfig config_;
  QwenVl model_;
  ScratchDir scratch_;
};

TEST_P(FusedDecodeTest, EqualsTheLayersOpByOpBitForBitWithEveryWeightDtype) {
  expect_identical(generate(model_, true), generate(model_, false), "float32");
  LoadOptions bf16;
  bf16.weights_dtype = at::kBFloat16;
  std::unique_ptr<QwenVl> half = load(scratch_.dir("f32"), bf16);
  ASSERT_NE(half, nullptr);
  expect_identical(generate(*half, true), generate(*half, false), "bfloat16");
  QuantizeOptions quantize;
  quantize.block = {16, 16};
  quantize_checkpoint(scratch_.dir("f32"), scratch_.dir("fp8"), quantize);
  LoadOptions fp8;
  fp8.keep_fp8 = true;
  std::unique_ptr<QwenVl> bytes = load(scratch_.dir("fp8"), fp8);
  ASSERT_NE(bytes, nullptr);
  ASSERT_TRUE(bytes->keeps_fp8());
  expect_identical(generate(*bytes, true), generate(*bytes, false), "fp8");
}

/// Prefills each request in its own context, then runs `steps` decode steps of all of them in one
/// forward_batch call per step (the engine's way): the logits of every step, then every layer's
/// keys and values of each context; `aten_calls` gets the decode steps' ATen calls.
std::vector<at::Tensor> batched_decode(QwenVl& model, bool fused, int steps, int64_t& aten_calls) {
  std::optional<FusedDecodeSetting> setting;
  if (!fused) setting.emplace("0");
  const std::vector<std::vector<std::vector<int64_t>>> requests = {{{1, 2, 3}}, {{4, 5, 6, 7, 8}, {0, 0, 9, 10, 11}}};
  std::vector<std::unique_ptr<InferenceContext>> contexts;
  std::vector<at::Tensor> masks, last;
  for (const auto& rows : requests) {
    const auto b = static_cast<int64_t>(rows.size());
    const auto l = static_cast<int64_t>(rows[0].size());
    std::vector<int64_t> flat;
    for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
    const at::Tensor ids = at::tensor(flat, at::kLong).view({b, l});
    const at::Tensor mask = ids.ne(0).to(at::kLong);
    contexts.push_back(InferenceContext::allocate(model.traits().kv_cache, b, 16));
    ForwardArgs args;
    args.input_ids = ids;
    args.attention_mask = mask;
    args.position_ids = model.plan_positions(ids, mask, {}).prompt_positions;
    args.context = contexts.back().get();
    last.push_back(model.forward(args).select(1, l - 1).argmax(-1).unsqueeze(1));
    contexts.back()->commit(ids, mask);
    masks.push_back(mask);
  }
  std::vector<at::Tensor> out;
  for (int step = 0; step < steps; ++step) {
    std::vector<ForwardArgs> args(requests.size());
    std::vector<const ForwardArgs*> calls;
    for (size_t i = 0; i < requests.size(); ++i) {
      const int64_t b = masks[i].size(0), start = masks[i].size(1);
      masks[i] = at::cat({masks[i], at::ones({b, 1}, at::kLong)}, 1);
      args[i].input_ids = last[i];
      args[i].attention_mask = masks[i];
      // Text only: every axis at the row's real-token count.
      args[i].position_ids = masks[i].narrow(1, 0, start).sum(1).view({1, b, 1}).expand({3, b, 1}).contiguous();
      args[i].context = contexts[i].get();
      args[i].window_start = start;
      calls.push_back(&args[i]);
    }
    std::vector<at::Tensor> logits;
    aten_calls += count_aten_calls([&] { logits = model.forward_batch(calls); });
    for (size_t i = 0; i < requests.size(); ++i) {
      contexts[i]->commit(args[i].input_ids, at::ones_like(args[i].input_ids));
      last[i] = logits[i].select(1, 0).argmax(-1).unsqueeze(1);
      out.push_back(logits[i]);
    }
  }
  for (const auto& context : contexts) {
    for (int64_t layer = 0; layer < context->num_layers(); ++layer) {
      auto [k, v] = context->kv(layer);
      out.push_back(k.clone());
      out.push_back(v.clone());
    }
  }
  return out;
}

TEST_P(FusedDecodeTest, SeveralRequestsInOneStepEqualTheLayersOpByOp) {
  int64_t fused_calls = 0, op_calls = 0;
  const std::vector<at::Tensor> fused = batched_decode(model_, true, 4, fused_calls);
  const std::vector<at::Tensor> op_by_op = batched_decode(model_, false, 4, op_calls);
  ASSERT_EQ(fused.size(), op_by_op.size());
  for (size_t i = 0; i < fused.size(); ++i) EXPECT_TRUE(at::equal(fused[i], op_by_op[i])) << "logits or K/V " << i;
  EXPECT_LT(fused_calls + 4 * 40 * config_.num_hidden_layers, op_calls)
      << "the fused step did not run: " << fused_calls << " ATen calls against " << op_calls;
}

std::pair<std::unique_ptr<QwenVl>, DecodeRun> FusedDecodeTest::expect_fused_like_op_by_op_over(
    at::ScalarType kv_dtype, const std::string& cache) {
  LoadOptions options;
  options.kv_cache_dtype = kv_dtype;
  std::unique_ptr<QwenVl> model = load(scratch_.dir("f32"), options);
  if (model == nullptr) return {};
  EXPECT_EQ(model->traits().kv_cache.dtype, kv_dtype);
  DecodeRun fused = generate(*model, true);
  EXPECT_EQ(fused.keys[0].scalar_type(), kv_dtype);
  expect_identical(fused, generate(*model, false), "float32 weights, " + cache);
  int64_t fused_calls = 0, op_calls = 0;
  const std::vector<at::Tensor> batched = batched_decode(*model, true, 3, fused_calls);
  const std::vector<at::Tensor> batched_op = batched_decode(*model, false, 3, op_calls);
  EXPECT_EQ(batched.size(), batched_op.size());
  for (size_t i = 0; i < batched.size() && i < batched_op.size(); ++i)
    EXPECT_TRUE(at::equal(batched[i], batched_op[i])) << cache << ", engine step " << i;
  EXPECT_LT(fused_calls + 3 * 40 * config_.num_hidden_layers, op_calls);

  QuantizeOptions quantize;
  quantize.block = {16, 16};
  const std::string fp8_dir = scratch_.dir("fp8-" + std::string(c10::toString(kv_dtype)));
  quantize_checkpoint(scratch_.dir("f32"), fp8_dir, quantize);
  options.keep_fp8 = true;
  std::unique_ptr<QwenVl> bytes = load(fp8_dir, options);
  if (bytes != nullptr) expect_identical(generate(*bytes, true), generate(*bytes, false), "fp8 weights, " + cache);
  return {std::move(model), std::move(fused)};
}

// A bfloat16 KV cache (LoadOptions::kv_cache_dtype): the fused step writes and reads it as the
// layers op by op do (ATen's rounding on the way in), bit for bit, with float32 and FP8 weights
// and in the engine's several-request step; the cache takes half the bytes; layer 0's keys and
// values are the float32 cache's rounded to bfloat16; and the logits stay near float32's.
TEST_P(FusedDecodeTest, ABfloat16KvCacheIsWrittenAndReadAsTheLayersOpByOpDo) {
  auto [model, fused] = expect_fused_like_op_by_op_over(at::kBFloat16, "bfloat16 cache");
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(InferenceContext(model->traits().kv_cache, 1, 8).bytes() * 2,
            InferenceContext(model_.traits().kv_cache, 1, 8).bytes());
  const auto exact = generate(model_, true);
  const int64_t prompt = 10;  // the image row's prompt: the columns every run computes alike
  EXPECT_TRUE(at::equal(fused.keys[0].narrow(2, 0, prompt), exact.keys[0].narrow(2, 0, prompt).to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(fused.values[0].narrow(2, 0, prompt), exact.values[0].narrow(2, 0, prompt).to(at::kBFloat16)));
  const double drift = max_abs_diff(fused.logits[0], exact.logits[0]) / exact.logits[0].abs().max().item<double>();
  report("bfloat16 cache: prefill logits' largest difference from float32's, relative", drift);
  EXPECT_GT(drift, 0.0);  // the cache was rounded
  EXPECT_LT(drift, 2e-2);

  try {
    model->set_kv_cache_dtype(at::kHalf);
    ADD_FAILURE() << "a float16 KV cache was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("float32, bfloat16 or FP8 (Byte), not Half"), std::string::npos) << e.what();
  }
  EXPECT_EQ(model->traits().kv_cache.dtype, at::kBFloat16);  // unchanged by the refusal
}

// An FP8 KV cache (LoadOptions::kv_cache_dtype = at::kByte): the fused step encodes and reads its
// rows as the layers op by op do (append_kv's encoding), bit for bit, with float32 and FP8 weights
// and in the engine's several-request step; a row takes head_dim + 4 bytes; layer 0's rows are
// the float32 cache's keys and values encoded (encode_fp8_kv), and read back within E4M3's half
// step of them; the logits stay near float32's.
TEST_P(FusedDecodeTest, AnFp8KvCacheIsWrittenAndReadAsTheLayersOpByOpDo) {
  auto [model, fused] = expect_fused_like_op_by_op_over(at::kByte, "FP8 cache");
  ASSERT_NE(model, nullptr);
  const int64_t d = config_.head_dim;
  EXPECT_EQ(InferenceContext(model->traits().kv_cache, 1, 8).bytes() * 4 * d,
            InferenceContext(model_.traits().kv_cache, 1, 8).bytes() * (d + 4));
  ASSERT_EQ(fused.keys[0].size(3), d + 4);

  const auto exact = generate(model_, true);
  const int64_t prompt = 10;  // the image row's prompt: the columns every run computes alike
  const at::Tensor exact_keys = exact.keys[0].narrow(2, 0, prompt);
  EXPECT_TRUE(at::equal(fused.keys[0].narrow(2, 0, prompt), encode_fp8_kv(exact_keys)));
  EXPECT_TRUE(at::equal(fused.values[0].narrow(2, 0, prompt), encode_fp8_kv(exact.values[0].narrow(2, 0, prompt))));
  const at::Tensor read_back = decode_fp8_kv(fused.keys[0].narrow(2, 0, prompt));
  const at::Tensor row_amax = exact_keys.abs().amax(-1, /*keepdim=*/true);
  EXPECT_TRUE((read_back - exact_keys).abs().le(row_amax * 0x1p-4 + 1e-30).all().item<bool>());
  const double drift = max_abs_diff(fused.logits[0], exact.logits[0]) / exact.logits[0].abs().max().item<double>();
  report("FP8 cache: prefill logits' largest difference from float32's, relative", drift);
  EXPECT_GT(drift, 0.0);  // the cache was rounded
  EXPECT_LT(drift, 0.1);
  try {  // the FP8 cache is read by the CPU's kernels: moving the model elsewhere is refused up front
    model->to(at::Device(at::kCUDA));
    ADD_FAILURE() << "a model with an FP8 KV cache moved to CUDA";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("FP8 KV cache is for models on the CPU"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(model->device().is_cpu());
}

/// ATen calls made during one decode step of `model` over a prefilled context.
int64_t aten_calls_in_a_decode_step(QwenVl& model) {
  const at::Tensor ids = at::tensor(std::vector<int64_t>{1, 2, 3, 4}, at::kLong).view({1, 4});
  const at::Tensor mask = at::ones({1, 4}, at::kLong);
  auto context = InferenceContext::allocate(model.traits().kv_cache, 1, 8);
  ForwardArgs prefill;
  prefill.input_ids = ids;
  prefill.attention_mask = mask;
  prefill.position_ids = model.plan_positions(ids, mask, {}).prompt_positions;
  prefill.context = context.get();
  model.forward(prefill);
  context->commit(ids, mask);
  ForwardArgs step;
  step.input_ids = at::full({1, 1}, 5, at::kLong);
  step.attention_mask = at::ones({1, 5}, at::kLong);
  step.position_ids = at::full({3, 1, 1}, 4, at::kLong);
  step.context = context.get();
  step.window_start = 4;
  return count_aten_calls([&] { model.forward(step); });
}

TEST_P(FusedDecodeTest, AFusedStepMakesNoAtenCallPerLayer) {
  QwenVlConfig deeper = config_;
  deeper.num_hidden_layers = config_.num_hidden_layers + 3;
  QwenVl deep(deeper, 0);
  fill_hashed_weights(deep);
  const int64_t shallow_calls = aten_calls_in_a_decode_step(model_);
  const int64_t deep_calls = aten_calls_in_a_decode_step(deep);
  std::printf("[ measured ] ATen calls in a fused decode step: %lld (%lld layers), %lld (%lld layers)\n",
              static_cast<long long>(shallow_calls), static_cast<long long>(config_.num_hidden_layers),
              static_cast<long long>(deep_calls), static_cast<long long>(deeper.num_hidden_layers));
  EXPECT_GT(shallow_calls, 0);  // the counter counts (the step's embedding and output layer)
  EXPECT_EQ(deep_calls, shallow_calls);
  // Op by op, every layer adds its own.
  FusedDecodeSetting op_by_op("0");
  EXPECT_GE(aten_calls_in_a_decode_step(deep) - aten_calls_in_a_decode_step(model_), 3 * 10);
}

INSTANTIATE_TEST_SUITE_P(Families, FusedDecodeTest,
                         ::testing::Values(QwenFamily::kQwen2Vl, QwenFamily::kQwen2_5Vl, QwenFamily::kQwen3Vl),
                         [](const auto& info) { return std::string(family_model_type(info.param)); });

}  // namespace
}  // namespace vlmgen
