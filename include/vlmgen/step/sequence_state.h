#pragma once

// The rows of one request as the loop fills them: token ids and attention mask of every column
// (the left-padded prompt, then the generated tokens), kept on the host (the mask also on the
// model's device, changed there only when a row finishes); which rows still generate; and what happens when a row
// takes a token (its output, finish reason, the streaming callback, masking the filler after a
// finished row).

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vlmgen/request.h"
#include "vlmgen/step/request_validation.h"
#include "vlmgen/step/stop_rules.h"

namespace vlmgen::detail {

class SequenceState {
 public:
  SequenceState(const GenerateRequest& request, const GenerationConfig& config, const RequestLayout& layout,
                at::Device device)
      : config_(config),
        batch_(layout.batch),
        total_(layout.total),
        prompt_len_(layout.prompt_len),
        active_(static_cast<size_t>(layout.batch), true),
        on_host_(device.is_cpu()) {
    tokens_ = at::full({batch_, total_}, config.pad_token_id(), at::kLong);  // [B, total], host
    mask_ = at::zeros({batch_, total_}, at::kLong);                          // [B, total], host
    for (int64_t b = 0; b < batch_; ++b) {
      const auto& p = request.prompts[static_cast<size_t>(b)];
      const int64_t pad = layout.pads[static_cast<size_t>(b)];
      tokens_[b].narrow(0, pad, static_cast<int64_t>(p.size())).copy_(at::tensor(p, at::kLong));
      mask_[b].narrow(0, pad, static_cast<int64_t>(p.size())).fill_(1);
    }
    if (layout.max_new > 0) mask_.narrow(1, layout.prompt_len, layout.max_new).fill_(1);
    mask_dev_ = on_host_ ? mask_ : mask_.to(device);  // [B, total], aliases on CPU
  }

  /// Host masters, [batch, total] int64.
  const at::Tensor& tokens() const { return tokens_; }
  const at::Tensor& mask() const { return mask_; }
  /// The mask on the model's device. Token ids stay on the host only: the model checks them
  /// there and copies each window over itself (ForwardArgs::input_ids).
  const at::Tensor& device_mask() const { return mask_dev_; }

  const std::vector<bool>& active() const { return active_; }
  bool any_active() const { return std::find(active_.begin(), active_.end(), true) != active_.end(); }

  /// Ends every row still generating with kCancelled.
  void cancel_all(std::vector<SequenceOutput>& out) {
    for (int64_t b = 0; b < batch_; ++b) {
      if (active_[static_cast<size_t>(b)]) {
        active_[static_cast<size_t>(b)] = false;
        out[static_cast<size_t>(b)].finish_reason = FinishReason::kCancelled;
      }
    }
  }

  /// Ends row `b` with kCancelled if it still generates, as its streaming callback returning
  /// false for its last token would have.
  void cancel_row(int64_t b, std::vector<SequenceOutput>& out) {
    if (b < 0 || b >= batch_ || !active_[static_cast<size_t>(b)]) return;
    out[static_cast<size_t>(b)].finish_reason = FinishReason::kCancelled;
    finish_row(b, last_column_ >= 0 ? last_column_ : prompt_len_ - 1);
  }

  /// The active rows take `chosen[b]` at column `column` (step `step`); returns how many did.
  int64_t accept(int64_t step, int64_t column, const std::vector<int64_t>& chosen, const std::vector<float>& logprobs,
                 const TokenCallback& on_token, std::vector<SequenceOutput>& out) {
    int64_t taken = 0;
    last_column_ = column;
    for (int64_t b = 0; b < batch_; ++b) {
      if (!active_[static_cast<size_t>(b)]) continue;
      const int64_t token = chosen[static_cast<size_t>(b)];
      SequenceOutput& seq = out[static_cast<size_t>(b)];
      tokens_[b][column] = token;
      seq.tokens.push_back(token);
      const float logprob = config_.return_logprobs() ? logprobs[static_cast<size_t>(b)] : 0.0f;
      if (config_.return_logprobs()) seq.logprobs.push_back(logprob);
      ++taken;
      seq.finish_reason = finish_reason_after(token, static_cast<int64_t>(seq.tokens.size()), config_);
      if (on_token) {
        TokenEvent event{b, step, token, logprob, seq.finish_reason, {}};
        // The scores of this step were recorded before the tokens were accepted.
        if (seq.top_logprobs.size() == seq.tokens.size()) event.top_logprobs = seq.top_logprobs.back();
        if (!on_token(event) && seq.finish_reason == FinishReason::kNotFinished) {
          seq.finish_reason = FinishReason::kCancelled;
        }
      }
      if (seq.finish_reason != FinishReason::kNotFinished) finish_row(b, column);
    }
    return taken;
  }

 private:
  // The filler fed after a row's last token is padding: mask it.
  void finish_row(int64_t b, int64_t column) {
    active_[static_cast<size_t>(b)] = false;
    if (column + 1 >= total_) return;
    mask_[b].narrow(0, column + 1, total_ - column - 1).zero_();
    if (!on_host_) mask_dev_[b].narrow(0, column + 1, total_ - column - 1).zero_();
  }

  const GenerationConfig& config_;
  int64_t batch_, total_, prompt_len_;
  int64_t last_column_ = -1;  // of the last tokens taken
  std::vector<bool> active_;
  bool on_host_;
  at::Tensor tokens_, mask_, mask_dev_;
};

}  // namespace vlmgen::detail
