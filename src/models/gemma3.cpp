// Gemma-3: weights, the SigLIP vision tower and projector, and the checks of a forward call.
// The text model is in gemma3_text.cpp, checkpoints in gemma3_checkpoint.cpp.

#include "vlmgen/models/gemma3.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "qwen_vl_ops.h"
#include "vit_ops.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/distributed/tensor_parallel.h"
#include "vlmgen/error.h"
#include "vlmgen/inference_context.h"

namespace vlmgen {
namespace {

using qwen_vl::ShardLayout;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// SigLIP's LayerNorm weights sit near 1 (Gemma's RMSNorms scale by 1 + w: theirs near 0).
bool is_layer_norm_weight(const std::string& name) {
  return name.find("vision_tower") != std::string::npos &&
         (ends_with(name, "layer_norm1.weight") || ends_with(name, "layer_norm2.weight") ||
          ends_with(name, "post_layernorm.weight"));
}

ModelTraits make_traits(const Gemma3Config& c, int64_t tp) {
  ModelTraits t;
  t.vocab_size = c.vocab_size;
  t.image_token_id = c.image_token_id;
  t.vision_start_token_id = c.boi_token_id;
  t.vision_end_token_id = c.eoi_token_id;
  t.spatial_merge_size = 1;
  t.vision_layout = VisionLayout::kPerImage;
  t.tokens_per_image = c.mm_tokens_per_image;
  t.max_sequence_length = c.max_position_embeddings;
  t.supports_kv_cache = true;
  t.kv_cache_under_sequence_parallel = false;
  t.accepts_partial_image_span = false;  // image tokens attend both ways
  t.vocab_parallel_logits = tp > 1;
  t.kv_cache.num_layers = c.num_hidden_layers;
  t.kv_cache.num_kv_heads = c.num_key_value_heads / tp;
  t.kv_cache.head_dim = c.head_dim;
  t.kv_cache.dtype = at::kFloat;
  return t;
}

}  // namespace

Gemma3::Gemma3(const Gemma3Config& config, Uninitialized, ParallelContext parallel)
    : config_(config), parallel_(std::move(parallel)) {
  config_.validate();
  const int64_t tp = parallel_.tp_size();
  auto check_divides = [&](const char* what, int64_t n) {
    VLMGEN_CHECK(n % tp == 0, "gemma3: {} {} does not divide by the tensor-parallel size {}", what, n, tp);
  };
  check_divides("num_attention_heads", config_.num_attention_heads);
  check_divides("num_key_value_heads", config_.num_key_value_heads);
  check_divides("intermediate_size", config_.intermediate_size);
  check_divides("vocab_size", config_.vocab_size);
  tp_comm_ = tp > 1 ? parallel_.tp_group().get() : nullptr;
  vision_sharded_ = detail::shard_encoder_layers("gemma3", config_.vision_num_attention_heads,
                                                 config_.vision_intermediate_size, parallel_);
  traits_ = make_traits(config_, tp);
  allocate_weights();
}

Gemma3::Gemma3(const Gemma3Config& config, uint64_t seed, double init_std, ParallelContext parallel)
    : Gemma3(config, Uninitialized{}, std::move(parallel)) {
  at::NoGradGuard no_grad;
  at::Generator gen = detail::make_cpu_generator(seed);
  for (WeightSlot& slot : weight_slots()) {
    const double mean = is_layer_norm_weight(slot.name) ? 1.0 : 0.0;
    at::Tensor full = at::empty(full_shape(*slot.tensor, slot.layout), slot.tensor->options());
    full.normal_(mean, init_std, gen);
    slot.tensor->copy_(detail::take_shard(full, slot.layout, parallel_.tp_rank(), parallel_.tp_size()));
  }
}

void Gemma3::allocate_weights() {
  const int64_t params = config_.parameter_count();
  try {
    const int64_t tp = parallel_.tp_size();
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    auto linear = [&](int64_t out, int64_t in, bool bias) {
      return qwen_vl::Linear{at::empty({out, in}, opts), bias ? at::empty({out}, opts) : at::Tensor(), {}};
    };
    auto layer_norm = [&](int64_t dim) { return qwen_vl::LayerNorm{at::empty({dim}, opts), at::empty({dim}, opts)}; };
    const Gemma3Config& c = config_;
    const int64_t e = c.vision_hidden_size, patches = c.patches_per_side() * c.patches_per_side();
    vision_.patch_embedding = at::empty({e, c.num_channels, c.patch_size, c.patch_size}, opts);
    vision_.patch_embedding_bias = at::empty({e}, opts);
    vision_.position_embedding = at::empty({patches, e}, opts);
    vision_.layers.clear();
    for (int64_t i = 0; i < c.vision_num_hidden_layers; ++i) {
      vision_.layers.push_back(
          detail::allocate_encoder_layer(e, c.vision_intermediate_size, opts, vision_sharded_ ? tp : 1));
    }
    vision_.post_layernorm = layer_norm(e);
    vision_.mm_soft_emb_norm = at::empty({e}, opts);
    vision_.mm_input_projection = at::empty({e, c.hidden_size}, opts);

    const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim / tp;
    const int64_t kv = c.num_key_value_heads * c.head_dim / tp, ffn = c.intermediate_size / tp;
    lm_.embed_tokens = at::empty({c.vocab_size / tp, h}, opts);
    lm_.layers.clear();
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
      gemma3::DecoderLayer l;
      l.input_layernorm = at::empty({h}, opts);
      l.post_attention_layernorm = at::empty({h}, opts);
      l.pre_feedforward_layernorm = at::empty({h}, opts);
      l.post_feedforward_layernorm = at::empty({h}, opts);
      l.q_proj = linear(q, h, false);
      l.k_proj = linear(kv, h, false);
      l.v_proj = linear(kv, h, false);
      l.o_proj = linear(h, q, false);
      l.q_norm = at::empty({c.head_dim}, opts);
      l.k_norm = at::empty({c.head_dim}, opts);
      l.gate_proj = linear(ffn, h, false);
      l.up_proj = linear(ffn, h, false);
      l.down_proj = linear(h, ffn, false);
      lm_.layers.push_back(std::move(l));
    }
    lm_.norm = at::empty({h}, opts);
    if (c.tie_word_embeddings) {
      tie_lm_head();
    } else {
      lm_.lm_head = at::empty({c.vocab_size / tp, h}, opts);
    }
  } catch (const c10::Error& err) {
    VLMGEN_FAIL("cannot allocate the {} float32 weights ({} bytes) this gemma3 config describes: {}", params,
                params * 4, err.what_without_backtrace());
  }
}

void Gemma3::set_kv_cache_dtype(at::ScalarType dtype) {
  check_kv_cache_dtype(dtype, device());
  traits_.kv_cache.dtype = dtype;
}

void Gemma3::tie_lm_head() { lm_.lm_head = lm_.embed_tokens; }

std::vector<Gemma3::WeightSlot> Gemma3::weight_slots() {
  std::vector<WeightSlot> out;
  const bool tp = parallel_.tp_size() > 1;
  const ShardLayout rows = tp ? ShardLayout::kRows : ShardLayout::kReplicated;
  const ShardLayout cols = tp ? ShardLayout::kColumns : ShardLayout::kReplicated;
  auto add = [&](std::string name, at::Tensor& t, ShardLayout layout = ShardLayout::kReplicated) {
    out.push_back({std::move(name), &t, layout});
  };
  auto add_linear = [&](const std::string& name, qwen_vl::Linear& l, ShardLayout layout = ShardLayout::kReplicated) {
    add(name + ".weight", l.weight, layout);
    if (l.bias.defined()) add(name + ".bias", l.bias);
  };
  auto add_norm = [&](const std::string& name, qwen_vl::LayerNorm& n) {
    add(name + ".weight", n.weight);
    add(name + ".bias", n.bias);
  };
  const std::string lm = "model.language_model.";
  add(lm + "embed_tokens.weight", lm_.embed_tokens, rows);
  for (size_t i = 0; i < lm_.layers.size(); ++i) {
    gemma3::DecoderLayer& l = lm_.layers[i];
    const std::string p = lm + "layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", l.input_layernorm);
    add_linear(p + "self_attn.q_proj", l.q_proj, rows);
    add_linear(p + "self_attn.k_proj", l.k_proj, rows);
    add_linear(p + "self_attn.v_proj", l.v_proj, rows);
    add_linear(p + "self_attn.o_proj", l.o_proj, cols);
    add(p + "self_attn.q_norm.weight", l.q_norm);
    add(p + "self_attn.k_norm.weight", l.k_norm);
    add(p + "post_attention_layernorm.weight", l.post_attention_layernorm);
    add(p + "pre_feedforward_layernorm.weight", l.pre_feedforward_layernorm);
    add(p + "post_feedforward_layernorm.weight", l.post_feedforward_layernorm);
    add_linear(p + "mlp.gate_proj", l.gate_proj, rows);
    add_linear(p + "mlp.up_proj", l.up_proj, rows);
    add_linear(p + "mlp.down_proj", l.down_proj, cols);
  }
  add(lm + "norm.weight", lm_.norm);
  if (!config_.tie_word_embeddings) add("lm_head.weight", lm_.lm_head, rows);
  const std::string v = "model.vision_tower.vision_model.";
  add(v + "embeddings.patch_embedding.weight", vision_.patch_embedding);
  add(v + "embeddings.patch_embedding.bias", vision_.patch_embedding_bias);
  add(v + "embeddings.position_embedding.weight", vision_.position_embedding);
  for (size_t i = 0; i < vision_.layers.size(); ++i) {
    detail::add_encoder_layer_weights(v + "encoder.layers." + std::to_string(i) + ".", vision_.layers[i],
                                      vision_sharded_, add);
  }
  add_norm(v + "post_layernorm", vision_.post_layernorm);
  add("model.multi_modal_projector.mm_soft_emb_norm.weight", vision_.mm_soft_emb_norm);
  add("model.multi_modal_projector.mm_input_projection_weight", vision_.mm_input_projection);
  return out;
}

std::vector<std::pair<std::string, at::Tensor*>> Gemma3::named_weights() {
  std::vector<std::pair<std::string, at::Tensor*>> out;
  for (WeightSlot& slot : weight_slots()) out.emplace_back(slot.name, slot.tensor);
  return out;
}

qwen_vl::ShardLayout Gemma3::shard_layout(const std::string& name) const {
  for (const WeightSlot& slot : const_cast<Gemma3*>(this)->weight_slots()) {
    if (slot.name == name) return slot.layout;
  }
  VLMGEN_FAIL("gemma3 has no weight named {}", name);
}

std::vector<int64_t> Gemma3::full_shape(const at::Tensor& local, qwen_vl::ShardLayout layout) const {
  std::vector<int64_t> shape = local.sizes().vec();
  if (layout == ShardLayout::kRows) shape[0] *= parallel_.tp_size();
  if (layout == ShardLayout::kColumns) shape[1] *= parallel_.tp_size();
  return shape;
}

void Gemma3::convert_weights(at::ScalarType dtype) {
  VLMGEN_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
               "gemma3 weights can be float32, bfloat16 or float16, got {}", c10::toString(dtype));
  for (WeightSlot& slot : weight_slots()) {
    const bool lm_matrix =
        slot.tensor->dim() == 2 && (slot.name.rfind("model.language_model.", 0) == 0 || slot.name == "lm_head.weight");
    if (lm_matrix) *slot.tensor = slot.tensor->to(dtype).contiguous();
  }
  if (config_.tie_word_embeddings) tie_lm_head();
}

void Gemma3::to(at::Device device) {
  check_kv_cache_dtype(traits_.kv_cache.dtype, device);  // the 16- and 8-bit caches are the CPU's
  for (WeightSlot& slot : weight_slots()) *slot.tensor = slot.tensor->to(device);
  if (config_.tie_word_embeddings) tie_lm_head();
}

at::Tensor Gemma3::run_vision_tower(const VisionInputs& vision) {
  const Gemma3Config& c = config_;
  VLMGEN_CHECK(vision.layout == VisionLayout::kPerImage,
               "gemma3 takes per-image vision inputs (VisionInputs::per_image, pixel_values [N, {}, {}, {}]), got "
               "the patch-flattened layout",
               c.num_channels, c.image_size, c.image_size);
  vision.validate(1);
  at::Tensor pixels = vision.pixel_values;
  if (pixels.dim() == 5 && pixels.size(1) == 1) pixels = pixels.squeeze(1);  // [N, 1 tile, C, H, W]
  VLMGEN_CHECK(pixels.dim() == 4 && pixels.size(1) == c.num_channels && pixels.size(2) == c.image_size &&
                   pixels.size(3) == c.image_size,
               "gemma3 pixel_values must be [N, {}, {}, {}] (images resized to image_size {}; pan-and-scan crops are "
               "not implemented), got {}",
               c.num_channels, c.image_size, c.image_size, c.image_size, detail::shape_str(vision.pixel_values));
  ++vision_tower_calls_;
  const at::Device dev = device();
  const int64_t e = c.vision_hidden_size, side = c.patches_per_side(), k = c.pool_kernel();
  Communicator* comm = vision_sharded_ ? tp_comm_ : nullptr;
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < pixels.size(0); ++i) {
    at::Tensor img = pixels.narrow(0, i, 1).to(dev, at::kFloat);
    at::Tensor x = at::conv2d(img, vision_.patch_embedding, vision_.patch_embedding_bias, {c.patch_size, c.patch_size});
    x = x.flatten(2).transpose(1, 2).squeeze(0) + vision_.position_embedding;  // [P, E]
    x = x.unsqueeze(0);                                                        // one sequence of P patches
    for (const gemma3::VisionLayer& l : vision_.layers) {
      x = detail::run_encoder_layer(x, l, c.vision_num_attention_heads, c.vision_layer_norm_eps,
                                    detail::VitActivation::kTanhGelu, comm);
    }
    x = x.squeeze(0);
    x = detail::apply_layer_norm(x, vision_.post_layernorm, c.vision_layer_norm_eps);
    // The projector: patches back on their grid, averaged k x k, normalized, projected.
    at::Tensor grid = x.transpose(0, 1).reshape({1, e, side, side});
    at::Tensor pooled = at::avg_pool2d(grid, {k, k}, {k, k}).flatten(2).transpose(1, 2).squeeze(0);  // [T, E]
    pooled = detail::apply_gemma_rms_norm(pooled, vision_.mm_soft_emb_norm, c.vision_layer_norm_eps);
    out.push_back(at::matmul(pooled, vision_.mm_input_projection));
  }
  return at::cat(out, 0);
}

at::Tensor Gemma3::encode_images(const VisionInputs& vision) {
  VLMGEN_CHECK(!vision.empty() && vision.num_images() > 0, "encode_images needs at least one image");
  at::NoGradGuard no_grad;
  return run_vision_tower(vision);
}

Gemma3::Window Gemma3::check_window(const ForwardArgs& args) const {
  const at::Tensor& ids_in = args.input_ids;
  VLMGEN_CHECK(ids_in.defined() && ids_in.dim() == 2 && ids_in.size(0) >= 1 && ids_in.size(1) >= 1,
               "input_ids must be [B, S] with B, S >= 1, got {}", detail::shape_str(ids_in));
  VLMGEN_CHECK(detail::is_integral(ids_in), "input_ids must be an integer tensor, got {}",
               c10::toString(ids_in.scalar_type()));
  const int64_t b = ids_in.size(0), s = ids_in.size(1), start = args.window_start;
  VLMGEN_CHECK(start >= 0, "window_start must be >= 0, got {}", start);
  const at::Tensor host = ids_in.to(at::kCPU, at::kLong).contiguous();
  const int64_t lo = host.min().item<int64_t>(), hi = host.max().item<int64_t>();
  VLMGEN_CHECK(lo >= 0 && hi < config_.vocab_size, "token ids must be in [0, {}), got ids in [{}, {}]",
               config_.vocab_size, lo, hi);
  const at::Device dev = device();
  Window w;
  w.start = start;
  w.context = args.context;
  w.last_column_only = args.last_column_logits;
  w.ids = ids_in.device() == dev ? ids_in.to(at::kLong) : host.to(dev, at::kLong, /*non_blocking=*/true);
  if (args.attention_mask.defined()) {
    VLMGEN_CHECK(
        args.attention_mask.dim() == 2 && args.attention_mask.size(0) == b && args.attention_mask.size(1) == start + s,
        "attention_mask must be [{}, {}] (window_start {} + window {}), got {}", b, start + s, start, s,
        detail::shape_str(args.attention_mask));
    w.mask = args.attention_mask.to(dev, at::kLong);
  } else {
    w.mask = at::ones({b, start + s}, at::TensorOptions().dtype(at::kLong).device(dev));
  }
  VLMGEN_CHECK(args.position_ids.defined() && args.position_ids.dim() == 2 && args.position_ids.size(0) == b &&
                   args.position_ids.size(1) == s,
               "position_ids must be [{}, {}] (gemma3 positions are 1-D), got {}", b, s,
               detail::shape_str(args.position_ids));
  w.positions = args.position_ids.to(dev, at::kLong);
  if (args.context != nullptr) {
    VLMGEN_CHECK(args.context->length() == start, "the KV cache holds {} columns but the window starts at column {}",
                 args.context->length(), start);
    VLMGEN_CHECK(args.context->batch_size() == b, "the KV cache has {} rows but the window has {}",
                 args.context->batch_size(), b);
  }
  if (!host.eq(config_.image_token_id).any().item<bool>()) return w;

  // Which image each column belongs to: runs of placeholders, mm_tokens_per_image per image. A
  // window that cuts an image would let part of it attend to the rest one way only.
  at::Tensor row_ids = host;
  if (args.context != nullptr && start > 0) row_ids = at::cat({args.context->tokens(), host}, 1);
  const int64_t cols = row_ids.size(1), offset = start + s - cols, per = config_.mm_tokens_per_image;
  at::Tensor groups = at::full({b, start + s}, -1, at::kLong);
  const int64_t* id = row_ids.data_ptr<int64_t>();
  int64_t* g = groups.data_ptr<int64_t>();
  int64_t next = 0;
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t c = 0; c < cols;) {
      if (id[r * cols + c] != config_.image_token_id) {
        ++c;
        continue;
      }
      int64_t end = c;
      while (end < cols && id[r * cols + end] == config_.image_token_id) ++end;
      const int64_t first = c + offset, last = end + offset;  // key columns [first, last)
      if (last > start) {
        VLMGEN_CHECK(first >= start || args.context == nullptr,
                     "row {}: the window starting at column {} cuts the image whose placeholders begin at column {} "
                     "(gemma3 image tokens attend both ways); start the window at the image's first placeholder",
                     r, start, first);
        VLMGEN_CHECK((end - c) % per == 0,
                     "row {}: the placeholder run at columns [{}, {}) holds {} tokens, not a multiple of the {} of a "
                     "gemma3 image{}",
                     r, first, last, end - c, per, last == start + s ? " (a window must not end inside an image)" : "");
      }
      for (int64_t j = c; j < end; ++j) g[r * (start + s) + j + offset] = next + (j - c) / per;
      next += (end - c) / per + 1;
      c = end;
    }
  }
  w.image_groups = groups.to(dev, /*non_blocking=*/true);
  return w;
}

at::Tensor Gemma3::forward(const ForwardArgs& args) {
  at::NoGradGuard no_grad;
  const Window w = check_window(args);
  const int64_t b = w.ids.size(0), s = w.ids.size(1), h = config_.hidden_size;
  // Scaled by sqrt(hidden) rounded to float32, as transformers stores the scale.
  const double scale = static_cast<float>(std::sqrt(static_cast<double>(h)));
  at::Tensor hidden =
      (tp_comm_ == nullptr ? at::embedding(lm_.embed_tokens, w.ids).to(at::kFloat)
                           : vocab_parallel_embedding(w.ids, lm_.embed_tokens,
                                                      parallel_.tp_rank() * lm_.embed_tokens.size(0), tp_comm_)) *
      scale;
  const bool have_embeddings = args.image_embeddings.defined();
  if (have_embeddings || !args.vision.empty()) {
    at::Tensor placeholder = w.ids.eq(config_.image_token_id).reshape({b * s});
    const int64_t placeholders = placeholder.sum().item<int64_t>();
    int64_t rows = 0;
    if (have_embeddings) {
      VLMGEN_CHECK(args.image_embeddings.dim() == 2 && args.image_embeddings.size(1) == h,
                   "image_embeddings must be [rows, {}], got {}", h, detail::shape_str(args.image_embeddings));
      rows = args.image_embeddings.size(0);
    } else {
      args.vision.validate(1);
      rows = args.vision.num_images() * config_.mm_tokens_per_image;
    }
    VLMGEN_CHECK(placeholders == rows,
                 "the window has {} image placeholder tokens but the {} carry {} embedding rows ({} images of {}); "
                 "placeholders and embeddings must match exactly",
                 placeholders, have_embeddings ? "image_embeddings" : "vision inputs", rows,
                 have_embeddings ? static_cast<int64_t>(args.images.size()) : args.vision.num_images(),
                 config_.mm_tokens_per_image);
    if (rows > 0) {  // an empty bundle places nothing
      at::Tensor placed =
          have_embeddings ? args.image_embeddings.to(device(), at::kFloat) : run_vision_tower(args.vision);
      hidden.view({b * s, h}).index_copy_(0, placeholder.nonzero().squeeze(1), placed);
    }
  }
  return run_language_model(hidden, w);
}

}  // namespace vlmgen
