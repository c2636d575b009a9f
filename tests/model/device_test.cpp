// The Qwen-VL model, the generator, the engine and the collectives on the test device
// (VLMGEN_TEST_DEVICE: the CPU here, cuda:0 under scripts/gpu-check.sh), against the same model on
// the CPU: weights and KV cache on the device, greedy tokens with images with and without a KV
// cache, the engine's encoder cache, bf16 weights within a stated bound, loading straight onto
// the device, a tensor-parallel group of one rank on the device's transport (NCCL on CUDA), and
// clear errors for devices this process cannot use.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "multiprocess_test_util.h"
#include "qwen_test_util.h"
#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/distributed/launch.h"
#include "vlmgen/engine/engine.h"
#include "vlmgen/generator.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/models/load_options.h"
#include "vlmgen/models/qwen_vl.h"

#ifdef VLMGEN_TEST_HAVE_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace vlmgen {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using namespace qwen_test;

// Larger weights than the default init: logits a few units apart, so the CPU and a GPU (other
// summation orders, differences near 1e-6) pick the same greedy tokens.
constexpr double kInitStd = 0.1;

struct ModelPair {
  QwenVlConfig config = test_config();
  QwenVl cpu{config, 17, kInitStd};
  QwenVl on_device{config, 17, kInitStd};
  ModelPair() { on_device.to(test_device()); }
};

// One row with a picture between text, one text-only row of another length.
GenerateRequest picture_request(const QwenVlConfig& config, uint64_t pixels_seed) {
  return make_request({image_prompt({3, 14, 15}, 4, {9, 2, 6}), {5, 35, 8, 9, 7, 9, 3, 2, 3}},
                      make_vision(config, {{1, 4, 4}}, pixels_seed));
}

TEST(OnTestDevice, EveryWeightAndTheKvCacheLiveOnTheDevice) {
  ModelPair m;
  const at::Device dev = test_device();
  EXPECT_EQ(m.on_device.device(), dev);
  for (const auto& [name, tensor] : std::as_const(m.on_device).named_weights()) {
    EXPECT_EQ(tensor->device(), dev) << name;
  }
  // A prefill over a KV cache on the device appends its keys and values there.
  auto context = InferenceContext::allocate(m.on_device.traits().kv_cache, 1, 32, dev);
  const Batch batch = left_pad({{3, 1, 4, 1, 5, 9, 2, 6}});
  ForwardArgs args;
  args.input_ids = batch.ids;
  args.attention_mask = batch.mask.to(dev);
  args.position_ids = m.on_device.plan_positions(batch.ids, batch.mask, {}).prompt_positions.to(dev);
  args.context = context.get();
  const at::Tensor logits = m.on_device.forward(args);
  EXPECT_EQ(logits.device(), dev);
  context->commit(batch.ids, batch.mask);
  EXPECT_EQ(context->kv(0).first.device(), dev);
  EXPECT_EQ(context->kv(0).first.size(2), 8);
}

TEST(OnTestDevice, PromptLogitsWithAPictureMatchTheCpuModel) {
  ModelPair m;
  const GenerateRequest request = picture_request(m.config, 7);
  const Batch batch = left_pad(request.prompts);
  const VisionInputs vision = make_vision(m.config, {{1, 4, 4}, {1, 2, 2}}, 7);
  const Batch two = left_pad({image_prompt({3}, 4, {}), image_prompt({1, 2}, 1, {5})});
  const at::Tensor expected = full_forward(m.cpu, two, vision);
  const at::Tensor got = full_forward(m.on_device, two, vision.to(test_device()));
  // float32 on both; only the order of the sums differs.
  const double diff = max_abs_diff(got, expected);
  report("max |logit difference| device vs CPU, float32", diff);
  EXPECT_LE(diff, 1e-4);
}

TEST(OnTestDevice, GreedyTokensWithAPictureEqualTheCpuModelsWithAndWithoutKvCache) {
  ModelPair m;
  const GenerateRequest request = picture_request(m.config, 11);
  const GenerationResult expected = Generator(m.cpu).generate(request, GenerationConfig().max_new_tokens(10));
  for (bool kv : {true, false}) {
    const GenerationResult got =
        Generator(m.on_device).generate(request, GenerationConfig().max_new_tokens(10).enable_kv_cache(kv));
    ASSERT_EQ(got.sequences.size(), expected.sequences.size());
    for (size_t r = 0; r < got.sequences.size(); ++r) {
      EXPECT_EQ(got.sequences[r].tokens, expected.sequences[r].tokens)
          << "row " << r << (kv ? " with" : " without") << " a KV cache";
    }
  }
  // Another picture gives other tokens: the comparison above depends on the picture reaching
  // the device's vision tower.
  const GenerationResult other =
      Generator(m.on_device).generate(picture_request(m.config, 12), GenerationConfig().max_new_tokens(10));
  EXPECT_NE(other.sequences[0].tokens, expected.sequences[0].tokens);
}

TEST(OnTestDevice, SampledTokensFollowTheSeedAsOnTheCpu) {
  ModelPair m;
  const GenerateRequest request = picture_request(m.config, 13);
  const GenerationConfig config = GenerationConfig().max_new_tokens(8).temperature(0.8).top_p(0.9).seed(5);
  const GenerationResult expected = Generator(m.cpu).generate(request, config);
  const GenerationResult got = Generator(m.on_device).generate(request, config);
  for (size_t r = 0; r < got.sequences.size(); ++r) {
    EXPECT_EQ(got.sequences[r].tokens, expected.sequences[r].tokens) << "row " << r;
  }
}

TEST(OnTestDevice, TheEngineEncodesAPictureOnceAndGivesEachRequestTheCpuTokens) {
  ModelPair m;
  const GenerateRequest first = picture_request(m.config, 21);
  GenerateRequest second = first;
  second.prompts = {image_prompt({8, 8}, 4, {1})};
  const GenerationConfig config = GenerationConfig().max_new_tokens(6);
  const GenerationResult expected_first = Generator(m.cpu).generate(first, config);
  const GenerationResult expected_second = Generator(m.cpu).generate(second, config);

  const int64_t calls_before = m.on_device.vision_tower_calls();
  Engine engine(m.on_device);
  const GenerationResult got_first = engine.submit(first, config)->wait();
  const GenerationResult got_second = engine.submit(second, config)->wait();
  EXPECT_EQ(got_first.sequences[0].tokens, expected_first.sequences[0].tokens);
  EXPECT_EQ(got_first.sequences[1].tokens, expected_first.sequences[1].tokens);
  EXPECT_EQ(got_second.sequences[0].tokens, expected_second.sequences[0].tokens);
  EXPECT_EQ(m.on_device.vision_tower_calls() - calls_before, 1);
  EXPECT_EQ(engine.metrics().encoder_cache_hits, 1);
}

// bfloat16 keeps 8 significant bits: each weight (and on CUDA each product's inputs) is rounded
// by at most 2^-9 of itself. Through this 2-layer model's few products the logits move by a few
// tenths of a percent of their range; 2% of the largest |logit| leaves room for the larger
// sums of the GPU's bf16 products and still fails for a wrong conversion or scale (which
// moves them by the whole range).
TEST(OnTestDevice, Bf16WeightsGiveLogitsWithinTwoPercentOfFloat32) {
  ModelPair m;
  QwenVl bf16(m.config, 17, kInitStd);
  bf16.convert_weights(at::kBFloat16);
  bf16.to(test_device());
  const VisionInputs vision = make_vision(m.config, {{1, 4, 4}}, 3).to(test_device());
  const Batch batch = left_pad({image_prompt({3, 1, 4}, 4, {1, 5, 9, 2, 6, 5})});
  const at::Tensor reference = full_forward(m.on_device, batch, vision);
  const at::Tensor got = full_forward(bf16, batch, vision);
  EXPECT_EQ(got.scalar_type(), at::kFloat);
  const double scale = reference.abs().max().item<double>();
  const double diff = max_abs_diff(got, reference);
  report("max |logit difference| bf16 vs float32 weights, relative to max |logit|", diff / scale);
  EXPECT_LE(diff, 0.02 * scale);
  EXPECT_GT(diff, 0.0);  // the weights really are bf16
}

TEST(OnTestDevice, LoadingACheckpointOntoTheDevicePutsEveryWeightThere) {
  ModelPair m;
  ScratchDir scratch;
  const std::string dir = scratch.dir("model");
  m.cpu.save_checkpoint(dir);
  LoadOptions options;
  options.device = test_device();
  const std::unique_ptr<QwenVl> loaded = QwenVl::from_checkpoint(dir, ParallelContext::single(), options);
  EXPECT_EQ(loaded->device(), test_device());
  for (const auto& [name, tensor] : std::as_const(*loaded).named_weights()) {
    EXPECT_EQ(tensor->device(), test_device()) << name;
  }
  const Batch batch = left_pad({{4, 8, 15, 16, 23, 42}});
  EXPECT_LE(max_abs_diff(full_forward(*loaded, batch, {}), full_forward(m.cpu, batch, {})), 1e-4);
}

TEST(OnTestDevice, DevicesThisProcessCannotUseAreRefusedByName) {
  EXPECT_EQ(parse_device("cpu"), at::Device(at::kCPU));
  EXPECT_THAT([] { parse_device("gpu"); }, ThrowsMessage<Error>(HasSubstr("'cpu', 'cuda' or 'cuda:N', got 'gpu'")));
  EXPECT_THAT([] { parse_device("cuda:x"); }, ThrowsMessage<Error>(HasSubstr("got 'cuda:x'")));
  EXPECT_THAT([] { parse_device("cuda:"); }, ThrowsMessage<Error>(HasSubstr("got 'cuda:'")));
  const int64_t gpus = detail::cuda_device_count();
  if (gpus == 0) {
    EXPECT_THAT([] { parse_device("cuda"); }, ThrowsMessage<Error>(HasSubstr("has no usable CUDA")));
  } else {
    EXPECT_EQ(parse_device("cuda"), at::Device(at::kCUDA, 0));
    EXPECT_THAT([] { parse_device("cuda:99"); }, ThrowsMessage<Error>(HasSubstr("CUDA device")));
  }
  // FP8 bytes compute on the CPU kernels only: refused before the checkpoint is read.
  LoadOptions fp8;
  fp8.keep_fp8 = true;
  fp8.device = at::Device(at::kCUDA, 0);
  EXPECT_THAT([&] { QwenVl::from_checkpoint("/nonexistent", ParallelContext::single(), fp8); },
              ThrowsMessage<Error>(HasSubstr("compute on the CPU only")));
}

// A group of one rank, its collectives on the test device: through NCCL for CUDA tensors.
TEST(DISABLED_DeviceCollectivesWorker, AGroupOfOneRunsEveryCollectiveOnTheDevice) {
  SKIP_UNLESS_WORKER();
  Communicator& comm = multiprocess::worker_comm();
  const at::Device dev = test_device();
  EXPECT_EQ(comm.size(), 1);
  if (dev.is_cuda()) {
    EXPECT_THAT(comm.backend_name(), HasSubstr("nccl"));
  }
  const at::Tensor base = at::arange(12, at::TensorOptions().dtype(at::kFloat).device(dev)).reshape({3, 4});
  at::Tensor sum = base.clone();
  comm.all_reduce_sum(sum);
  EXPECT_EQ(sum.device(), dev);
  EXPECT_TRUE(at::equal(sum.cpu(), base.cpu()));
  const at::Tensor gathered = comm.all_gather(base, 1);
  EXPECT_EQ(gathered.device(), dev);
  EXPECT_TRUE(at::equal(gathered.cpu(), base.cpu()));
  const at::Tensor scattered = comm.reduce_scatter_sum(base, 0);
  EXPECT_TRUE(at::equal(scattered.cpu(), base.cpu()));
  at::Tensor bf = at::full({5}, 3.0, at::TensorOptions().dtype(at::kBFloat16).device(dev));
  comm.broadcast(bf, 0);
  EXPECT_EQ(bf.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(bf.cpu(), at::full({5}, 3.0, at::kBFloat16)));
  comm.barrier();
}

TEST(OnTestDevice, AGroupOfOneRankRunsItsCollectivesOnTheDevicesTransport) {
  EXPECT_EQ(multiprocess::run_workers(1, "DISABLED_DeviceCollectivesWorker.*", {{"VLMGEN_TEST_GROUP_OF_ONE", "1"}}), 0);
}

}  // namespace
}  // namespace vlmgen

namespace vlmgen {
namespace {

// The meta device holds shapes without data: reading a value back to the host there throws. A
// forward call over a KV cache on it therefore shows that the decode step's model side waits for
// nothing on the device (on a GPU each such read is a synchronization); its token ids come from
// the host, as the generator passes them.
TEST(NoHostReads, APrefillAndADecodeStepOverAKvCacheReadNothingBackFromTheDevice) {
  // LibTorch 1.13 lacks meta kernels for ops of the forward (index_select, logical_and); 2.x has
  // them, and scripts/gpu-check.sh runs this test there.
  try {
    const at::TensorOptions meta_long = at::TensorOptions().dtype(at::kLong).device(at::kMeta);
    (void)at::empty({2, 2}, meta_long.dtype(at::kFloat)).index_select(0, at::zeros({1}, meta_long));
    (void)at::logical_and(at::empty({2}, meta_long.dtype(at::kBool)), at::empty({2}, meta_long.dtype(at::kBool)));
  } catch (const c10::Error&) {
    GTEST_SKIP() << "LibTorch " << detail::torch_version() << " has no meta kernels for the forward's ops";
  }
  const QwenVlConfig config = test_config();
  QwenVl model(config, 17);
  const at::Device meta(at::kMeta);
  model.to(meta);
  auto context = InferenceContext::allocate(model.traits().kv_cache, 2, 16, meta);
  const Batch prompt = left_pad({{3, 1, 4, 1, 5}, {9, 2, 6}});
  const RopePlan plan = model.plan_positions(prompt.ids, prompt.mask, {});
  ForwardArgs prefill;
  prefill.input_ids = prompt.ids;
  prefill.attention_mask = prompt.mask.to(meta);
  prefill.position_ids = plan.prompt_positions.to(meta);
  prefill.context = context.get();
  prefill.last_column_logits = true;
  EXPECT_EQ(model.forward(prefill).sizes(), (std::vector<int64_t>{2, 1, config.vocab_size}));
  context->commit(prompt.ids, prompt.mask);

  ForwardArgs decode;
  decode.input_ids = at::tensor({7, 8}, at::kLong).view({2, 1});
  decode.attention_mask = at::ones({2, 6}, at::kLong).to(meta);
  decode.position_ids = at::full({3, 2, 1}, 5, at::kLong).to(meta);
  decode.context = context.get();
  decode.window_start = 5;
  decode.step = 1;
  const at::Tensor logits = model.forward(decode);
  EXPECT_EQ(logits.device(), meta);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 1, config.vocab_size}));
}

// On CUDA: a prefill and a decode step (alone, and two requests fused by forward_batch) under
// CUDA's sync debug mode "error", where any synchronizing call (a read back, a blocking copy)
// throws. The generator's one read back a step (the sampled ids) comes after the forward.
TEST(NoHostReads, ForwardCallsOnCudaMakeNoSynchronizingCall) {
  const at::Device dev = test_device();
  if (!dev.is_cuda()) GTEST_SKIP() << "runs on CUDA (VLMGEN_TEST_DEVICE=cuda:0, scripts/gpu-check.sh)";
#ifndef VLMGEN_TEST_HAVE_CUDA
  FAIL() << "this test program was built without CUDA's headers: CMake found no CUDA in this LibTorch";
#else
  const QwenVlConfig config = test_config();
  QwenVl model(config, 17);
  model.to(dev);
  std::vector<std::unique_ptr<InferenceContext> > contexts;
  std::vector<ForwardArgs> decodes;
  for (int64_t r = 0; r < 2; ++r) {
    contexts.push_back(InferenceContext::allocate(model.traits().kv_cache, 1, 16, dev));
    const Batch prompt = left_pad({{3, 1, 4, 1, 5 + r}});
    ForwardArgs prefill;
    prefill.input_ids = prompt.ids;
    prefill.attention_mask = prompt.mask.to(dev);
    prefill.position_ids = model.plan_positions(prompt.ids, prompt.mask, {}).prompt_positions.to(dev);
    prefill.context = contexts.back().get();
    prefill.last_column_logits = true;
    (void)model.forward(prefill);
    contexts.back()->commit(prompt.ids, prompt.mask);
    ForwardArgs decode;
    decode.input_ids = at::full({1, 1}, 7 + r, at::kLong);
    decode.attention_mask = at::ones({1, 6}, at::kLong).to(dev);
    decode.position_ids = at::full({3, 1, 1}, 5, at::kLong).to(dev);
    decode.context = contexts.back().get();
    decode.window_start = 5;
    decode.step = 1;
    decodes.push_back(decode);
  }
  struct SyncErrors {
    SyncErrors() { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR); }
    ~SyncErrors() { c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED); }
  };
  at::Tensor alone;
  std::vector<at::Tensor> fused;
  {
    SyncErrors errors;
    // Uncommitted, so the fused pass writes the same cache column again.
    EXPECT_NO_THROW(alone = model.forward(decodes[0]));
    EXPECT_NO_THROW(fused = model.forward_batch({&decodes[0], &decodes[1]}));
  }
  ASSERT_EQ(fused.size(), 2u);
  EXPECT_LE(max_abs_diff(fused[0], alone), 1e-5);
#endif
}

}  // namespace
}  // namespace vlmgen
