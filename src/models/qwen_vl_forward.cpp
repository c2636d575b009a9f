// QwenVl's forward calls: the window checks, embeddings, one call or a batch of segments, and the
// M-RoPE position plans (construction and weights are in qwen_vl.cpp).

#include <algorithm>
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
#include "vlmgen/models/qwen_vl.h"

namespace vlmgen {
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

  // Moved: the embeddings are the stream's first value, not kept beside it for the whole stack.
  return run_language_model(std::move(hidden), window.positions, {window.segment}, deepstack, deepstack_rows).front();
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
  // On the CPU kernels a pass takes at most as many tokens as every linear of the model takes
  // with the roundings of one row (FP8: below the rows that widen the weights; an FP8 model's
  // unquantized layers keep their own dtype's limit), so every call's logits come from the same
  // arithmetic as when it runs alone, and a request's tokens do not depend on what it was
  // batched with.
  int64_t cap = std::numeric_limits<int64_t>::max();
  if (device().is_cpu() && kernels::enabled()) {
    cap = kernels::max_row_invariant_rows(weights_dtype());
    if (keeps_fp8()) cap = std::min(cap, kernels::max_row_invariant_rows(at::kByte));
  }
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
