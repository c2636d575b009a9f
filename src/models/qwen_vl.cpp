#include "vlmgen/models/qwen_vl.h"

#include <algorithm>
#include <array>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "qwen_family.h"
#include "qwen_vl_ops.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/detail/torch_compat.h"
#include "vlmgen/distributed/communicator.h"
#include "vlmgen/error.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/kernels/cpu.h"

namespace vlmgen {
namespace {

/// The requirements this implementation has of a config, checked before any allocation so a bad
/// config.json fails with the field's name rather than a shape error deep in a forward call.
void check_config(const QwenVlConfig& c) {
  // The config's own rules first: they bound every size, so nothing below (or the allocation
  // after it) can overflow, and the constructor never accepts what validate() refuses.
  c.validate();
  VLMGEN_CHECK(c.hidden_size >= 1 && c.num_hidden_layers >= 1 && c.intermediate_size >= 1 && c.vocab_size >= 1,
               "Qwen-VL config needs positive hidden_size, num_hidden_layers, intermediate_size and vocab_size, "
               "got {}, {}, {}, {}",
               c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size);
  VLMGEN_CHECK(
      c.num_attention_heads >= 1 && c.num_key_value_heads >= 1 && c.num_attention_heads % c.num_key_value_heads == 0,
      "num_attention_heads {} must be a positive multiple of num_key_value_heads {}", c.num_attention_heads,
      c.num_key_value_heads);
  VLMGEN_CHECK(c.head_dim >= 2 && c.head_dim % 2 == 0, "head_dim must be even and >= 2, got {}", c.head_dim);
  VLMGEN_CHECK(c.mrope_section.size() == 3, "mrope_section must have 3 entries (t, h, w), got {}",
               c.mrope_section.size());
  const int64_t section_sum = c.mrope_section[0] + c.mrope_section[1] + c.mrope_section[2];  // bounded by validate
  VLMGEN_CHECK(section_sum == c.head_dim / 2 &&
                   std::all_of(c.mrope_section.begin(), c.mrope_section.end(), [](int64_t s) { return s >= 0; }),
               "mrope_section [{}] must be non-negative and sum to head_dim / 2 = {}, sums to {}",
               fmt::join(c.mrope_section, ", "), c.head_dim / 2, section_sum);
  VLMGEN_CHECK(c.image_token_id >= 0 && c.image_token_id < c.vocab_size,
               "image_token_id {} is outside the vocabulary of {}", c.image_token_id, c.vocab_size);
  const QwenVisionConfig& v = c.vision;
  const detail::QwenFamilySpec& spec = detail::family_spec(c.family);
  VLMGEN_CHECK(v.depth >= 0 && v.embed_dim >= 1 && v.num_heads >= 1 && v.embed_dim % v.num_heads == 0,
               "{} {} must be a positive multiple of vision num_heads {} (depth {})", spec.vision_width_field,
               v.embed_dim, v.num_heads, v.depth);
  // The 2-D rotary splits half of each head between h and w, and rotate_half halves that again.
  VLMGEN_CHECK((v.embed_dim / v.num_heads) % 4 == 0,
               "vision head_dim {} (embed_dim {} / num_heads {}) must be a multiple of 4", v.embed_dim / v.num_heads,
               v.embed_dim, v.num_heads);
  VLMGEN_CHECK(v.in_channels >= 1 && v.patch_size >= 1 && v.temporal_patch_size >= 1 && v.spatial_merge_size >= 1 &&
                   v.mlp_ratio >= 1,
               "vision in_channels {}, patch_size {}, temporal_patch_size {}, spatial_merge_size {} and mlp_ratio {} "
               "must be positive",
               v.in_channels, v.patch_size, v.temporal_patch_size, v.spatial_merge_size, v.mlp_ratio);
  VLMGEN_CHECK(v.hidden_size == c.hidden_size, "{} {} (the merger's output) must equal the LM hidden_size {}",
               spec.vision_out_field, v.hidden_size, c.hidden_size);
  const bool known_act = v.hidden_act == "quick_gelu" || v.hidden_act == "gelu" || v.hidden_act == "silu" ||
                         v.hidden_act == "gelu_pytorch_tanh";
  VLMGEN_CHECK(known_act, "vision hidden_act \"{}\" is not supported (quick_gelu, gelu, gelu_pytorch_tanh or silu)",
               v.hidden_act);
}

/// The vision tower is split when all of its split dimensions divide by tp; else replicated.
bool can_shard_vision(const QwenVlConfig& c, int64_t tp) {
  const QwenVisionConfig& v = c.vision;
  const int64_t merged = v.embed_dim * v.spatial_merge_size * v.spatial_merge_size;
  return tp > 1 && v.num_heads % tp == 0 && v.mlp_width(c.family) % tp == 0 && merged % tp == 0;
}

ModelTraits make_traits(const QwenVlConfig& c) {
  ModelTraits t;
  t.vocab_size = c.vocab_size;
  t.image_token_id = c.image_token_id;
  t.vision_start_token_id = c.vision_start_token_id;
  t.vision_end_token_id = c.vision_end_token_id;
  t.video_token_id = c.video_token_id;
  t.spatial_merge_size = c.vision.spatial_merge_size;
  t.vision_layout = VisionLayout::kPatchFlattened;
  t.max_sequence_length = c.max_position_embeddings;
  t.supports_kv_cache = true;
  // Sequence parallelism only splits activations between blocks (attention sees the whole
  // window), so the cache holds every column.
  t.kv_cache_under_sequence_parallel = true;
  t.accepts_partial_image_span = false;
  t.kv_cache.num_layers = c.num_hidden_layers;
  t.kv_cache.num_kv_heads = c.num_key_value_heads;
  t.kv_cache.head_dim = c.head_dim;
  t.kv_cache.dtype = at::kFloat;
  return t;
}

bool is_norm_weight(const std::string& name) {
  auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends_with("norm1.weight") || ends_with("norm2.weight") || ends_with("ln_q.weight") ||
         ends_with("merger.norm.weight") || ends_with(".norm.weight") || ends_with("layernorm.weight") ||
         ends_with("q_norm.weight") || ends_with("k_norm.weight") || name == "model.norm.weight";
}

}  // namespace

/// What tensor parallelism needs of a config: every rank holds the same number of attention
/// heads, KV heads, MLP rows and vocabulary rows. Checked before any allocation or collective.
void QwenVl::check_parallel_config(const QwenVlConfig& c, const ParallelContext& p) {
  const int64_t tp = p.tp_size();
  if (tp == 1) return;
  const auto& group = p.tp_group();
  VLMGEN_CHECK(group != nullptr && group->size() == tp && group->rank() == p.tp_rank(),
               "the ParallelContext says tp rank {} of {} but its communicator is {}", p.tp_rank(), tp,
               group == nullptr ? std::string("missing") : fmt::format("rank {} of {}", group->rank(), group->size()));
  auto check_divides = [&](const char* field, int64_t value) {
    VLMGEN_CHECK(
        value % tp == 0,
        "cannot split a Qwen-VL model over tensor-parallel size {}: {} {} is not divisible by {} (every rank must "
        "hold the same number)",
        tp, field, value, tp);
  };
  check_divides("num_attention_heads", c.num_attention_heads);
  check_divides("num_key_value_heads", c.num_key_value_heads);
  check_divides("intermediate_size", c.intermediate_size);
  check_divides("vocab_size", c.vocab_size);
}

QwenVl::QwenVl(const QwenVlConfig& config, Uninitialized, ParallelContext parallel)
    : config_(config), parallel_(std::move(parallel)) {
  check_config(config_);
  check_parallel_config(config_, parallel_);
  tp_comm_ = parallel_.tp_size() > 1 ? parallel_.tp_group().get() : nullptr;
  vision_sharded_ = can_shard_vision(config_, parallel_.tp_size());
  traits_ = make_traits(config_);
  traits_.kv_cache.num_kv_heads = config_.num_key_value_heads / parallel_.tp_size();
  traits_.vocab_parallel_logits = parallel_.tp_size() > 1;
  allocate_weights();
}

QwenVl::QwenVl(const QwenVlConfig& config, uint64_t seed, double init_std, ParallelContext parallel)
    : QwenVl(config, Uninitialized{}, std::move(parallel)) {
  VLMGEN_CHECK(init_std >= 0.0, "init_std must be >= 0, got {}", init_std);
  init_random(seed, init_std);
}

void QwenVl::allocate_weights() {
  // Sizes are bounded by validate() (check_config); a model that is valid but larger than this
  // machine's memory is still refused as a vlmgen::Error naming the numbers.
  const int64_t parameters = config_.parameter_count();
  try {
    // Local slices: the split dimension of each weight divided by tp (see weight_slots).
    const int64_t tp = parallel_.tp_size();
    const int64_t vtp = vision_sharded_ ? tp : 1;
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    auto linear = [&](int64_t out, int64_t in, bool bias) {
      qwen_vl::Linear l;
      l.weight = at::empty({out, in}, opts);
      if (bias) l.bias = at::empty({out}, opts);
      return l;
    };
    const detail::QwenFamilySpec& spec = detail::family_spec(config_.family);
    // An RMSNorm is a LayerNorm without bias.
    auto layer_norm = [&](int64_t dim, bool rms) {
      return qwen_vl::LayerNorm{at::empty({dim}, opts), rms ? at::Tensor() : at::empty({dim}, opts)};
    };

    const QwenVisionConfig& v = config_.vision;
    const int64_t e = v.embed_dim;
    const int64_t mlp = v.mlp_width(config_.family);
    const int64_t merged = e * v.spatial_merge_size * v.spatial_merge_size;
    vision_.patch_embed = at::empty({e, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size}, opts);
    vision_.patch_embed_bias = spec.patch_embed_bias ? at::empty({e}, opts) : at::Tensor();
    vision_.position_table =
        spec.learned_position_table ? at::empty({v.num_position_embeddings, e}, opts) : at::Tensor();
    vision_.blocks.clear();
    for (int64_t i = 0; i < v.depth; ++i) {
      qwen_vl::VisionBlock b;
      b.norm1 = layer_norm(e, spec.vision_rms_norm);
      b.qkv = linear(3 * e / vtp, e, true);
      b.proj = linear(e, e / vtp, true);
      b.norm2 = layer_norm(e, spec.vision_rms_norm);
      b.fc1 = linear(mlp / vtp, e, true);
      if (spec.vision_gated_mlp) b.up = linear(mlp / vtp, e, true);
      b.fc2 = linear(e, mlp / vtp, true);
      vision_.blocks.push_back(std::move(b));
    }
    auto merger = [&](int64_t norm_dim, bool rms) {
      return qwen_vl::PatchMerger{layer_norm(norm_dim, rms), linear(merged / vtp, merged, true),
                                  linear(config_.hidden_size, merged / vtp, true)};
    };
    vision_.merger = merger(e, spec.vision_rms_norm);
    vision_.deepstack.clear();
    for (size_t i = 0; i < v.deepstack_visual_indexes.size(); ++i) vision_.deepstack.push_back(merger(merged, false));

    const int64_t h = config_.hidden_size;
    const int64_t q_out = config_.num_attention_heads * config_.head_dim / tp;
    const int64_t kv_out = config_.num_key_value_heads * config_.head_dim / tp;
    const int64_t ffn = config_.intermediate_size / tp;
    const int64_t vocab = config_.vocab_size / tp;
    lm_.embed_tokens = at::empty({vocab, h}, opts);
    lm_.layers.clear();
    for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
      qwen_vl::DecoderLayer l;
      l.input_layernorm = at::empty({h}, opts);
      l.q_proj = linear(q_out, h, config_.attention_bias);
      l.k_proj = linear(kv_out, h, config_.attention_bias);
      l.v_proj = linear(kv_out, h, config_.attention_bias);
      if (config_.qk_norm) {
        l.q_norm = at::empty({config_.head_dim}, opts);
        l.k_norm = at::empty({config_.head_dim}, opts);
      }
      l.o_proj = linear(h, q_out, false);
      l.post_attention_layernorm = at::empty({h}, opts);
      l.gate_proj = linear(ffn, h, false);
      l.up_proj = linear(ffn, h, false);
      l.down_proj = linear(h, ffn, false);
      lm_.layers.push_back(std::move(l));
    }
    lm_.norm = at::empty({h}, opts);
    if (config_.tie_word_embeddings) {
      tie_lm_head();
    } else {
      lm_.lm_head = at::empty({vocab, h}, opts);
    }
  } catch (const c10::Error& e) {
    VLMGEN_FAIL("cannot allocate the {} float32 weights ({} bytes) this config describes: {}", parameters,
                parameters * 4, e.what_without_backtrace());  // <= 2^42: kMaxParameters
  }
}

void QwenVl::init_random(uint64_t seed, double init_std) {
  // One generator walked in named_weights() order: the same weights on every build and device.
  // A split weight is drawn whole and sliced, so the ranks hold the single-process model.
  at::Generator gen = detail::make_cpu_generator(seed);
  for (WeightSlot& slot : weight_slots()) {
    // Norm weights near 1 (not exactly 1) so a test mixing up two norms can tell them apart.
    const double mean = is_norm_weight(slot.name) ? 1.0 : 0.0;
    if (slot.layout == qwen_vl::ShardLayout::kReplicated) {
      slot.tensor->normal_(mean, init_std, gen);
      continue;
    }
    at::Tensor full = at::empty(full_shape(*slot.tensor, slot.layout), slot.tensor->options());
    full.normal_(mean, init_std, gen);
    slot.tensor->copy_(detail::take_shard(full, slot.layout, parallel_.tp_rank(), parallel_.tp_size()));
  }
}

std::vector<int64_t> QwenVl::full_shape(const at::Tensor& local, qwen_vl::ShardLayout layout) const {
  std::vector<int64_t> shape = local.sizes().vec();
  switch (layout) {
    case qwen_vl::ShardLayout::kReplicated: break;
    case qwen_vl::ShardLayout::kRows:
    case qwen_vl::ShardLayout::kStackedRows: shape[0] *= parallel_.tp_size(); break;
    case qwen_vl::ShardLayout::kColumns: shape[1] *= parallel_.tp_size(); break;
  }
  return shape;
}

qwen_vl::ShardLayout QwenVl::shard_layout(const std::string& name) const {
  for (const WeightSlot& slot : const_cast<QwenVl*>(this)->weight_slots()) {
    if (slot.name == name) return slot.layout;
  }
  if (name == "lm_head.weight" && config_.tie_word_embeddings) return shard_layout("model.embed_tokens.weight");
  VLMGEN_FAIL("{} has no weight named '{}'", detail::family_spec(config_.family).display_name, name);
}

void QwenVl::tie_lm_head() {
  config_.tie_word_embeddings = true;
  lm_.lm_head = lm_.embed_tokens;  // same TensorImpl: one copy of the matrix
}

std::vector<QwenVl::WeightSlot> QwenVl::weight_slots() {
  using qwen_vl::ShardLayout;
  const ShardLayout replicated = ShardLayout::kReplicated;
  // The layout a weight has when its part of the model is split (kReplicated when it is not).
  const bool lm_split = parallel_.tp_size() > 1;
  auto vision = [&](ShardLayout l) { return vision_sharded_ ? l : replicated; };
  auto text = [&](ShardLayout l) { return lm_split ? l : replicated; };
  std::vector<WeightSlot> out;
  // Column-parallel: weight and bias split by rows. Row-parallel: weight split by columns, the
  // bias (added once after the reduction) whole.
  auto add_linear = [&](const std::string& prefix, qwen_vl::Linear& l, ShardLayout weight_layout) {
    out.push_back({prefix + ".weight", &l.weight, weight_layout});
    if (l.bias.defined()) {
      out.push_back({prefix + ".bias", &l.bias, weight_layout == ShardLayout::kColumns ? replicated : weight_layout});
    }
  };
  auto add_layer_norm = [&](const std::string& prefix, qwen_vl::LayerNorm& n) {
    out.push_back({prefix + ".weight", &n.weight, replicated});
    if (n.bias.defined()) out.push_back({prefix + ".bias", &n.bias, replicated});
  };
  // A merger's two linears: column- then row-parallel.
  auto add_merger = [&](const std::string& norm, const std::string& fc1, const std::string& fc2,
                        qwen_vl::PatchMerger& m) {
    add_layer_norm(norm, m.norm);
    add_linear(fc1, m.fc1, vision(ShardLayout::kRows));
    add_linear(fc2, m.fc2, vision(ShardLayout::kColumns));
  };
  const detail::QwenFamilySpec& spec = detail::family_spec(config_.family);
  const std::string v = "visual.";
  out.push_back({"visual.patch_embed.proj.weight", &vision_.patch_embed, replicated});
  if (vision_.patch_embed_bias.defined()) {
    out.push_back({"visual.patch_embed.proj.bias", &vision_.patch_embed_bias, replicated});
  }
  if (vision_.position_table.defined()) out.push_back({"visual.pos_embed.weight", &vision_.position_table, replicated});
  for (size_t i = 0; i < vision_.blocks.size(); ++i) {
    const std::string p = "visual.blocks." + std::to_string(i) + ".";
    qwen_vl::VisionBlock& b = vision_.blocks[i];
    add_layer_norm(p + "norm1", b.norm1);
    add_layer_norm(p + "norm2", b.norm2);
    add_linear(p + "attn.qkv", b.qkv, vision(ShardLayout::kStackedRows));
    add_linear(p + "attn.proj", b.proj, vision(ShardLayout::kColumns));
    add_linear(p + spec.mlp_in, b.fc1, vision(ShardLayout::kRows));
    if (b.up.weight.defined()) add_linear(p + spec.mlp_up, b.up, vision(ShardLayout::kRows));
    add_linear(p + spec.mlp_out, b.fc2, vision(ShardLayout::kColumns));
  }
  add_merger(v + spec.merger_norm, v + spec.merger_fc1, v + spec.merger_fc2, vision_.merger);
  for (size_t i = 0; i < vision_.deepstack.size(); ++i) {
    const std::string p = "visual.deepstack_merger_list." + std::to_string(i) + ".";
    add_merger(p + "norm", p + "linear_fc1", p + "linear_fc2", vision_.deepstack[i]);
  }

  out.push_back({"model.embed_tokens.weight", &lm_.embed_tokens, text(ShardLayout::kRows)});
  for (size_t i = 0; i < lm_.layers.size(); ++i) {
    const std::string p = "model.layers." + std::to_string(i);
    qwen_vl::DecoderLayer& l = lm_.layers[i];
    add_linear(p + ".self_attn.q_proj", l.q_proj, text(ShardLayout::kRows));
    add_linear(p + ".self_attn.k_proj", l.k_proj, text(ShardLayout::kRows));
    add_linear(p + ".self_attn.v_proj", l.v_proj, text(ShardLayout::kRows));
    add_linear(p + ".self_attn.o_proj", l.o_proj, text(ShardLayout::kColumns));
    if (l.q_norm.defined()) {
      out.push_back({p + ".self_attn.q_norm.weight", &l.q_norm, replicated});
      out.push_back({p + ".self_attn.k_norm.weight", &l.k_norm, replicated});
    }
    add_linear(p + ".mlp.gate_proj", l.gate_proj, text(ShardLayout::kRows));
    add_linear(p + ".mlp.up_proj", l.up_proj, text(ShardLayout::kRows));
    add_linear(p + ".mlp.down_proj", l.down_proj, text(ShardLayout::kColumns));
    out.push_back({p + ".input_layernorm.weight", &l.input_layernorm, replicated});
    out.push_back({p + ".post_attention_layernorm.weight", &l.post_attention_layernorm, replicated});
  }
  out.push_back({"model.norm.weight", &lm_.norm, replicated});
  if (!config_.tie_word_embeddings) out.push_back({"lm_head.weight", &lm_.lm_head, text(ShardLayout::kRows)});
  return out;
}

std::vector<std::pair<std::string, at::Tensor*>> QwenVl::named_weights() {
  std::vector<std::pair<std::string, at::Tensor*>> out;
  for (WeightSlot& slot : weight_slots()) out.emplace_back(std::move(slot.name), slot.tensor);
  return out;
}

std::vector<std::pair<std::string, const at::Tensor*>> QwenVl::named_weights() const {
  // The pointers are only handed out as const, so walking the tensors through the non-const
  // listing does not modify anything.
  auto mutable_list = const_cast<QwenVl*>(this)->named_weights();
  return {mutable_list.begin(), mutable_list.end()};
}

void QwenVl::to(at::Device device) {
  VLMGEN_CHECK(device.is_cpu() || !keeps_fp8(),
               "this model computes from FP8 bytes (LoadOptions::keep_fp8), which runs on the CPU only; cannot move it "
               "to {} (load it without keep_fp8 to dequantize)",
               device.str());
  for (auto& [name, tensor] : named_weights()) *tensor = tensor->to(device);
  if (config_.tie_word_embeddings) tie_lm_head();
}

at::Tensor QwenVl::encode_images(const VisionInputs& vision) {
  VLMGEN_CHECK(!vision.empty() && vision.num_images() > 0, "encode_images needs at least one image");
  return run_vision_tower(vision);
}

QwenVl::CheckedWindow QwenVl::check_window(const ForwardArgs& args) const {
  const at::Tensor& ids_in = args.input_ids;
  VLMGEN_CHECK(ids_in.defined() && ids_in.dim() == 2 && ids_in.size(1) >= 1,
               "input_ids must be [B, S] with S >= 1, got {}", detail::shape_str(ids_in));
  VLMGEN_CHECK(detail::is_integral(ids_in), "input_ids must be an integer tensor, got {}",
               c10::toString(ids_in.scalar_type()));
  const int64_t b = ids_in.size(0);
  const int64_t s = ids_in.size(1);
  VLMGEN_CHECK(b >= 1, "input_ids must have at least one row, got {}", detail::shape_str(ids_in));
  const int64_t start = args.window_start;
  VLMGEN_CHECK(start >= 0, "window_start must be >= 0, got {}", start);
  const at::Device dev = device();
  // The range is checked on the host: ids the generator passes are there already, and ids on
  // the device cost one read back (then the copy below is a no-op).
  const at::Tensor host_ids = ids_in.to(at::kCPU, at::kLong);
  const int64_t min_id = host_ids.min().item<int64_t>();
  const int64_t max_id = host_ids.max().item<int64_t>();
  VLMGEN_CHECK(min_id >= 0 && max_id < config_.vocab_size, "token ids must be in [0, {}), got ids in [{}, {}]",
               config_.vocab_size, min_id, max_id);
  at::Tensor ids = ids_in.device() == dev ? ids_in.to(at::kLong) : host_ids.to(dev, at::kLong, /*non_blocking=*/true);

  at::Tensor mask;
  if (args.attention_mask.defined()) {
    VLMGEN_CHECK(
        args.attention_mask.dim() == 2 && args.attention_mask.size(0) == b && args.attention_mask.size(1) == start + s,
        "attention_mask must be [{}, {}] (window_start {} + window {}), got {}", b, start + s, start, s,
        detail::shape_str(args.attention_mask));
    mask = args.attention_mask.to(dev, at::kLong);
  } else {
    mask = at::ones({b, start + s}, at::TensorOptions().dtype(at::kLong).device(dev));
  }

  VLMGEN_CHECK(args.position_ids.defined(), "position_ids are required ([B, S] or [3, B, S])");
  at::Tensor positions = args.position_ids.to(dev, at::kLong);
  VLMGEN_CHECK(positions.dim() != 2 || (positions.size(0) == b && positions.size(1) == s),
               "position_ids must be [{}, {}] or [3, {}, {}], got {}", b, s, b, s,
               detail::shape_str(args.position_ids));
  if (positions.dim() == 2) positions = positions.unsqueeze(0).expand({3, b, s});
  VLMGEN_CHECK(positions.dim() == 3 && positions.size(0) == 3 && positions.size(1) == b && positions.size(2) == s,
               "position_ids must be [{}, {}] or [3, {}, {}], got {}", b, s, b, s,
               detail::shape_str(args.position_ids));

  if (args.context != nullptr) {
    VLMGEN_CHECK(args.context->length() == start, "the KV cache holds {} columns but the window starts at column {}",
                 args.context->length(), start);
    VLMGEN_CHECK(args.context->batch_size() == b, "the KV cache has {} rows but the window has {}",
                 args.context->batch_size(), b);
  }
  CheckedWindow w;
  w.ids = ids;
  w.positions = positions;
  w.segment = LmSegment{b, s, start, args.context, mask, args.last_column_logits};
  return w;
}

at::Tensor QwenVl::embed(const at::Tensor& ids) const {
  // A fresh tensor; under TP each rank looks up the ids it holds and an all-reduce assembles
  // the rows.
  return tp_comm_ == nullptr ? at::embedding(lm_.embed_tokens, ids).to(at::kFloat)
                             : vocab_parallel_embedding(ids, lm_.embed_tokens,
                                                        parallel_.tp_rank() * lm_.embed_tokens.size(0), tp_comm_);
}

at::Tensor QwenVl::forward(const ForwardArgs& args) {
  const CheckedWindow window = check_window(args);
  const at::Tensor& ids = window.ids;
  const int64_t b = window.segment.rows, s = window.segment.cols;
  const at::Device dev = device();
  at::Tensor hidden = embed(ids);  // [B, S, hidden]

  const bool have_embeddings = args.image_embeddings.defined();
  at::Tensor deepstack;       // [placeholders, deepstack_count, hidden] (Qwen3-VL with images in the window)
  at::Tensor deepstack_rows;  // their flat [B * S] positions
  if (have_embeddings || !args.vision.empty()) {
    at::Tensor placeholder = ids.eq(config_.image_token_id).reshape({b * s});
    const int64_t placeholders = placeholder.sum().item<int64_t>();
    // Compare counts before running the tower: a mismatch costs nothing and leaves the counter.
    int64_t rows = 0;
    if (have_embeddings) {
      const int64_t width = config_.image_embedding_width();
      VLMGEN_CHECK(args.image_embeddings.dim() == 2 && args.image_embeddings.size(1) == width,
                   "image_embeddings must be [rows, {}] (hidden {} x (1 + {} DeepStack features)), got {}", width,
                   config_.hidden_size, config_.deepstack_count(), detail::shape_str(args.image_embeddings));
      rows = args.image_embeddings.size(0);
    } else {
      args.vision.validate(config_.vision.spatial_merge_size);
      for (int64_t c : placeholder_counts(args.vision)) rows += c;
    }
    VLMGEN_CHECK(placeholders == rows,
                 "the window has {} image placeholder tokens but the {} carry {} embedding rows ({} images); "
                 "placeholders and embeddings must match exactly",
                 placeholders, have_embeddings ? "image_embeddings" : "vision inputs", rows,
                 have_embeddings ? static_cast<int64_t>(args.images.size()) : args.vision.num_images());
    at::Tensor rows_to_place =
        have_embeddings ? args.image_embeddings.to(dev, at::kFloat) : run_vision_tower(args.vision);
    at::Tensor where = placeholder.nonzero().squeeze(1);
    const int64_t hs = config_.hidden_size;
    hidden.view({b * s, hs}).index_copy_(0, where, rows_to_place.narrow(1, 0, hs));
    if (config_.deepstack_count() > 0) {
      deepstack =
          rows_to_place.narrow(1, hs, hs * config_.deepstack_count()).reshape({-1, config_.deepstack_count(), hs});
      deepstack_rows = where;
    }
  }
  // Without vision, placeholder tokens embed as ordinary tokens: the legacy step-zero behaviour
  // that the replay tests reproduce on purpose.

  return run_language_model(hidden, window.positions, {window.segment}, deepstack, deepstack_rows).front();
}

std::vector<at::Tensor> QwenVl::forward_batch(const std::vector<const ForwardArgs*>& calls) {
  // Fused: decode windows over a KV cache, without images; under SP only one-token windows (a
  // longer window would be split across ranks, and the split is per call).
  const bool sequence_split = tp_comm_ != nullptr && parallel_.sequence_parallel();
  bool fuse = calls.size() > 1;
  for (const ForwardArgs* call : calls) {
    fuse = fuse && call->context != nullptr && call->vision.empty() && !call->image_embeddings.defined() &&
           call->images.empty() && call->input_ids.defined() && !(sequence_split && call->input_ids.size(-1) > 1);
  }
  if (!fuse) return CausalVlm::forward_batch(calls);
  // On the CPU kernels a pass takes at most as many tokens as the few-row linear does, so every
  // call's logits come from the same kernel as when it runs alone, and a request's tokens do
  // not depend on what it was batched with.
  const int64_t cap = device().is_cpu() && kernels::enabled()
                          ? kernels::max_fast_rows(keeps_fp8() ? at::kByte : weights_dtype())
                          : std::numeric_limits<int64_t>::max();
  std::vector<at::Tensor> out(calls.size());
  for (size_t first = 0; first < calls.size();) {
    size_t last = first + 1;
    int64_t tokens = calls[first]->input_ids.numel();
    while (last < calls.size() && tokens + calls[last]->input_ids.numel() <= cap)
      tokens += calls[last++]->input_ids.numel();
    if (last - first == 1) {
      out[first] = forward(*calls[first]);
    } else {
      std::vector<at::Tensor> ids, positions;
      std::vector<LmSegment> segments;
      for (size_t i = first; i < last; ++i) {
        CheckedWindow w = check_window(*calls[i]);
        ids.push_back(w.ids.reshape({-1}));
        positions.push_back(w.positions.reshape({3, 1, -1}));
        segments.push_back(std::move(w.segment));
      }
      // The calls' tokens in one [1, T] stream, the rows of each call one after another.
      const at::Tensor hidden = embed(at::cat(ids).unsqueeze(0));
      std::vector<at::Tensor> logits = run_language_model(hidden, at::cat(positions, 2), segments);
      for (size_t i = first; i < last; ++i) out[i] = std::move(logits[i - first]);
    }
    first = last;
  }
  return out;
}

namespace {

/// What both position planners need of their inputs.
void check_plan_inputs(const at::Tensor& input_ids, const at::Tensor& attention_mask) {
  VLMGEN_CHECK(input_ids.defined() && input_ids.dim() == 2, "input_ids must be [B, L], got {}",
               detail::shape_str(input_ids));
  VLMGEN_CHECK(attention_mask.defined() && attention_mask.sizes() == input_ids.sizes(),
               "attention_mask {} must match input_ids {}", detail::shape_str(attention_mask),
               detail::shape_str(input_ids));
}

}  // namespace

RopePlan QwenVl::plan_positions(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                const VisionInputs& vision) const {
  check_plan_inputs(input_ids, attention_mask);
  std::vector<ImageSpan> spans;
  if (!vision.empty()) {
    vision.validate(config_.vision.spatial_merge_size);
    // The real tokens of each row; spans in their indices.
    const int64_t b = input_ids.size(0);
    const int64_t l = input_ids.size(1);
    const std::vector<int64_t> ids = detail::to_int64_vector(input_ids);
    const std::vector<int64_t> mask = detail::to_int64_vector(attention_mask);
    std::vector<std::vector<int64_t>> rows(static_cast<size_t>(b));
    for (int64_t r = 0; r < b; ++r) {
      for (int64_t c = 0; c < l; ++c) {
        if (mask[r * l + c] != 0) rows[r].push_back(ids[r * l + c]);
      }
    }
    spans = find_image_spans(rows, config_.image_token_id, placeholder_counts(vision));
  }
  return place_images(input_ids, attention_mask, vision, spans, /*padded=*/false);
}

RopePlan QwenVl::plan_positions_with_spans(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                           const VisionInputs& vision, const std::vector<ImageSpan>& spans) const {
  check_plan_inputs(input_ids, attention_mask);
  if (!vision.empty()) vision.validate(config_.vision.spatial_merge_size);
  return place_images(input_ids, attention_mask, vision, spans, /*padded=*/true);
}

RopePlan QwenVl::place_images(const at::Tensor& input_ids, const at::Tensor& attention_mask, const VisionInputs& vision,
                              const std::vector<ImageSpan>& spans, bool padded) const {
  const int64_t b = input_ids.size(0);
  const int64_t l = input_ids.size(1);
  const std::vector<int64_t> ids = detail::to_int64_vector(input_ids);
  const std::vector<int64_t> mask = detail::to_int64_vector(attention_mask);
  std::vector<std::array<int64_t, 3>> grids;
  if (!vision.empty()) grids = vision.grids();
  VLMGEN_CHECK(grids.empty() ? spans.empty() : spans.size() == grids.size(),
               "the prompt has placeholder spans for {} images but the vision bundle has {}", spans.size(),
               grids.size());
  const int64_t m = config_.vision.spatial_merge_size;
  const bool shared_time = detail::family_spec(config_.family).image_frames_share_time;

  at::Tensor positions = at::ones({3, b, l}, at::kLong);  // padding columns keep 1, as HF does
  int64_t* pos = positions.data_ptr<int64_t>();
  auto set = [&](int64_t axis, int64_t row, int64_t col, int64_t value) { pos[(axis * b + row) * l + col] = value; };
  std::vector<int64_t> delta(static_cast<size_t>(b), 0);
  size_t next_span = 0;

  for (int64_t r = 0; r < b; ++r) {
    std::vector<int64_t> cols;                                 // real columns of row r
    std::vector<int64_t> real_of(static_cast<size_t>(l), -1);  // padded column -> real index
    for (int64_t c = 0; c < l; ++c) {
      if (mask[r * l + c] == 0) continue;
      real_of[c] = static_cast<int64_t>(cols.size());
      cols.push_back(c);
    }
    const int64_t n = static_cast<int64_t>(cols.size());
    int64_t next = 0;  // first position after everything placed so far (max + 1)
    int64_t i = 0;
    while (i < n) {
      int64_t span_start = -1;
      if (next_span < spans.size() && spans[next_span].row == r) {
        const int64_t begin = spans[next_span].begin;
        span_start = padded ? (begin >= 0 && begin < l ? real_of[begin] : -2) : begin;
        VLMGEN_CHECK(span_start >= i, "image span {} (row {}, column {}) is not at a real column after column {}",
                     next_span, r, begin, i == 0 ? -1 : cols[i - 1]);
      }
      if (span_start != i) {
        for (int64_t a = 0; a < 3; ++a) set(a, r, cols[i], next);
        ++next;
        ++i;
        continue;
      }
      const ImageSpan& span = spans[next_span];
      VLMGEN_CHECK(span.image >= 0 && span.image < static_cast<int64_t>(grids.size()),
                   "image span {} names image {} of a bundle of {}", next_span, span.image, grids.size());
      const auto [t, h, w] = grids[span.image];
      const int64_t gh = h / m;
      const int64_t gw = w / m;
      const int64_t count = t * gh * gw;
      int64_t run = 0;
      while (i + run < n && run < count && ids[r * l + cols[i + run]] == config_.image_token_id) ++run;
      VLMGEN_CHECK(run == count && span.size() == count,
                   "image {} (grid {}x{}x{}, merge {}) needs {} placeholder tokens at row {} column {}, found {} "
                   "(its span claims {})",
                   span.image, t, h, w, m, count, r, cols[i], run, span.size());
      const int64_t time_step = shared_time ? 0 : 1;
      int64_t k = i;
      for (int64_t ti = 0; ti < t; ++ti) {
        for (int64_t hi = 0; hi < gh; ++hi) {
          for (int64_t wi = 0; wi < gw; ++wi, ++k) {
            set(0, r, cols[k], next + ti * time_step);
            set(1, r, cols[k], next + hi);
            set(2, r, cols[k], next + wi);
          }
        }
      }
      next += std::max({shared_time ? 1 : t, gh, gw});
      i += count;
      ++next_span;
    }
    delta[r] = next - n;
  }
  VLMGEN_CHECK(next_span == spans.size(), "image span {} (row {}, column {}) lies outside the real tokens of its row",
               next_span, next_span < spans.size() ? spans[next_span].row : -1,
               next_span < spans.size() ? spans[next_span].begin : -1);
  return {positions, delta};
}

}  // namespace vlmgen
