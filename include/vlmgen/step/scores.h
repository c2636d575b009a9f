#pragma once

// The numbers research harnesses read besides tokens: prompt log-probabilities, the top-k
// log-probabilities of every generated step, and the raw logits of the generated steps. All come
// from the model's own logits (before temperature, filtering and suppression), over the whole
// vocabulary: vocab-parallel logits are gathered from the tensor-parallel group first.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "vlmgen/distributed/communicator.h"
#include "vlmgen/error.h"

namespace vlmgen {

/// What a row returns besides its tokens when asked (GenerationConfig::prompt_logprobs,
/// top_logprobs, return_logits).
struct RowScores {
  /// One per prompt token: log P(token i | tokens before it). NaN where the call did not compute
  /// the predicting column: token 0, and tokens whose predictor was already in a caller's
  /// context.
  std::vector<float> prompt_logprobs;
  /// Per generated token, the k most likely (id, log-probability) pairs, most likely first.
  std::vector<std::vector<std::pair<int64_t, float>>> top_logprobs;
  /// [generated tokens, vocab_size], float32, CPU: the logits each token was chosen from.
  at::Tensor logits;
};

namespace detail {

/// Records the scores of one generate call as its windows and steps come, into rows that
/// derive from RowScores.
class ScoreRecorder {
 public:
  /// `group` is the tensor-parallel group holding the other vocabulary blocks when logits are
  /// vocab-parallel (null otherwise).
  ScoreRecorder(bool prompt_logprobs, int64_t top_k, bool logits, int64_t vocab_size, Communicator* group)
      : prompt_(prompt_logprobs), top_k_(top_k), logits_(logits), vocab_size_(vocab_size), group_(group) {}

  /// Whether prefill windows must return every column's logits.
  bool wants_prompt_columns() const { return prompt_; }
  bool wants_steps() const { return top_k_ > 0 || logits_; }

  /// `window_logits` [B, S, V'] of columns [start, end) of the left-padded `tokens`/`mask`
  /// ([B, >= prompt_len]); column c predicts column c + 1. Writes prompt log-probabilities of
  /// the prompt tokens whose predictor is in the window.
  template <typename Row>
  void record_prompt(const at::Tensor& window_logits, int64_t start, int64_t end, int64_t prompt_len,
                     const at::Tensor& tokens, const at::Tensor& mask, const std::vector<int64_t>& pads,
                     std::vector<Row>& rows) {
    if (!prompt_) return;
    VLMGEN_CHECK(window_logits.size(1) == end - start,
                 "prompt log-probabilities need the logits of every column of the window [{}, {}), got {} columns",
                 start, end, window_logits.size(1));
    const int64_t last = std::min(end, prompt_len - 1);  // predictors of prompt tokens only
    if (last <= start) return;
    const int64_t batch = window_logits.size(0);
    at::Tensor lp = at::log_softmax(full_vocab(window_logits.narrow(1, 0, last - start)).to(at::kFloat), -1);
    at::Tensor targets = tokens.narrow(1, start + 1, last - start).to(lp.device());  // [B, n]
    at::Tensor picked = lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).to(at::kCPU).contiguous();
    at::Tensor real = mask.narrow(1, start, last - start + 1).to(at::kCPU, at::kLong).contiguous();
    auto p = picked.accessor<float, 2>();
    auto m = real.accessor<int64_t, 2>();
    for (int64_t b = 0; b < batch; ++b) {
      auto& out = rows[static_cast<size_t>(b)].prompt_logprobs;
      if (out.empty()) out.assign(static_cast<size_t>(prompt_len - pads[b]), std::numeric_limits<float>::quiet_NaN());
      for (int64_t i = 0; i < last - start; ++i) {
        if (m[b][i] == 0 || m[b][i + 1] == 0) continue;  // padding predicts nothing
        out[static_cast<size_t>(start + 1 + i - pads[b])] = p[b][i];
      }
    }
  }

  /// `last` [B, V'] the logits the step's tokens were chosen from; rows with active false are
  /// skipped.
  template <typename Row>
  void record_step(const at::Tensor& last, const std::vector<bool>& active, std::vector<Row>& rows) {
    if (!wants_steps()) return;
    at::Tensor full = full_vocab(last).to(at::kCPU, at::kFloat);
    at::Tensor values, ids;
    if (top_k_ > 0) {
      std::tie(values, ids) = at::log_softmax(full, -1).topk(std::min(top_k_, vocab_size_), -1);
    }
    for (size_t b = 0; b < active.size(); ++b) {
      if (!active[b]) continue;
      Row& row = rows[b];
      if (top_k_ > 0) {
        std::vector<std::pair<int64_t, float>> top;
        for (int64_t j = 0; j < values.size(1); ++j) {
          top.emplace_back(ids[b][j].item<int64_t>(), values[b][j].item<float>());
        }
        row.top_logprobs.push_back(std::move(top));
      }
      if (logits_) steps_[b].push_back(full[b].clone());
    }
  }

  /// Moves the recorded step logits into the rows (call once, at the end).
  template <typename Row>
  void finish(std::vector<Row>& rows) {
    if (!logits_) return;
    for (auto& [b, list] : steps_) {
      rows[b].logits = list.empty() ? at::empty({0, vocab_size_}) : at::stack(list);
    }
  }

 private:
  at::Tensor full_vocab(const at::Tensor& logits) const {
    at::Tensor full = group_ != nullptr && group_->size() > 1 ? group_->all_gather(logits.contiguous(), -1) : logits;
    return full.narrow(-1, 0, vocab_size_);
  }

  bool prompt_;
  int64_t top_k_;
  bool logits_;
  int64_t vocab_size_;
  Communicator* group_;
  std::map<size_t, std::vector<at::Tensor>> steps_;
};

}  // namespace detail
}  // namespace vlmgen
