#pragma once

// One forward call of a request over the columns [start, end) of its rows: the window's tokens,
// mask and positions, the images the replay policy gives it (through the request's encoder
// cache), the logits check, committing the window (and its images) into the KV cache, and the
// prompt scores. Prefill is a run of such windows in chunks that never split an image.

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "vlmgen/content_hash.h"
#include "vlmgen/image_spans.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/model.h"
#include "vlmgen/parallel.h"
#include "vlmgen/replay_policy.h"
#include "vlmgen/request.h"
#include "vlmgen/step/logits_check.h"
#include "vlmgen/step/request_validation.h"
#include "vlmgen/step/scores.h"
#include "vlmgen/step/sequence_state.h"
#include "vlmgen/step/window_vision.h"

namespace vlmgen::detail {

class WindowRunner {
 public:
  /// Everything here must outlive the runner. `context` is null without a KV cache;
  /// `fingerprints` (per image) are recorded into it when non-empty.
  WindowRunner(CausalVlm& model, const ParallelContext& parallel, const GenerationConfig& config,
               const RequestLayout& layout, SequenceState& rows, const at::Tensor& positions, WindowVision& vision,
               InferenceContext* context, const std::vector<ContentHash>& fingerprints, ScoreRecorder& scores,
               GenerationResult& result)
      : model_(model),
        traits_(model.traits()),
        parallel_(parallel),
        config_(config),
        layout_(layout),
        rows_(rows),
        positions_(positions),
        vision_(vision),
        context_(context),
        fingerprints_(fingerprints),
        scores_(scores),
        result_(result),
        policy_(config.replay_mode(), model.traits().accepts_partial_image_span),
        vocab_parallel_(model.traits().vocab_parallel_logits && parallel.tp_size() > 1) {}

  /// Whether logits are a block of the vocabulary per rank (chosen across the group).
  bool vocab_parallel() const { return vocab_parallel_; }

  /// One forward call over [start, end); returns the last column's logits [batch, vocab] (a
  /// rank's block when vocab-parallel).
  at::Tensor run(int64_t start, int64_t end, int64_t step) {
    const ForwardArgs args = args_for(start, end, step);
    return accept(args, model_.forward(args));
  }

  /// The arguments of the forward call over [start, end): tokens, mask, positions, KV cache and
  /// the images the replay policy gives the window.
  ForwardArgs args_for(int64_t start, int64_t end, int64_t step) {
    ForwardArgs args;
    args.input_ids = rows_.tokens().narrow(1, start, end - start);  // host: see ForwardArgs
    args.position_ids = positions_.narrow(-1, start, end - start);
    args.attention_mask = rows_.device_mask().narrow(1, 0, end);
    args.context = context_;
    args.window_start = start;
    args.step = step;
    args.last_column_logits = !config_.full_logits() && !(step == 0 && scores_.wants_prompt_columns());
    vision_.fill(policy_.images_for_window({start, end}, layout_.spans, step), args);
    return args;
  }

  /// The logits of the call made with `args` (by forward, or forward_batch with other
  /// requests' calls): checked, the window committed into the KV cache, prompt scores recorded;
  /// returns the last column's logits as run does.
  at::Tensor accept(const ForwardArgs& args, const at::Tensor& logits) {
    const int64_t start = args.window_start, end = start + args.input_ids.size(1);
    // Every column of the window, or only the last when that is all the generator asked for.
    check_window_logits(logits, layout_.batch, end - start, args.last_column_logits, traits_, vocab_parallel_,
                        parallel_.tp_size());
    if (context_ != nullptr) commit(start, end);
    ++result_.stats.forward_calls;
    if (args.step == 0) {
      scores_.record_prompt(logits, start, end, layout_.prompt_len, rows_.tokens(), rows_.mask(), layout_.pads,
                            result_.sequences);
    }
    at::Tensor last_column = logits.select(1, logits.size(1) - 1);
    return vocab_parallel_ ? last_column : last_column.narrow(-1, 0, traits_.vocab_size);
  }

  /// The prompt's columns [context length, end) into the context, in chunks of at most
  /// prefill_chunk_size that never split an image; the last column's logits, or an undefined
  /// tensor when `cancel` was set between chunks. With `max_columns` > 0, stops after that many
  /// columns (or, when an image at the first column is longer, at the image's end) and returns
  /// an undefined tensor when the prompt is not complete: the next call goes on.
  at::Tensor prefill(int64_t end, const std::atomic<bool>* cancel, int64_t max_columns = 0) {
    const int64_t first = context_->length();
    const int64_t chunk = config_.prefill_chunk_size() > 0 ? config_.prefill_chunk_size() : end - first;
    // Sums that could pass INT64_MAX (a chunk size near it) are compared as differences.
    const int64_t stop = max_columns > 0 && max_columns < end - first ? first + max_columns : end;
    at::Tensor last;
    int64_t start = first;
    while (start < stop && !(start > first && cancel != nullptr && cancel->load())) {
      const int64_t chunk_end = policy_.chunk_end(start, stop - start <= chunk ? stop : start + chunk, layout_.spans);
      last = run(start, chunk_end, 0);
      start = chunk_end;
    }
    return start < end ? at::Tensor() : last;
  }

 private:
  void commit(int64_t start, int64_t end) {
    context_->commit(rows_.tokens().narrow(1, start, end - start), rows_.mask().narrow(1, start, end - start));
    if (fingerprints_.empty()) return;
    for (const ImageSpan& s : layout_.spans) {
      if (s.end > start && s.end <= end) {
        context_->record_image({s.row, s.begin, s.end, fingerprints_[static_cast<size_t>(s.image)]});
      }
    }
  }

  CausalVlm& model_;
  const ModelTraits& traits_;
  const ParallelContext& parallel_;
  const GenerationConfig& config_;
  const RequestLayout& layout_;
  SequenceState& rows_;
  const at::Tensor& positions_;  // [B, total] or [3, B, total], on the model's device
  WindowVision& vision_;
  InferenceContext* context_;
  const std::vector<ContentHash>& fingerprints_;
  ScoreRecorder& scores_;
  GenerationResult& result_;
  const ReplayPolicy policy_;
  const bool vocab_parallel_;
};

}  // namespace vlmgen::detail
