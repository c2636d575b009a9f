// Trains the shapes captioner (a tiny Qwen2-VL) on freshly generated shapes scenes and writes
// its checkpoint directory. Deterministic: the same seed, steps and thread count give the same
// weights on the same build.
//
//   vlmgen-train-shapes --out models/shapes-vlm --seed 1 --steps 2000
//
// The forward pass is the model's own CausalVlm::forward in no-cache mode, run under autograd,
// so what is trained is exactly what the generator later runs. The loss is cross-entropy on the
// caption words and <eos> only; the optimizer is AdamW written out in ATen ops.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "shapes/shapes_data.h"
#include "shapes/shapes_model.h"
#include "shapes/word_tokenizer.h"
#include "vlmgen/error.h"
#include "vlmgen/generator.h"
#include "vlmgen/models/qwen2_vl.h"

namespace {

namespace shapes = vlmgen::shapes;
using Clock = std::chrono::steady_clock;

struct TrainOptions {
  std::string out;
  uint64_t seed = 1;
  int64_t steps = 2000;
  int64_t batch = 32;
  int64_t imageless_rows = 4;
  double lr = 1e-3;
  double min_lr_ratio = 0.05;
  int64_t warmup = 60;
  double weight_decay = 0.01;
  double clip = 1.0;
  double init_std = 0.08;
  // One thread: measured faster than two for this model (its operations are too small to split),
  // and far faster on a shared machine, where a second thread mostly waits at barriers.
  int64_t threads = 1;
  int64_t image_size = 96;
  int64_t log_every = 25;
  int64_t eval_every = 0;
  int64_t eval_images = 200;
};

/// AdamW (Loshchilov & Hutter) with decoupled weight decay on matrices only: decaying norm
/// weights and biases towards 0 would fight the RMS/LayerNorm scale they encode.
class AdamW {
 public:
  AdamW(std::vector<std::pair<std::string, at::Tensor*>> weights, double beta1, double beta2, double eps,
        double weight_decay)
      : weights_(std::move(weights)), beta1_(beta1), beta2_(beta2), eps_(eps), weight_decay_(weight_decay) {
    for (const auto& [name, w] : weights_) {
      exp_avg_.push_back(at::zeros_like(*w));
      exp_avg_sq_.push_back(at::zeros_like(*w));
    }
  }

  /// Scales every gradient so that their global L2 norm is at most `max_norm`; returns the norm
  /// before clipping.
  double clip_grad_norm(double max_norm) {
    at::NoGradGuard no_grad;
    double sum = 0.0;
    for (const auto& [name, w] : weights_) {
      if (w->grad().defined()) sum += w->grad().pow(2).sum().item<double>();
    }
    const double norm = std::sqrt(sum);
    if (norm > max_norm) {
      for (const auto& [name, w] : weights_) {
        if (w->grad().defined()) w->mutable_grad().mul_(max_norm / (norm + 1e-6));
      }
    }
    return norm;
  }

  void step(double lr) {
    at::NoGradGuard no_grad;
    ++step_;
    const double bias1 = 1.0 - std::pow(beta1_, static_cast<double>(step_));
    const double bias2 = 1.0 - std::pow(beta2_, static_cast<double>(step_));
    for (size_t i = 0; i < weights_.size(); ++i) {
      at::Tensor& w = *weights_[i].second;
      if (!w.grad().defined()) continue;
      const at::Tensor& g = w.grad();
      exp_avg_[i].mul_(beta1_).add_(g, 1.0 - beta1_);
      exp_avg_sq_[i].mul_(beta2_).addcmul_(g, g, 1.0 - beta2_);
      if (weight_decay_ > 0 && w.dim() >= 2) w.mul_(1.0 - lr * weight_decay_);
      at::Tensor denom = (exp_avg_sq_[i] / bias2).sqrt_().add_(eps_);
      w.addcdiv_(exp_avg_[i], denom, -lr / bias1);
    }
  }

  void zero_grad() {
    for (const auto& [name, w] : weights_) {
      if (w->grad().defined()) w->mutable_grad() = at::Tensor();
    }
  }

 private:
  std::vector<std::pair<std::string, at::Tensor*>> weights_;
  std::vector<at::Tensor> exp_avg_;
  std::vector<at::Tensor> exp_avg_sq_;
  double beta1_, beta2_, eps_, weight_decay_;
  int64_t step_ = 0;
};

/// Draws the initial weights here rather than in Qwen2Vl's constructor, walking them in name
/// order with one generator: the shipped checkpoint then stays reproducible when the model's own
/// random init (its order, its sharding) changes. RMS/LayerNorm scales start near 1, as there.
void init_weights(vlmgen::Qwen2Vl& model, uint64_t seed, double std) {
  auto weights = model.named_weights();
  std::sort(weights.begin(), weights.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  auto ends_with = [](const std::string& name, const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  at::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& [name, w] : weights) {
    const bool norm_scale = ends_with(name, "norm1.weight") || ends_with(name, "norm2.weight") ||
                            ends_with(name, "ln_q.weight") || ends_with(name, "layernorm.weight") ||
                            name == "model.norm.weight";
    w->normal_(norm_scale ? 1.0 : 0.0, std, gen);
  }
}

/// Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step.
double learning_rate(const TrainOptions& o, int64_t step) {
  if (step < o.warmup) return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup);
  const double progress =
      static_cast<double>(step - o.warmup) / static_cast<double>(std::max<int64_t>(1, o.steps - o.warmup));
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
  return o.lr * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * cosine);
}

/// Exact-caption accuracy of greedy KV-cache generation on fresh eval-split scenes.
double caption_accuracy(shapes::ShapesCaptioner& captioner, uint64_t seed, int64_t count,
                        const shapes::SceneOptions& scenes_options) {
  at::NoGradGuard no_grad;
  std::vector<shapes::Scene> scenes = shapes::make_scenes(seed, shapes::Split::kEval, 0, count, scenes_options);
  std::vector<vlmgen::Image> images;
  for (const auto& s : scenes) images.push_back(s.image);
  shapes::CaptionRun run = captioner.caption(images, vlmgen::GenerationConfig().enable_kv_cache(true), 100);
  int64_t right = 0;
  for (size_t i = 0; i < scenes.size(); ++i) right += run.captions[i] == scenes[i].caption ? 1 : 0;
  return static_cast<double>(right) / static_cast<double>(std::max<int64_t>(1, count));
}

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(std::lround(std::max(0.0, seconds)));
  return fmt::format("{}:{:02d}", s / 60, s % 60);
}

int train(const TrainOptions& o) {
  at::set_num_threads(static_cast<int>(o.threads));
  const shapes::WordTokenizer tokenizer = shapes::WordTokenizer::with_specials(shapes::caption_words());
  const vlmgen::QwenVlConfig config = shapes::model_config(tokenizer, o.image_size);
  const vlmgen::QwenImageProcessorOptions processor = shapes::processor_options(config, o.image_size);
  shapes::ShapesCaptioner captioner(std::make_unique<vlmgen::Qwen2Vl>(config), tokenizer, processor);
  vlmgen::Qwen2Vl& model = captioner.model();
  init_weights(model, o.seed, o.init_std);
  const auto scene_options = shapes::SceneOptions().image_size(o.image_size);

  auto weights = model.named_weights();  // a tied lm_head is the embedding: listed once, trained once
  int64_t parameters = 0;
  for (auto& [name, w] : weights) {
    w->requires_grad_(true);
    parameters += w->numel();
  }
  fmt::print("shapes captioner: {} parameters ({:.2f} MB fp32), {} image tokens per {}x{} picture, vocabulary {}\n",
             parameters, static_cast<double>(parameters) * 4.0 / 1e6, captioner.placeholders_per_image(), o.image_size,
             o.image_size, tokenizer.size());
  fmt::print("training {} steps x {} scenes, seed {}, lr {} (warm-up {}, cosine to {}x), {} threads\n", o.steps,
             o.batch, o.seed, o.lr, o.warmup, o.min_lr_ratio, o.threads);
  std::fflush(stdout);

  AdamW optimizer(weights, 0.9, 0.99, 1e-8, o.weight_decay);

  // Summed cross-entropy of the caption words and <eos> of `scenes`, teacher-forced through
  // the model's own forward (no KV cache). Without the image, the placeholders keep their token
  // embedding (what a step-zero replay loop shows the model) while positions stay those of the
  // picture, exactly as in that loop.
  int64_t step_targets = 0;  // caption tokens scored this step
  int64_t step_tokens = 0;   // real tokens run through the model this step
  auto caption_loss = [&](const std::vector<shapes::Scene>& scenes, bool with_image) {
    const shapes::TrainingBatch batch =
        shapes::make_training_batch(scenes, tokenizer, processor, captioner.placeholders_per_image());
    const vlmgen::RopePlan plan = model.plan_positions(batch.input_ids, batch.attention_mask, batch.vision);
    vlmgen::ForwardArgs args;
    args.input_ids = batch.input_ids;
    args.position_ids = plan.prompt_positions;
    args.attention_mask = batch.attention_mask;
    if (with_image) {
      args.vision = batch.vision;
      args.images.resize(scenes.size());
      std::iota(args.images.begin(), args.images.end(), 0);
    }
    args.window_start = 0;
    args.context = nullptr;
    at::Tensor logits = model.forward(args);  // [B, L, vocab]
    step_targets += batch.target_tokens;
    step_tokens += batch.attention_mask.sum().item<int64_t>();
    return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), batch.labels.reshape({-1}), {},
                                  at::Reduction::Sum, /*ignore_index=*/-100);
  };

  const auto t_start = Clock::now();
  auto since = t_start;
  double loss_sum = 0.0;
  int64_t loss_count = 0;
  int64_t tokens_since = 0;
  for (int64_t step = 0; step < o.steps; ++step) {
    // Every step draws new scenes, so the model never sees a picture twice.
    const int64_t first_scene = step * (o.batch + o.imageless_rows);
    const std::vector<shapes::Scene> scenes =
        shapes::make_scenes(o.seed, shapes::Split::kTrain, first_scene, o.batch, scene_options);
    step_targets = 0;
    step_tokens = 0;
    const at::Tensor image_loss = caption_loss(scenes, /*with_image=*/true);
    const int64_t image_targets = step_targets;
    at::Tensor summed = image_loss;
    if (o.imageless_rows > 0) {
      const std::vector<shapes::Scene> blind =
          shapes::make_scenes(o.seed, shapes::Split::kTrain, first_scene + o.batch, o.imageless_rows, scene_options);
      summed = summed + caption_loss(blind, /*with_image=*/false);
    }
    at::Tensor loss = summed / static_cast<double>(step_targets);
    loss.backward();
    const double grad_norm = optimizer.clip_grad_norm(o.clip);
    const double lr = learning_rate(o, step);
    optimizer.step(lr);
    optimizer.zero_grad();

    // The withheld-image rows cannot get below the entropy of the captions; report the rest.
    loss_sum += image_loss.item<double>() / static_cast<double>(image_targets);
    ++loss_count;
    tokens_since += step_tokens;
    const bool last = step + 1 == o.steps;
    if ((step + 1) % o.log_every == 0 || last) {
      const auto now = Clock::now();
      const double elapsed = std::chrono::duration<double>(now - t_start).count();
      const double window = std::chrono::duration<double>(now - since).count();
      const double eta = elapsed / static_cast<double>(step + 1) * static_cast<double>(o.steps - step - 1);
      fmt::print("step {:5d}/{}  loss {:.4f}  grad-norm {:.3f}  lr {:.2e}  {:.0f} tokens/s  elapsed {}  ETA {}\n",
                 step + 1, o.steps, loss_sum / static_cast<double>(loss_count), grad_norm, lr,
                 static_cast<double>(tokens_since) / std::max(window, 1e-9), format_duration(elapsed),
                 format_duration(eta));
      std::fflush(stdout);
      loss_sum = 0.0;
      loss_count = 0;
      tokens_since = 0;
      since = now;
    }
    if (o.eval_every > 0 && ((step + 1) % o.eval_every == 0) && !last) {
      fmt::print("  eval: {:.1f}% exact captions (KV cache, {} eval-split scenes)\n",
                 100.0 * caption_accuracy(captioner, o.seed, o.eval_images, scene_options), o.eval_images);
      std::fflush(stdout);
    }
  }
  const double train_s = std::chrono::duration<double>(Clock::now() - t_start).count();

  for (auto& [name, w] : weights) w->requires_grad_(false);
  model.save_checkpoint(o.out);
  tokenizer.save((std::filesystem::path(o.out) / shapes::kVocabFile).string());
  shapes::save_processor_options(o.out, processor);
  fmt::print("trained in {}; wrote {} (config.json, model.safetensors, {}, {})\n", format_duration(train_s), o.out,
             shapes::kVocabFile, shapes::kPreprocessorFile);
  if (o.eval_images > 0) {
    fmt::print("eval: {:.1f}% exact captions (KV cache, {} eval-split scenes, seed {})\n",
               100.0 * caption_accuracy(captioner, o.seed, o.eval_images, scene_options), o.eval_images, o.seed);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Train the shapes captioner (a tiny Qwen2-VL) and write its checkpoint directory");
  TrainOptions o;
  app.add_option("--out", o.out, "checkpoint directory to write")->required();
  app.add_option("--seed", o.seed, "seed of the weights and of the training scenes")->capture_default_str();
  app.add_option("--steps", o.steps, "optimizer steps")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "scenes per step")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--imageless-rows", o.imageless_rows,
                 "extra scenes per step trained with the image withheld, so that a prompt whose placeholders "
                 "carry no picture gets fluent (wrong) text rather than noise")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--lr", o.lr, "peak learning rate")->capture_default_str();
  app.add_option("--warmup", o.warmup, "linear warm-up steps")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--weight-decay", o.weight_decay, "AdamW weight decay (matrices only)")->capture_default_str();
  app.add_option("--clip", o.clip, "global gradient-norm clip")->capture_default_str();
  app.add_option("--init-std", o.init_std, "standard deviation of the initial weights")->capture_default_str();
  app.add_option("--threads", o.threads, "intra-op threads (results depend on it)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--image-size", o.image_size, "side of the square scenes in pixels (multiple of 32)")
      ->capture_default_str();
  app.add_option("--log-every", o.log_every, "steps between progress lines")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--eval-every", o.eval_every, "steps between caption-accuracy checks (0 = at the end only)")
      ->capture_default_str();
  app.add_option("--eval-images", o.eval_images, "eval-split scenes per check (0 = none)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    return train(o);
  } catch (const std::exception& e) {
    // vlmgen::Error for bad input; c10::Error or std::filesystem errors would be bugs or I/O.
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
