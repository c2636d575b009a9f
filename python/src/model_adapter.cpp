#include "model_adapter.h"

#include <fmt/format.h>

#include <map>

#include "vlmgen/detail/tensor_utils.h"

namespace vlmgen::python {

namespace {

// Clears the flag that lends a context to one call, whatever way the call ends.
struct LeaseGuard {
  std::shared_ptr<std::atomic<bool>> live;
  ~LeaseGuard() { live->store(false); }
};

at::Tensor tensor_result(py::handle out, const std::string& model, const char* method, const char* expected) {
  VLMGEN_CHECK(THPVariable_Check(out.ptr()), "{}.{} must return a torch.Tensor ({}), got {}", model, method, expected,
               type_name(out));
  return THPVariable_Unpack(out.ptr());
}

}  // namespace

at::ScalarType dtype_from_python(py::handle value) {
  std::string name = py::str(value);
  if (name.rfind("torch.", 0) == 0) name = name.substr(6);
  static const std::map<std::string, at::ScalarType> kNames = {{"float32", at::kFloat},     {"float", at::kFloat},
                                                               {"float16", at::kHalf},      {"half", at::kHalf},
                                                               {"bfloat16", at::kBFloat16}, {"float64", at::kDouble}};
  auto it = kNames.find(name);
  VLMGEN_CHECK(it != kNames.end(),
               "dtype must be one of float32, float16, bfloat16, float64 (or a torch.dtype), got '{}'", name);
  return it->second;
}

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kDouble: return "float64";
    default: return c10::toString(dtype);
  }
}

ModelTraits traits_from_python(py::handle value) {
  py::object traits_class = py::module_::import("vlmgen._vlmgen").attr("ModelTraits");
  if (py::isinstance<py::dict>(value)) return traits_class(**value.cast<py::dict>()).cast<ModelTraits>();
  VLMGEN_CHECK(py::isinstance(value, traits_class), "a model's traits must be a vlmgen.ModelTraits or a dict, got {}",
               type_name(value));
  return value.cast<ModelTraits>();
}

ModelTraits traits_from_hf_config(const py::object& config, const std::string& model) {
  // Text fields sit at the top (Qwen2-VL) or in text_config (Qwen2.5/3-VL in transformers >= 4.5x).
  auto find = [&](const char* name) -> py::object {
    py::object v = py::getattr(config, name, py::none());
    if (v.is_none()) {
      py::object text = py::getattr(config, "text_config", py::none());
      if (!text.is_none()) v = py::getattr(text, name, py::none());
    }
    return v;
  };
  auto optional_id = [&](const char* name) -> std::optional<int64_t> {
    py::object v = find(name);
    if (v.is_none()) return std::nullopt;
    try {
      return v.cast<int64_t>();
    } catch (const py::cast_error&) {
      VLMGEN_FAIL("{}.config.{} must be an integer, got {}", model, name, type_name(v));
    }
  };
  ModelTraits t;
  const std::optional<int64_t> vocab = optional_id("vocab_size");
  VLMGEN_CHECK(vocab.has_value(), "{}.config has no vocab_size (nor text_config.vocab_size); give `traits`", model);
  t.vocab_size = *vocab;
  t.image_token_id = optional_id("image_token_id");
  t.vision_start_token_id = optional_id("vision_start_token_id");
  t.vision_end_token_id = optional_id("vision_end_token_id");
  t.video_token_id = optional_id("video_token_id");
  py::object vision = py::getattr(config, "vision_config", py::none());
  if (!vision.is_none()) {
    py::object merge = py::getattr(vision, "spatial_merge_size", py::none());
    if (!merge.is_none()) t.spatial_merge_size = merge.cast<int64_t>();
  }
  // The generator cannot know how a Python model caches: it recomputes the prefix every step, with
  // every image each call needs. A model with its own KV cache gives traits with kv_cache.
  t.supports_kv_cache = false;
  return t;
}

PythonModel::PythonModel(py::object model) : model_(std::move(model)) {
  name_ = type_name(model_);
  VLMGEN_CHECK(py::hasattr(model_, "forward") && py::isinstance<py::function>(model_.attr("forward")),
               "a Python model needs a forward(args) method; {} has none", name_);
  // getattr, not hasattr: a `traits` property that raises must raise, not read as missing.
  PyObject* raw_traits = PyObject_GetAttrString(model_.ptr(), "traits");
  if (raw_traits == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
    PyErr_Clear();
    // An HF-style model says the same in its config.
    py::object config = py::getattr(model_, "config", py::none());
    VLMGEN_CHECK(!config.is_none(),
                 "a Python model needs `traits` (a vlmgen.ModelTraits or a dict with at least vocab_size, as an "
                 "attribute or a method) or an HF-style `config` with vocab_size; {} has neither",
                 name_);
    traits_ = traits_from_hf_config(config, name_);
  } else {
    py::object traits = py::reinterpret_steal<py::object>(raw_traits);
    if (PyCallable_Check(traits.ptr()) && !py::isinstance<py::type>(traits)) traits = traits();
    traits_ = traits_from_python(traits);
  }
  VLMGEN_CHECK(traits_.vocab_size > 0, "{}.traits: vocab_size must be > 0, got {}", name_, traits_.vocab_size);
  VLMGEN_CHECK(
      !traits_.supports_kv_cache || traits_.kv_cache.num_kv_heads >= 1,
      "{}.traits: supports_kv_cache is True but kv_cache is not set; give kv_cache=KvCacheSpec(num_layers=..., "
      "num_kv_heads=..., head_dim=...) for the cache the generator allocates (the model fills it with "
      "args.context.append_kv), or supports_kv_cache=False",
      name_);
  VLMGEN_CHECK(!traits_.supports_kv_cache || traits_.kv_cache.dtype != at::kByte,
               "{}.traits: kv_cache dtype 'fp8' is for vlmgen's own models (their kernels read the E4M3 rows); a "
               "Python model's cache stores float32, bfloat16 or float16",
               name_);
  if (py::hasattr(model_, "device")) {
    py::object device = model_.attr("device");
    if (PyCallable_Check(device.ptr())) device = device();
    const std::string text = py::str(device);
    try {
      device_ = at::Device(text);
    } catch (const c10::Error&) {
      VLMGEN_FAIL("{}.device must name a device such as 'cpu' or 'cuda:0', got '{}'", name_, text);
    }
  }
  has_plan_ = py::hasattr(model_, "plan_positions");
  has_encode_ = py::hasattr(model_, "encode_images");
}

PythonModel::~PythonModel() {
  // The Python object is released under the GIL, whichever thread drops the last reference.
  py::gil_scoped_acquire gil;
  model_ = py::object();
}

at::Tensor PythonModel::forward(const ForwardArgs& args) {
  // A Python model sees every tensor of the call on its device (an HF model indexes its
  // embedding with input_ids there); the generator keeps token ids on the host.
  ForwardArgs on_device = args;
  if (on_device.input_ids.defined() && on_device.input_ids.device() != device()) {
    on_device.input_ids = on_device.input_ids.to(device());
  }
  py::gil_scoped_acquire gil;
  auto view = std::make_shared<ArgsView>(on_device);
  LeaseGuard lease{view->live};
  py::object out = model_.attr("forward")(view);
  return tensor_result(out, name_, "forward", "logits [batch, columns, vocab]");
}

at::Tensor PythonModel::encode_images(const VisionInputs& vision) {
  py::gil_scoped_acquire gil;
  py::object out = model_.attr("encode_images")(vision);
  return tensor_result(out, name_, "encode_images", "one row per image placeholder token");
}

RopePlan PythonModel::plan_positions(const at::Tensor& input_ids, const at::Tensor& attention_mask,
                                     const VisionInputs& vision) const {
  if (!has_plan_) return CausalVlm::plan_positions(input_ids, attention_mask, vision);
  py::gil_scoped_acquire gil;
  py::object out = model_.attr("plan_positions")(input_ids, attention_mask, vision);
  py::object plan_class = py::module_::import("vlmgen._vlmgen").attr("RopePlan");
  RopePlan plan;
  if (py::isinstance(out, plan_class)) {
    plan = out.cast<RopePlan>();
  } else {
    VLMGEN_CHECK(py::isinstance<py::tuple>(out) && py::len(out) == 2,
                 "{}.plan_positions must return a vlmgen.RopePlan or a (positions, delta) tuple, got {}", name_,
                 type_name(out));
    auto pair = out.cast<py::tuple>();
    plan.prompt_positions = tensor_result(pair[0], name_, "plan_positions", "positions [B, L] or [3, B, L]");
    try {
      plan.delta = pair[1].cast<std::vector<int64_t>>();
    } catch (const py::cast_error&) {
      VLMGEN_FAIL("{}.plan_positions: delta must be a list of ints (one per row), got {}", name_, type_name(pair[1]));
    }
  }
  const int64_t batch = input_ids.size(0), columns = input_ids.size(1);
  const auto& p = plan.prompt_positions;
  VLMGEN_CHECK(p.defined() && ((p.dim() == 2 && p.size(0) == batch && p.size(1) == columns) ||
                               (p.dim() == 3 && p.size(1) == batch && p.size(2) == columns)),
               "{}.plan_positions: positions must be [{}, {}] or [axes, {}, {}], got {}", name_, batch, columns, batch,
               columns, p.defined() ? detail::shape_str(p) : std::string("undefined"));
  VLMGEN_CHECK(
      !at::isFloatingType(p.scalar_type()) && !at::isComplexType(p.scalar_type()) && p.scalar_type() != at::kBool,
      "{}.plan_positions: positions must be an integer tensor, got {} (a float would be cut silently)", name_,
      c10::toString(p.scalar_type()));
  VLMGEN_CHECK(static_cast<int64_t>(plan.delta.size()) == batch || plan.delta.empty(),
               "{}.plan_positions: delta must have one value per row ({}), got {}", name_, batch, plan.delta.size());
  if (plan.delta.empty()) plan.delta.assign(static_cast<size_t>(batch), 0);
  plan.prompt_positions = p.to(at::kCPU, at::kLong);
  return plan;
}

}  // namespace vlmgen::python
