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

void QwenVl::set_kv_cache_dtype(at::ScalarType dtype) {
  check_kv_cache_dtype(dtype, device());
  traits_.kv_cache.dtype = dtype;
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
  check_kv_cache_dtype(traits_.kv_cache.dtype, device);  // the 16- and 8-bit caches are the CPU's
  VLMGEN_CHECK(device.is_cpu() || !keeps_fp8(),
               "this model computes from FP8 bytes (LoadOptions::keep_fp8), which runs on the CPU only; cannot move it "
               "to {} (load it without keep_fp8 to dequantize)",
               device.str());
  for (auto& [name, tensor] : named_weights()) *tensor = tensor->to(device);
  if (config_.tie_word_embeddings) tie_lm_head();
}

}  // namespace vlmgen
