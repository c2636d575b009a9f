// QwenVlConfig::validate and parameter_count. A config.json is untrusted input: every size is
// held to its documented bound (QwenVlConfigLimits) before any arithmetic on it, and every
// product is overflow-checked, so that a hostile file is refused by name instead of wrapping
// around into a small number or asking the allocator for petabytes.

#include <cmath>
#include <cstdint>

#include "qwen_family.h"
#include "vlmgen/detail/checked_math.h"
#include "vlmgen/error.h"
#include "vlmgen/models/qwen_vl_config.h"

namespace vlmgen {
namespace {

using Limits = QwenVlConfigLimits;

const detail::QwenFamilySpec& family_spec_of(const QwenVlConfig& c) { return detail::family_spec(c.family); }
using detail::checked_add;
using detail::checked_mul;

constexpr const char* kOverflow = "config: the number of weights";

// Weights of a linear layer [out, in] (+ bias [out]).
int64_t linear(int64_t out, int64_t in, bool bias) {
  const int64_t weight = checked_mul(out, in, kOverflow);
  return bias ? checked_add(weight, out, kOverflow) : weight;
}

// Mirrors QwenVl::allocate_weights (a test holds the two to the same number).
int64_t vision_parameters(const QwenVlConfig& c) {
  const QwenVisionConfig& v = c.vision;
  const detail::QwenFamilySpec& spec = detail::family_spec(c.family);
  const int64_t e = v.embed_dim;
  const int64_t mlp =
      spec.family == QwenFamily::kQwen2Vl ? checked_mul(e, v.mlp_ratio, kOverflow) : v.intermediate_size;
  const int64_t merged = checked_mul(e, checked_mul(v.spatial_merge_size, v.spatial_merge_size, kOverflow), kOverflow);
  int64_t patch = checked_mul(e, v.in_channels, kOverflow);
  patch = checked_mul(patch, v.temporal_patch_size, kOverflow);
  patch = checked_mul(patch, checked_mul(v.patch_size, v.patch_size, kOverflow), kOverflow);
  if (spec.patch_embed_bias) patch = checked_add(patch, e, kOverflow);
  if (spec.learned_position_table) {
    patch = checked_add(patch, checked_mul(v.num_position_embeddings, e, kOverflow), kOverflow);
  }

  const int64_t norm = spec.vision_rms_norm ? e : checked_mul(2, e, kOverflow);            // weight (+ bias)
  int64_t block = checked_mul(2, norm, kOverflow);                                         // norm1, norm2
  block = checked_add(block, linear(checked_mul(3, e, kOverflow), e, true), kOverflow);    // qkv
  block = checked_add(block, linear(e, e, true), kOverflow);                               // proj
  block = checked_add(block, linear(mlp, e, true), kOverflow);                             // fc1 / gate
  if (spec.vision_gated_mlp) block = checked_add(block, linear(mlp, e, true), kOverflow);  // up
  block = checked_add(block, linear(e, mlp, true), kOverflow);                             // fc2 / down

  // A merger: its norm (over e, or over merged after the shuffle for DeepStack), fc1, fc2.
  const int64_t merger_linears =
      checked_add(linear(merged, merged, true), linear(c.hidden_size, merged, true), kOverflow);
  int64_t total = checked_add(patch, checked_mul(block, v.depth, kOverflow), kOverflow);
  total = checked_add(total, checked_add(norm, merger_linears, kOverflow), kOverflow);
  const int64_t deepstack = checked_add(checked_mul(2, merged, kOverflow), merger_linears, kOverflow);
  const auto mergers = static_cast<int64_t>(v.deepstack_visual_indexes.size());
  return checked_add(total, checked_mul(deepstack, mergers, kOverflow), kOverflow);
}

int64_t language_parameters(const QwenVlConfig& c) {
  const int64_t h = c.hidden_size;
  const int64_t q_out = checked_mul(c.num_attention_heads, c.head_dim, kOverflow);
  const int64_t kv_out = checked_mul(c.num_key_value_heads, c.head_dim, kOverflow);
  int64_t layer = checked_mul(2, h, kOverflow);  // input and post-attention norms
  if (c.qk_norm) layer = checked_add(layer, checked_mul(2, c.head_dim, kOverflow), kOverflow);
  layer = checked_add(layer, linear(q_out, h, c.attention_bias), kOverflow);
  layer = checked_add(layer, checked_mul(2, linear(kv_out, h, c.attention_bias), kOverflow), kOverflow);    // k, v
  layer = checked_add(layer, linear(h, q_out, false), kOverflow);                                           // o
  layer = checked_add(layer, checked_mul(3, linear(c.intermediate_size, h, false), kOverflow), kOverflow);  // MLP
  const int64_t embed = checked_mul(c.vocab_size, h, kOverflow);
  int64_t total = checked_add(checked_mul(layer, c.num_hidden_layers, kOverflow), embed, kOverflow);
  total = checked_add(total, h, kOverflow);  // final norm
  return c.tie_word_embeddings ? total : checked_add(total, embed, kOverflow);
}

int64_t count_parameters(const QwenVlConfig& c) {
  return checked_add(language_parameters(c), vision_parameters(c), kOverflow);
}

struct SizeField {
  const char* name;
  int64_t value;
  int64_t max;
};

void check_size_bounds(const QwenVlConfig& c) {
  const QwenVisionConfig& v = c.vision;
  const SizeField sizes[] = {
      {"hidden_size", c.hidden_size, Limits::kMaxHiddenSize},
      {"num_hidden_layers", c.num_hidden_layers, Limits::kMaxLayers},
      {"num_attention_heads", c.num_attention_heads, Limits::kMaxHeads},
      {"num_key_value_heads", c.num_key_value_heads, Limits::kMaxHeads},
      {"head_dim", c.head_dim, Limits::kMaxHeadDim},
      {"intermediate_size", c.intermediate_size, Limits::kMaxIntermediateSize},
      {"vocab_size", c.vocab_size, Limits::kMaxVocabSize},
      {"max_position_embeddings", c.max_position_embeddings, Limits::kMaxPositionEmbeddings},
      {"vision_config.depth", v.depth, Limits::kMaxLayers},
      {family_spec_of(c).vision_width_field, v.embed_dim, Limits::kMaxHiddenSize},
      {"vision_config.num_heads", v.num_heads, Limits::kMaxHeads},
      {"vision_config.mlp_ratio", v.mlp_ratio, Limits::kMaxMlpRatio},
      {"vision_config.in_channels", v.in_channels, Limits::kMaxInChannels},
      {"vision_config.patch_size", v.patch_size, Limits::kMaxPatchSize},
      {"vision_config.temporal_patch_size", v.temporal_patch_size, Limits::kMaxTemporalPatchSize},
      {"vision_config.spatial_merge_size", v.spatial_merge_size, Limits::kMaxSpatialMergeSize},
      {family_spec_of(c).vision_out_field, v.hidden_size, Limits::kMaxHiddenSize},
  };
  const detail::QwenFamilySpec& spec = detail::family_spec(c.family);
  if (spec.family != QwenFamily::kQwen2Vl) {
    VLMGEN_CHECK(v.intermediate_size >= 1 && v.intermediate_size <= Limits::kMaxIntermediateSize,
                 "config vision_config.intermediate_size is {}, expected 1 to {} (QwenVlConfigLimits)",
                 v.intermediate_size, Limits::kMaxIntermediateSize);
  }
  if (spec.window_attention) {
    const int64_t max_window = Limits::kMaxPatchSize * Limits::kMaxSpatialMergeSize;
    VLMGEN_CHECK(v.window_size >= 1 && v.window_size <= max_window,
                 "config vision_config.window_size is {}, expected 1 to {} (QwenVlConfigLimits)", v.window_size,
                 max_window);
  }
  if (spec.learned_position_table) {
    VLMGEN_CHECK(v.num_position_embeddings >= 1 && v.num_position_embeddings <= Limits::kMaxPositionTable,
                 "config vision_config.num_position_embeddings is {}, expected 1 to {} (QwenVlConfigLimits)",
                 v.num_position_embeddings, Limits::kMaxPositionTable);
  }
  for (const SizeField& f : sizes) {
    VLMGEN_CHECK(f.value >= 1 && f.value <= f.max, "config {} is {}, expected 1 to {} (QwenVlConfigLimits)", f.name,
                 f.value, f.max);
  }
}

/// `indexes` strictly increasing, each in [0, bound).
void check_index_list(const char* field, const std::vector<int64_t>& indexes, int64_t bound, const char* bound_name) {
  for (size_t i = 0; i < indexes.size(); ++i) {
    VLMGEN_CHECK(indexes[i] >= 0 && indexes[i] < bound, "config {} {} has entry {}, expected 0 to {} - 1 = {} ({})",
                 field, indexes, indexes[i], bound_name, bound - 1, bound_name);
    VLMGEN_CHECK(i == 0 || indexes[i] > indexes[i - 1], "config {} {} must be strictly increasing", field, indexes);
  }
}

/// The fields only some families read, against the sizes they index or divide.
void check_family_fields(const QwenVlConfig& c) {
  const QwenVisionConfig& v = c.vision;
  const detail::QwenFamilySpec& spec = detail::family_spec(c.family);
  if (spec.window_attention) {
    const int64_t unit = v.patch_size * v.spatial_merge_size;  // bounded: pixels of one merged token
    VLMGEN_CHECK(v.window_size % unit == 0,
                 "config vision_config.window_size {} must be a multiple of patch_size {} x spatial_merge_size {} = {}",
                 v.window_size, v.patch_size, v.spatial_merge_size, unit);
    check_index_list("vision_config.fullatt_block_indexes", v.fullatt_block_indexes, v.depth, "depth");
  }
  if (spec.learned_position_table) {
    int64_t side = 1;
    while (side * side < v.num_position_embeddings) ++side;
    VLMGEN_CHECK(side * side == v.num_position_embeddings,
                 "config vision_config.num_position_embeddings {} must be a square (a side x side table)",
                 v.num_position_embeddings);
  }
  if (spec.deepstack) {
    check_index_list("vision_config.deepstack_visual_indexes", v.deepstack_visual_indexes, v.depth, "depth");
    VLMGEN_CHECK(static_cast<int64_t>(v.deepstack_visual_indexes.size()) <= c.num_hidden_layers,
                 "config vision_config.deepstack_visual_indexes has {} entries but the LM has {} layers to add them to",
                 v.deepstack_visual_indexes.size(), c.num_hidden_layers);
  } else {
    VLMGEN_CHECK(v.deepstack_visual_indexes.empty(), "config deepstack_visual_indexes is set but {} has no DeepStack",
                 spec.display_name);
  }
  if (c.mrope_interleaved) {
    // Frequency j < head_dim / 2 belongs to h when j % 3 == 1 and j < 3 * section[1], to w when
    // j % 3 == 2 and j < 3 * section[2], to t otherwise: each axis must get its section's count.
    const int64_t half = c.head_dim / 2;
    int64_t counts[3] = {0, 0, 0};
    for (int64_t j = 0; j < half; ++j) {
      if (j % 3 == 1 && j < 3 * c.mrope_section[1]) {
        ++counts[1];
      } else if (j % 3 == 2 && j < 3 * c.mrope_section[2]) {
        ++counts[2];
      } else {
        ++counts[0];
      }
    }
    VLMGEN_CHECK(counts[0] == c.mrope_section[0] && counts[1] == c.mrope_section[1] && counts[2] == c.mrope_section[2],
                 "config mrope_section {} cannot be interleaved over head_dim / 2 = {} frequencies: t, h, w would get "
                 "{}, {}, {}",
                 c.mrope_section, half, counts[0], counts[1], counts[2]);
  }
}

}  // namespace

void QwenVlConfig::validate() const {
  check_size_bounds(*this);  // first: everything below may multiply and add these
  VLMGEN_CHECK(rms_norm_eps > 0 && std::isfinite(rms_norm_eps), "config rms_norm_eps must be positive, got {}",
               rms_norm_eps);
  VLMGEN_CHECK(rope_theta > 0 && std::isfinite(rope_theta), "config rope_theta must be positive, got {}", rope_theta);
  VLMGEN_CHECK(num_attention_heads % num_key_value_heads == 0,
               "config num_attention_heads {} is not a multiple of num_key_value_heads {}", num_attention_heads,
               num_key_value_heads);
  VLMGEN_CHECK(head_dim % 2 == 0, "config head_dim must be even for rotary embeddings, got {}", head_dim);
  // M-RoPE splits the rotary half of head_dim into temporal, height and width sections.
  VLMGEN_CHECK(mrope_section.size() == 3, "config mrope_section must have 3 entries (temporal, height, width), got {}",
               mrope_section.size());
  int64_t section_sum = 0;
  for (int64_t s : mrope_section) {
    // Bounded before summing, so that three entries near 2^62 cannot wrap into head_dim / 2.
    VLMGEN_CHECK(s > 0 && s <= head_dim / 2, "config mrope_section entries must be in [1, head_dim / 2 = {}], got {}",
                 head_dim / 2, mrope_section);
    section_sum += s;
  }
  VLMGEN_CHECK(section_sum == head_dim / 2, "config mrope_section {} sums to {}, expected head_dim / 2 = {}",
               mrope_section, section_sum, head_dim / 2);
  const detail::QwenFamilySpec& spec = detail::family_spec(family);
  VLMGEN_CHECK(vision.embed_dim % vision.num_heads == 0, "config {} {} is not divisible by vision_config.num_heads {}",
               spec.vision_width_field, vision.embed_dim, vision.num_heads);
  VLMGEN_CHECK(vision.hidden_size == hidden_size, "config {} {} (the merger's output) must equal the LM hidden_size {}",
               spec.vision_out_field, vision.hidden_size, hidden_size);
  check_family_fields(*this);
  const std::pair<const char*, int64_t> token_ids[] = {
      {"image_token_id", image_token_id},
      {"video_token_id", video_token_id},
      {"vision_start_token_id", vision_start_token_id},
      {"vision_end_token_id", vision_end_token_id},
  };
  for (const auto& [name, id] : token_ids) {
    VLMGEN_CHECK(id >= 0 && id < vocab_size, "config {} {} is outside the vocabulary [0, {})", name, id, vocab_size);
  }
  const int64_t parameters = count_parameters(*this);
  VLMGEN_CHECK(parameters <= Limits::kMaxParameters,
               "config describes {} weights, above the limit of {} (QwenVlConfigLimits::kMaxParameters)", parameters,
               Limits::kMaxParameters);
}

int64_t QwenVlConfig::parameter_count() const {
  validate();
  return count_parameters(*this);
}

}  // namespace vlmgen
