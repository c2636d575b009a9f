#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/error.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/model.h"

namespace vlmgen::testing {

/// Options of FakeVlm; chaining setters would add nothing here, so it is a plain struct.
struct FakeVlmOptions {
  int64_t vocab_size = 64;
  std::optional<int64_t> image_token_id = 63;  ///< unset: a text-only model
  int64_t spatial_merge_size = 2;
  VisionLayout layout = VisionLayout::kPatchFlattened;
  int64_t tokens_per_image = 4;  ///< kPerImage only
  bool supports_kv_cache = true;
  bool kv_cache_under_sequence_parallel = false;
  bool can_encode_images = false;
  int64_t max_sequence_length = 0;
  /// Tokens that must frame every image's placeholders (unset: not checked).
  std::optional<int64_t> vision_start_token_id;
  std::optional<int64_t> vision_end_token_id;
};

/// A small deterministic VLM for tests and demos. Its logits are a hash of everything a real
/// VLM's logits depend on: every earlier token (through the attention mask), its position, and
/// at image placeholders the checksum of the pixels of the image embedded there. So a dropped
/// image changes the output, exactly as it would with a real model, while cache and no-cache
/// decoding agree bit for bit (the state is an integer sum). Like a strict real model it throws
/// vlmgen::Error when the embeddings it receives do not match the placeholders in its window;
/// when it receives no vision at all it embeds the placeholders as plain tokens, which is what
/// a real model silently does.
class FakeVlm : public CausalVlm {
 public:
  explicit FakeVlm(FakeVlmOptions options = {}) : options_(options) {
    traits_.vocab_size = options.vocab_size;
    traits_.image_token_id = options.image_token_id;
    traits_.spatial_merge_size = options.spatial_merge_size;
    traits_.vision_layout = options.layout;
    traits_.tokens_per_image = options.tokens_per_image;
    traits_.supports_kv_cache = options.supports_kv_cache;
    traits_.kv_cache_under_sequence_parallel = options.kv_cache_under_sequence_parallel;
    traits_.max_sequence_length = options.max_sequence_length;
    traits_.vision_start_token_id = options.vision_start_token_id;
    traits_.vision_end_token_id = options.vision_end_token_id;
    traits_.kv_cache = KvCacheSpec{1, 1, 1, at::kLong};
  }

  const ModelTraits& traits() const override { return traits_; }
  bool can_encode_images() const override { return options_.can_encode_images; }

  /// Vision-tower runs (encode_images calls and forward calls that embedded pixels).
  int64_t vision_tower_runs() const { return vision_tower_runs_; }
  int64_t forward_calls() const { return forward_calls_; }

  /// [placeholders, 1], float64: one checksum per placeholder token, images in order.
  at::Tensor encode_images(const VisionInputs& vision) override {
    VLMGEN_CHECK(options_.can_encode_images, "FakeVlm: encode_images is off in its options");
    return embed(vision);
  }

  at::Tensor forward(const ForwardArgs& args) override {
    ++forward_calls_;
    const at::Tensor ids = args.input_ids.to(at::kCPU, at::kLong).contiguous();
    VLMGEN_CHECK(ids.dim() == 2, "FakeVlm: input_ids must be [B, S], got {}", detail::shape_str(ids));
    const int64_t batch = ids.size(0), len = ids.size(1), start = args.window_start;
    at::Tensor pos = args.position_ids.to(at::kCPU, at::kLong);
    if (pos.dim() == 3) pos = pos[0];
    pos = pos.contiguous();
    const at::Tensor mask = args.attention_mask.to(at::kCPU, at::kLong).contiguous();
    VLMGEN_CHECK(pos.sizes() == ids.sizes(), "FakeVlm: position_ids {} do not match input_ids {}",
                 detail::shape_str(pos), detail::shape_str(ids));
    VLMGEN_CHECK(mask.dim() == 2 && mask.size(0) == batch && mask.size(1) == start + len,
                 "FakeVlm: attention_mask must be [{}, {}], got {}", batch, start + len, detail::shape_str(mask));
    if (args.context != nullptr) {
      VLMGEN_CHECK(args.context->length() == start, "FakeVlm: the context holds {} columns but the window starts at {}",
                   args.context->length(), start);
    } else {
      VLMGEN_CHECK(start == 0, "FakeVlm: without a context the window must start at 0, got {}", start);
    }

    // Image embeddings for the placeholders of this window, in row-major order.
    at::Tensor emb = args.image_embeddings.defined() ? args.image_embeddings.to(at::kCPU, at::kDouble)
                     : !args.vision.empty()          ? embed(args.vision)
                                                     : at::Tensor();
    const int64_t* id = ids.data_ptr<int64_t>();
    const int64_t* p = pos.data_ptr<int64_t>();
    const int64_t* m = mask.data_ptr<int64_t>();
    const int64_t image_token = options_.image_token_id.value_or(-1);
    int64_t placeholders = 0;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < len; ++i) {
        placeholders += m[b * (start + len) + start + i] != 0 && id[b * len + i] == image_token;
      }
    }
    if (emb.defined()) {
      VLMGEN_CHECK(emb.size(0) == placeholders,
                   "FakeVlm: the window holds {} image placeholder tokens but received {} image embeddings",
                   placeholders, emb.size(0));
    }
    const double* e = emb.defined() ? emb.contiguous().data_ptr<double>() : nullptr;

    // h = per-column contribution, state = running sum over real columns (wrapping uint64).
    at::Tensor h = at::zeros({batch, 1, len, 1}, at::kLong);
    int64_t* hp = h.data_ptr<int64_t>();
    int64_t next_embedding = 0;
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < len; ++i) {
        if (m[b * (start + len) + start + i] == 0) continue;
        const int64_t token = id[b * len + i];
        uint64_t value = static_cast<uint64_t>(token);
        if (token == image_token && e != nullptr) {
          value = (1ull << 40) + static_cast<uint64_t>(std::llround(e[next_embedding++]));
        }
        hp[b * len + i] = static_cast<int64_t>(mix(mix(value) ^ static_cast<uint64_t>(p[b * len + i])));
      }
    }
    std::vector<uint64_t> prefix(static_cast<size_t>(batch), 0);
    if (args.context != nullptr) {
      auto kv = args.context->append_kv(0, h, h);
      at::Tensor cached = kv.first.narrow(2, 0, start).contiguous();
      const int64_t* c = cached.data_ptr<int64_t>();
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t j = 0; j < start; ++j) prefix[b] += static_cast<uint64_t>(c[b * start + j]);
      }
    }
    at::Tensor logits = at::empty({batch, len, options_.vocab_size}, at::kFloat);
    float* lp = logits.data_ptr<float>();
    for (int64_t b = 0; b < batch; ++b) {
      uint64_t state = prefix[b];
      for (int64_t i = 0; i < len; ++i) {
        state += static_cast<uint64_t>(hp[b * len + i]);
        for (int64_t v = 0; v < options_.vocab_size; ++v) {
          lp[(b * len + i) * options_.vocab_size + v] =
              static_cast<float>(mix(state ^ mix(static_cast<uint64_t>(v) + 0x51ed27)) % 1000) / 100.0f;
        }
      }
    }
    // Like a real model, honour the request for the last column only: a caller that reads
    // every column must ask for them (GenerationConfig::full_logits).
    return args.last_column_logits ? logits.narrow(1, len - 1, 1) : logits;
  }

 private:
  static uint64_t mix(uint64_t x) {  // splitmix64 finalizer
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  }

  /// One checksum per placeholder: the pixels merged into that token, weighted by place.
  at::Tensor embed(const VisionInputs& vision) {
    ++vision_tower_runs_;
    vision.validate(options_.spatial_merge_size);
    std::vector<double> out;
    at::Tensor pv = vision.pixel_values.to(at::kCPU, at::kDouble).contiguous();
    if (vision.layout == VisionLayout::kPatchFlattened) {
      const int64_t group = options_.spatial_merge_size * options_.spatial_merge_size;
      VLMGEN_CHECK(group >= 1 && pv.size(0) % group == 0, "FakeVlm: {} patch rows do not merge in groups of {}",
                   pv.size(0), group);
      pv = pv.reshape({pv.size(0) / group, -1});
    } else {
      VLMGEN_CHECK(options_.tokens_per_image > 0 && pv[0].numel() % options_.tokens_per_image == 0,
                   "FakeVlm: {} values per image do not split into {} placeholder tokens", pv[0].numel(),
                   options_.tokens_per_image);
      pv = pv.reshape({pv.size(0) * options_.tokens_per_image, -1});
    }
    at::Tensor weights = at::arange(1, pv.size(1) + 1, at::kDouble);
    at::Tensor sums = (pv * weights).sum(1) * 1000.0;
    return sums.round().unsqueeze(1);
  }

  FakeVlmOptions options_;
  ModelTraits traits_;
  int64_t vision_tower_runs_ = 0;
  int64_t forward_calls_ = 0;
};

}  // namespace vlmgen::testing
