#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/model.h"

namespace vlmgen::testing {

/// How a recorded forward call ended.
enum class CallOutcome {
  kRunning,   ///< still inside the wrapped forward (seen from an observer of a nested call)
  kReturned,  ///< the wrapped forward returned logits
  kThrew,     ///< the wrapped forward threw; `error` holds the message
};

/// What one forward call received, as ForwardSpy records it.
struct ForwardCall {
  int64_t index = 0;         ///< 0, 1, 2, ... over the spy's lifetime (until clear())
  int64_t batch_group = -1;  ///< calls made by one forward_batch share this id (0, 1, ...); -1 for forward
  int64_t step = 0;          ///< ForwardArgs::step
  int64_t window_start = 0;  ///< first column computed
  int64_t window_end = 0;    ///< one past the last column computed
  int64_t batch = 0;
  bool had_context = false;    ///< a KV cache was passed
  int64_t context_length = 0;  ///< columns already in that cache
  /// Shapes of the vision tensors received; nullopt when the tensor was not sent.
  std::optional<std::vector<int64_t>> pixel_values_shape;
  std::optional<std::vector<int64_t>> image_grid_thw_shape;
  std::optional<std::vector<int64_t>> image_sizes_shape;
  std::optional<std::vector<int64_t>> image_embeddings_shape;
  std::vector<int64_t> images;  ///< indices of the images sent (into the request's bundle)
  CallOutcome outcome = CallOutcome::kRunning;
  std::string error;  ///< what() of the exception, when outcome is kThrew
  /// Copies of what was sent (kept only when ForwardSpy::record_tensors is on).
  at::Tensor input_ids;       // [B, S], int64, CPU
  at::Tensor image_grid_thw;  // [n, 3], int64, CPU
  at::Tensor logits;          // [B, S, V], CPU

  bool has_pixel_values() const { return pixel_values_shape.has_value(); }
  bool has_all_vision() const {
    return pixel_values_shape.has_value() && image_grid_thw_shape.has_value() && image_sizes_shape.has_value();
  }
  bool has_any_vision() const {
    return pixel_values_shape.has_value() || image_grid_thw_shape.has_value() || image_sizes_shape.has_value() ||
           image_embeddings_shape.has_value();
  }
  int64_t window_size() const { return window_end - window_start; }
};

inline std::string format_shape(const std::optional<std::vector<int64_t>>& s) {
  return s ? fmt::format("[{}]", fmt::join(*s, ",")) : std::string("-");
}

/// GoogleTest prints calls with this, so a failed EXPECT_THAT shows what the model got.
inline void PrintTo(const ForwardCall& c, std::ostream* os) {
  *os << fmt::format("call {} step {} window [{}, {}) {} pixel_values {} grid {} sizes {} embeddings {} images [{}]{}",
                     c.index, c.step, c.window_start, c.window_end, c.had_context ? "kv" : "no-kv",
                     format_shape(c.pixel_values_shape), format_shape(c.image_grid_thw_shape),
                     format_shape(c.image_sizes_shape), format_shape(c.image_embeddings_shape),
                     fmt::join(c.images, ","), c.outcome == CallOutcome::kThrew ? " threw: " + c.error : "");
}

/// A CausalVlm that hands every call to another model: derive from it and override what you
/// want to watch (ForwardSpy records the forward calls; a benchmark can time them). forward_batch
/// goes to the wrapped model's forward_batch, not to this forward: override both to see every
/// forward call (an engine's decode steps come through forward_batch).
class ForwardingVlm : public CausalVlm {
 public:
  explicit ForwardingVlm(CausalVlm& inner) : inner_(inner) {}

  const ModelTraits& traits() const override { return inner_.traits(); }
  at::Device device() const override { return inner_.device(); }
  std::vector<int64_t> placeholder_counts(const VisionInputs& vision) const override {
    return inner_.placeholder_counts(vision);
  }
  RopePlan plan_positions(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                          const VisionInputs& vision) const override {
    return inner_.plan_positions(input_ids, attention_mask, vision);
  }
  RopePlan plan_positions_with_spans(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                     const VisionInputs& vision, const std::vector<ImageSpan>& spans) const override {
    return inner_.plan_positions_with_spans(input_ids, attention_mask, vision, spans);
  }
  bool can_encode_images() const override { return inner_.can_encode_images(); }
  at::Tensor encode_images(const VisionInputs& vision) override { return inner_.encode_images(vision); }

  at::Tensor forward(const ForwardArgs& args) override { return inner_.forward(args); }
  std::vector<at::Tensor> forward_batch(const std::vector<const ForwardArgs*>& calls) override {
    return inner_.forward_batch(calls);
  }

 protected:
  CausalVlm& inner_;
};

/// Wraps any CausalVlm and records every forward call: step, window, whether a KV context was
/// present, which vision tensors came (with shapes) and which images they carried. Forwards
/// everything else to the wrapped model, so the generator cannot tell the difference.
///
///   vlmgen::testing::ForwardSpy spy(model);
///   vlmgen::Generator(spy).generate({{prompt}, vision}, config.enable_kv_cache(false));
///   for (const auto& call : spy.calls()) EXPECT_TRUE(call.has_all_vision());
///
/// For gmock, set an observer: spy.on_call([&](const ForwardCall& c) { mock.Seen(c); });
class ForwardSpy : public ForwardingVlm {
 public:
  explicit ForwardSpy(CausalVlm& inner) : ForwardingVlm(inner) {}

  /// Also keep copies of input_ids, the grid and the logits of every call. Default off.
  ForwardSpy& record_tensors(bool on) {
    record_tensors_ = on;
    return *this;
  }
  /// Called after every forward call with what was recorded, also when it threw.
  ForwardSpy& on_call(std::function<void(const ForwardCall&)> observer) {
    observer_ = std::move(observer);
    return *this;
  }

  const std::vector<ForwardCall>& calls() const { return calls_; }
  void clear() { calls_.clear(); }
  /// forward_batch calls made over the spy's lifetime.
  int64_t batches() const { return next_group_; }

  at::Tensor forward(const ForwardArgs& args) override {
    const size_t mine = record(args, -1);
    at::Tensor logits;
    try {
      logits = inner_.forward(args);
    } catch (...) {
      threw({mine}, std::current_exception());
      throw;
    }
    returned(mine, logits);
    return logits;
  }

  /// Records each call (they share a batch_group) and hands the batch to the wrapped model's
  /// forward_batch, so a model that fuses them still does.
  std::vector<at::Tensor> forward_batch(const std::vector<const ForwardArgs*>& args) override {
    const int64_t group = next_group_++;
    std::vector<size_t> mine;
    for (const ForwardArgs* a : args) mine.push_back(record(*a, group));
    std::vector<at::Tensor> logits;
    try {
      logits = inner_.forward_batch(args);
    } catch (...) {
      threw(mine, std::current_exception());
      throw;
    }
    for (size_t i = 0; i < mine.size() && i < logits.size(); ++i) returned(mine[i], logits[i]);
    return logits;
  }

 private:
  // Recorded before forwarding: a call that throws is the one a test most wants to see.
  size_t record(const ForwardArgs& args, int64_t group) {
    ForwardCall call;
    call.index = next_index_++;
    call.batch_group = group;
    call.step = args.step;
    call.window_start = args.window_start;
    call.window_end = args.window_start + (args.input_ids.defined() ? args.input_ids.size(1) : 0);
    call.batch = args.input_ids.defined() ? args.input_ids.size(0) : 0;
    call.had_context = args.context != nullptr;
    call.context_length = args.context != nullptr ? args.context->length() : 0;
    auto shape_of = [](const at::Tensor& t) -> std::optional<std::vector<int64_t>> {
      if (!t.defined()) return std::nullopt;
      return t.sizes().vec();
    };
    call.pixel_values_shape = shape_of(args.vision.pixel_values);
    call.image_grid_thw_shape = shape_of(args.vision.image_grid_thw);
    call.image_sizes_shape = shape_of(args.vision.image_sizes);
    call.image_embeddings_shape = shape_of(args.image_embeddings);
    call.images = args.images;
    if (record_tensors_) {
      call.input_ids = args.input_ids.to(at::kCPU).clone();
      if (args.vision.image_grid_thw.defined()) call.image_grid_thw = args.vision.image_grid_thw.to(at::kCPU).clone();
    }
    calls_.push_back(std::move(call));
    return calls_.size() - 1;
  }
  void returned(size_t mine, const at::Tensor& logits) {
    calls_[mine].outcome = CallOutcome::kReturned;
    if (record_tensors_) calls_[mine].logits = logits.detach().to(at::kCPU).clone();
    if (observer_) observer_(calls_[mine]);
  }
  void threw(const std::vector<size_t>& mine, const std::exception_ptr& error) {
    std::string message = "a non-standard exception";
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
    }
    for (size_t i : mine) {
      calls_[i].outcome = CallOutcome::kThrew;
      calls_[i].error = message;
      if (observer_) observer_(calls_[i]);
    }
  }

  bool record_tensors_ = false;
  std::function<void(const ForwardCall&)> observer_;
  std::vector<ForwardCall> calls_;
  int64_t next_index_ = 0;
  int64_t next_group_ = 0;
};

}  // namespace vlmgen::testing
