#pragma once
// The seam between vlmgen's C++ step loop and a model written in Python.
//
// PythonModel is a CausalVlm whose forward (and optionally plan_positions and encode_images)
// calls methods of a Python object. It takes the GIL for each call and nothing else: the
// generator runs with the GIL released, so other Python threads run while C++ works.
//
// A Python exception raised by the model's forward travels through the C++ step loop as
// pybind11::error_already_set (a std::exception holding the Python exception object); the
// generator rolls the context back as for any C++ error, and the binding's caller re-raises the
// original Python exception, type and traceback included.

#include <torch/python.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "vlmgen/error.h"
#include "vlmgen/inference_context.h"
#include "vlmgen/model.h"

namespace vlmgen::python {

namespace py = pybind11;

/// The name of a Python value's type, for messages.
inline std::string type_name(py::handle value) { return py::str(py::type::handle_of(value).attr("__name__")); }

/// An undefined tensor as None, a defined one as itself.
inline std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  if (!t.defined()) return std::nullopt;
  return t;
}

/// The Python `vlmgen.InferenceContext`: a context the caller owns, or one lent to a single
/// forward call (then `live` turns false when that call returns, and any use after it raises).
struct ContextHandle {
  std::shared_ptr<InferenceContext> owned;
  InferenceContext* ptr = nullptr;
  std::shared_ptr<std::atomic<bool>> live;

  static std::shared_ptr<ContextHandle> own(std::shared_ptr<InferenceContext> context) {
    auto h = std::make_shared<ContextHandle>();
    h->ptr = context.get();
    h->owned = std::move(context);
    return h;
  }
  static std::shared_ptr<ContextHandle> lend(InferenceContext* context, std::shared_ptr<std::atomic<bool>> live) {
    auto h = std::make_shared<ContextHandle>();
    h->ptr = context;
    h->live = std::move(live);
    return h;
  }
  InferenceContext& get() const {
    VLMGEN_CHECK(live == nullptr || live->load(),
                 "this InferenceContext was lent to one forward call, which has returned; a model may use "
                 "args.context only during the call it came with");
    VLMGEN_CHECK(ptr != nullptr, "this InferenceContext is empty");
    return *ptr;
  }
};

/// The Python `vlmgen.ForwardArgs`: what one forward call carries. Tensors are shared, not
/// copied; the context is valid during the call only.
struct ArgsView {
  ForwardArgs args;
  std::shared_ptr<ContextHandle> context;  ///< null when the call has no KV cache
  std::shared_ptr<std::atomic<bool>> live;

  explicit ArgsView(const ForwardArgs& a) : args(a), live(std::make_shared<std::atomic<bool>>(true)) {
    if (a.context != nullptr) context = ContextHandle::lend(a.context, live);
  }
  /// The arguments as C++ takes them, after checking the context is still lent.
  const ForwardArgs& checked() const {
    if (context) context->get();
    return args;
  }
};

/// Model traits from a Python value: a vlmgen.ModelTraits, or a dict of its fields.
ModelTraits traits_from_python(py::handle value);

/// Traits from an HF-style `config` (vocab_size, image/vision token ids, at the top or in
/// text_config; vision_config.spatial_merge_size), for a model without `traits`: no KV cache.
ModelTraits traits_from_hf_config(const py::object& config, const std::string& model);

/// Parses "float32", "torch.bfloat16", a torch.dtype, ... into a scalar type.
at::ScalarType dtype_from_python(py::handle value);
std::string dtype_name(at::ScalarType dtype);

class PythonModel : public CausalVlm {
 public:
  /// Reads `traits` (an attribute, or a method called once) now; the rest on each call.
  explicit PythonModel(py::object model);
  ~PythonModel() override;

  const ModelTraits& traits() const override { return traits_; }
  at::Device device() const override { return device_; }
  at::Tensor forward(const ForwardArgs& args) override;
  bool can_encode_images() const override { return has_encode_; }
  at::Tensor encode_images(const VisionInputs& vision) override;
  RopePlan plan_positions(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                          const VisionInputs& vision) const override;

  const py::object& object() const { return model_; }

 private:
  py::object model_;
  ModelTraits traits_;
  at::Device device_ = at::kCPU;
  bool has_plan_ = false;
  bool has_encode_ = false;
  std::string name_;  ///< the Python class name, for messages
};

/// A C++ model bound to Python (vlmgen.Model), or any Python object with forward(args).
inline std::shared_ptr<CausalVlm> model_from_python(py::handle model) {
  if (py::isinstance<CausalVlm>(model)) return model.cast<std::shared_ptr<CausalVlm>>();
  return std::make_shared<PythonModel>(py::reinterpret_borrow<py::object>(model));
}

}  // namespace vlmgen::python
