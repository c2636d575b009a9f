// LLaVA-NeXT: the CLIP tower, the projector, anyres packing (unpad, image_newline), and the
// forward calls, which hand the packed rows to the Llama text model (a QwenVl decoder) as image
// embeddings. Checkpoints are in llava_next_checkpoint.cpp.

#include "vlmgen/models/llava_next.h"

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
#include "vlmgen/error.h"

namespace vlmgen {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

void LlavaNext::set_kv_cache_dtype(at::ScalarType dtype) {
  lm_->set_kv_cache_dtype(dtype);  // its decoder runs the forward
  traits_.kv_cache.dtype = dtype;
}

LlavaNext::LlavaNext(const LlavaNextConfig& config, std::unique_ptr<QwenVl> lm) : config_(config), lm_(std::move(lm)) {
  traits_ = lm_->traits();
  traits_.image_token_id = config_.image_token_id;
  traits_.vision_start_token_id.reset();
  traits_.vision_end_token_id.reset();
  traits_.video_token_id.reset();
  traits_.spatial_merge_size = 1;
  traits_.vision_layout = VisionLayout::kPerImage;
  traits_.tokens_per_image = 0;  // per image, from image_sizes (placeholder_counts)
  vision_sharded_ = detail::shard_encoder_layers("llava_next", config_.vision_num_attention_heads,
                                                 config_.vision_intermediate_size, lm_->parallel());
  allocate_vision();
}

LlavaNext::LlavaNext(const LlavaNextConfig& config, uint64_t seed, double init_std, ParallelContext parallel)
    : LlavaNext(config, [&] {
        config.validate();
        return std::make_unique<QwenVl>(config.language_model_config(), seed, init_std, parallel);
      }()) {
  at::NoGradGuard no_grad;
  at::Generator gen = detail::make_cpu_generator(seed + 7919);
  const ParallelContext& p = lm_->parallel();
  // Each rank draws the whole tower and keeps its slices, so every TP size holds the same model.
  for (const QwenVl::WeightSlot& slot : vision_weights()) {
    const std::string& name = slot.name;
    const bool norm = ends_with(name, "norm1.weight") || ends_with(name, "norm2.weight") ||
                      ends_with(name, "layrnorm.weight") || ends_with(name, "layernorm.weight");
    at::Tensor full = at::empty(lm_->full_shape(*slot.tensor, slot.layout), slot.tensor->options());
    full.normal_(norm ? 1.0 : 0.0, init_std, gen);
    slot.tensor->copy_(detail::take_shard(full, slot.layout, p.tp_rank(), p.tp_size()));
  }
}

void LlavaNext::allocate_vision() {
  const LlavaNextConfig& c = config_;
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  auto linear = [&](int64_t out, int64_t in, bool bias) {
    return qwen_vl::Linear{at::empty({out, in}, opts), bias ? at::empty({out}, opts) : at::Tensor(), {}};
  };
  auto norm = [&](int64_t dim) { return qwen_vl::LayerNorm{at::empty({dim}, opts), at::empty({dim}, opts)}; };
  const int64_t e = c.vision_hidden_size, p = c.patches_per_side() * c.patches_per_side();
  const int64_t tp = vision_sharded_ ? lm_->parallel().tp_size() : 1;
  vision_.class_embedding = at::empty({e}, opts);
  vision_.patch_embedding = at::empty({e, c.num_channels, c.patch_size, c.patch_size}, opts);
  vision_.position_embedding = at::empty({p + 1, e}, opts);
  vision_.pre_layrnorm = norm(e);
  vision_.layers.clear();
  for (int64_t i = 0; i < c.vision_num_hidden_layers; ++i) {
    vision_.layers.push_back(detail::allocate_encoder_layer(e, c.vision_intermediate_size, opts, tp));
  }
  vision_.post_layernorm = norm(e);
  vision_.linear_1 = linear(c.hidden_size, e, c.projector_bias);
  vision_.linear_2 = linear(c.hidden_size, c.hidden_size, c.projector_bias);
  vision_.image_newline = at::empty({c.hidden_size}, opts);
}

std::vector<QwenVl::WeightSlot> LlavaNext::vision_weights() {
  using qwen_vl::ShardLayout;
  std::vector<QwenVl::WeightSlot> out;
  auto add = [&](std::string name, at::Tensor& t, ShardLayout layout) { out.push_back({std::move(name), &t, layout}); };
  auto add_linear = [&](const std::string& name, qwen_vl::Linear& l) {
    add(name + ".weight", l.weight, ShardLayout::kReplicated);
    if (l.bias.defined()) add(name + ".bias", l.bias, ShardLayout::kReplicated);
  };
  auto add_norm = [&](const std::string& name, qwen_vl::LayerNorm& n) {
    add(name + ".weight", n.weight, ShardLayout::kReplicated);
    add(name + ".bias", n.bias, ShardLayout::kReplicated);
  };
  const std::string v = "model.vision_tower.vision_model.";
  add(v + "embeddings.class_embedding", vision_.class_embedding, ShardLayout::kReplicated);
  add(v + "embeddings.patch_embedding.weight", vision_.patch_embedding, ShardLayout::kReplicated);
  add(v + "embeddings.position_embedding.weight", vision_.position_embedding, ShardLayout::kReplicated);
  add_norm(v + "pre_layrnorm", vision_.pre_layrnorm);
  for (size_t i = 0; i < vision_.layers.size(); ++i) {
    detail::add_encoder_layer_weights(v + "encoder.layers." + std::to_string(i) + ".", vision_.layers[i],
                                      vision_sharded_, add);
  }
  add_norm(v + "post_layernorm", vision_.post_layernorm);
  add_linear("model.multi_modal_projector.linear_1", vision_.linear_1);
  add_linear("model.multi_modal_projector.linear_2", vision_.linear_2);
  add("model.image_newline", vision_.image_newline, ShardLayout::kReplicated);
  return out;
}

std::vector<QwenVl::WeightSlot> LlavaNext::weight_slots() {
  std::vector<QwenVl::WeightSlot> out;
  for (const QwenVl::WeightSlot& slot : lm_->weight_slots()) {
    if (slot.name.rfind("visual.", 0) == 0) continue;  // the idle tower of the decoder
    const std::string& name = slot.name;
    out.push_back(
        {name.rfind("model.", 0) == 0 ? "model.language_model." + name.substr(6) : name, slot.tensor, slot.layout});
  }
  for (QwenVl::WeightSlot& slot : vision_weights()) out.push_back(std::move(slot));
  return out;
}

std::vector<std::pair<std::string, at::Tensor*>> LlavaNext::named_weights() {
  std::vector<std::pair<std::string, at::Tensor*>> out;
  for (const QwenVl::WeightSlot& slot : weight_slots()) out.emplace_back(slot.name, slot.tensor);
  return out;
}

qwen_vl::ShardLayout LlavaNext::shard_layout(const std::string& name) const {
  for (const QwenVl::WeightSlot& slot : const_cast<LlavaNext*>(this)->weight_slots()) {
    if (slot.name == name) return slot.layout;
  }
  VLMGEN_FAIL("llava_next has no weight named {}", name);
}

void LlavaNext::to(at::Device device) {
  check_kv_cache_dtype(traits().kv_cache.dtype, device);  // the 16- and 8-bit caches are the CPU's
  lm_->to(device);
  for (const QwenVl::WeightSlot& slot : vision_weights()) *slot.tensor = slot.tensor->to(device);
}

std::vector<int64_t> LlavaNext::placeholder_counts(const VisionInputs& vision) const {
  std::vector<int64_t> counts;
  if (vision.empty()) return counts;
  VLMGEN_CHECK(vision.layout == VisionLayout::kPerImage,
               "llava_next takes per-image vision inputs (pixel_values [N, tiles, {}, {}, {}] and image_sizes), got "
               "the patch-flattened layout",
               config_.num_channels, config_.image_size, config_.image_size);
  VLMGEN_CHECK(vision.image_sizes.defined(),
               "llava_next needs image_sizes ([N, 2], each image's original height and width): they decide each "
               "image's tiles and placeholder count");
  vision.validate(1);
  // The pixels are checked here too, so a bad bundle is refused when the request is laid out,
  // before any forward call (the generator asks for the counts first).
  const at::Tensor& pixels = vision.pixel_values;
  const LlavaNextConfig& c = config_;
  VLMGEN_CHECK(pixels.dim() == 5 && pixels.size(2) == c.num_channels && pixels.size(3) == c.image_size &&
                   pixels.size(4) == c.image_size,
               "llava_next pixel_values must be [N, tiles, {}, {}, {}], got {}", c.num_channels, c.image_size,
               c.image_size, detail::shape_str(pixels));
  const std::vector<int64_t> sizes = detail::to_int64_vector(vision.image_sizes);
  for (size_t i = 0; i < sizes.size(); i += 2) {
    const int64_t h = sizes[i], w = sizes[i + 1];
    const LlavaNextGrid g = llava_next_grid(c, h, w);
    VLMGEN_CHECK(pixels.size(1) >= g.tiles(),
                 "image {} of {}x{} (height x width) pixels takes {} tiles (the base image and {}x{} of its anyres "
                 "resolution) but pixel_values holds {}",
                 i / 2, h, w, g.tiles(), g.grid_h, g.grid_w, pixels.size(1));
    counts.push_back(llava_next_placeholder_count(c, h, w));
  }
  return counts;
}

at::Tensor LlavaNext::tile_features(const at::Tensor& tiles) const {
  const LlavaNextConfig& c = config_;
  const int64_t t = tiles.size(0), e = c.vision_hidden_size;
  at::Tensor x = at::conv2d(tiles, vision_.patch_embedding, {}, {c.patch_size, c.patch_size});
  x = x.flatten(2).transpose(1, 2);  // [T, P, E]
  x = at::cat({vision_.class_embedding.view({1, 1, e}).expand({t, 1, e}), x}, 1) + vision_.position_embedding;
  x = detail::apply_layer_norm(x, vision_.pre_layrnorm, c.vision_layer_norm_eps);
  Communicator* comm = vision_sharded_ ? lm_->tp_comm_ : nullptr;
  for (int64_t i = 0; i < c.vision_layers_used(); ++i) {
    x = detail::run_encoder_layer(
        x, vision_.layers[static_cast<size_t>(i)], c.vision_num_attention_heads, c.vision_layer_norm_eps,
        c.vision_quick_gelu ? detail::VitActivation::kQuickGelu : detail::VitActivation::kGelu, comm);
  }
  x = x.narrow(1, 1, x.size(1) - 1);  // "default": the class token dropped
  return detail::apply_linear(at::gelu(detail::apply_linear(x, vision_.linear_1)), vision_.linear_2);
}

at::Tensor LlavaNext::pack(const at::Tensor& features, const LlavaNextGrid& g) const {
  const int64_t hidden = config_.hidden_size, side = config_.patches_per_side();
  // The tiles' patches back on one grid, the padding cut off, each row ended by image_newline;
  // the base tile's rows first.
  at::Tensor grid = features.narrow(0, 1, g.grid_h * g.grid_w)
                        .reshape({g.grid_h, g.grid_w, side, side, hidden})
                        .permute({0, 2, 1, 3, 4})
                        .reshape({g.grid_h * side, g.grid_w * side, hidden})
                        .narrow(0, g.row_offset, g.rows)
                        .narrow(1, g.col_offset, g.cols);
  grid = at::cat({grid, vision_.image_newline.view({1, 1, hidden}).expand({g.rows, 1, hidden})}, 1);
  return at::cat({features[0], grid.reshape({-1, hidden})}, 0);
}

at::Tensor LlavaNext::encode_images(const VisionInputs& vision) {
  VLMGEN_CHECK(!vision.empty() && vision.num_images() > 0, "encode_images needs at least one image");
  const std::vector<int64_t> counts = placeholder_counts(vision);  // checks the pixels and sizes
  const LlavaNextConfig& c = config_;
  const at::Tensor& pixels = vision.pixel_values;
  const std::vector<int64_t> sizes = detail::to_int64_vector(vision.image_sizes);
  at::NoGradGuard no_grad;
  ++vision_tower_calls_;
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < pixels.size(0); ++i) {
    const int64_t h = sizes[2 * i], w = sizes[2 * i + 1];
    const LlavaNextGrid g = llava_next_grid(c, h, w);
    at::Tensor rows = pack(tile_features(pixels[i].narrow(0, 0, g.tiles()).to(device(), at::kFloat)), g);
    VLMGEN_CHECK(rows.size(0) == counts[static_cast<size_t>(i)],
                 "image {}: packed {} rows but the processor counts {} placeholders", i, rows.size(0),
                 counts[static_cast<size_t>(i)]);
    out.push_back(rows);
  }
  return at::cat(out, 0);
}

ForwardArgs LlavaNext::embedded(const ForwardArgs& args) {
  ForwardArgs out = args;
  if (!args.vision.empty() && args.vision.num_images() > 0 && !args.image_embeddings.defined()) {
    VLMGEN_CHECK(args.input_ids.defined() && args.input_ids.dim() == 2 && detail::is_integral(args.input_ids),
                 "input_ids must be an integer tensor [B, S], got {}", detail::shape_str(args.input_ids));
    // Counts first: a bundle whose sizes disagree with the window's placeholders fails before
    // the tower runs.
    int64_t needed = 0;
    for (int64_t n : placeholder_counts(args.vision)) needed += n;
    const int64_t placeholders = args.input_ids.eq(config_.image_token_id).sum().item<int64_t>();
    VLMGEN_CHECK(placeholders == needed,
                 "the window has {} image placeholder tokens but the vision inputs' {} images need {} (from "
                 "image_sizes); placeholders and images must match exactly",
                 placeholders, args.vision.num_images(), needed);
    out.image_embeddings = encode_images(args.vision);
  }
  out.vision = VisionInputs();
  return out;
}

at::Tensor LlavaNext::forward(const ForwardArgs& args) {
  return args.vision.empty() ? lm_->forward(args) : lm_->forward(embedded(args));
}

std::vector<at::Tensor> LlavaNext::forward_batch(const std::vector<const ForwardArgs*>& calls) {
  // A decode step carries no images: the calls go to the decoder as they are.
  if (std::all_of(calls.begin(), calls.end(), [](const ForwardArgs* c) { return c->vision.empty(); })) {
    return lm_->forward_batch(calls);
  }
  std::vector<ForwardArgs> owned;
  owned.reserve(calls.size());
  for (const ForwardArgs* call : calls) owned.push_back(embedded(*call));
  std::vector<const ForwardArgs*> pointers;
  for (const ForwardArgs& call : owned) pointers.push_back(&call);
  return lm_->forward_batch(pointers);
}

}  // namespace vlmgen
