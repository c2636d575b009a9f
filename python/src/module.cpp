// The `vlmgen` Python extension (vlmgen._vlmgen): model traits, contexts and forward arguments
// (the model seam for Python models), vlmgen's own models, the generation config and the
// forward-call spy. The generator, its requests, results and streams are in module_generator.cpp;
// text and image helpers in module_text.cpp.

#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <pybind11/stl.h>

#include <functional>
#include <map>
#include <memory>
#include <sstream>

#include "model_adapter.h"
#include "module_parts.h"
#include "vlmgen/generator.h"
#include "vlmgen/models/load_model.h"
#include "vlmgen/testing/forward_spy.h"
#include "vlmgen/version.h"

namespace vlmgen::python {
namespace {

// ---- keyword arguments onto fields --------------------------------------------------------

template <class T>
class KwargFields {
 public:
  using Setter = std::function<void(T&, py::handle)>;

  void add(std::string name, Setter setter) { setters_.emplace(std::move(name), std::move(setter)); }

  void apply(T& target, const py::kwargs& kwargs, const char* what) const {
    for (auto item : kwargs) {
      const std::string key = py::str(item.first);
      auto it = setters_.find(key);
      if (it == setters_.end()) {
        std::vector<std::string> known;
        for (const auto& [name, setter] : setters_) known.push_back(name);
        throw py::type_error(fmt::format("{}() got an unexpected keyword argument '{}'; it takes {}", what, key,
                                         fmt::join(known, ", ")));
      }
      it->second(target, item.second);
    }
  }

 private:
  std::map<std::string, Setter> setters_;
};

template <class V>
V cast_field(py::handle value, const std::string& name) {
  try {
    return value.cast<V>();
  } catch (const py::cast_error&) {
    if (PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr())) {
      throw py::type_error(fmt::format("'{}' cannot take {}: out of range (it must be >= 0 and fit 64 bits)", name,
                                       std::string(py::str(value))));
    }
    throw py::type_error(fmt::format("'{}' cannot take a value of type {}", name, type_name(value)));
  }
}

// ---- replay mode as a string --------------------------------------------------------------

ReplayMode replay_mode_from(const std::string& text) {
  std::string name = text;
  for (char& c : name) c = c == '-' ? '_' : c;
  if (name == "span_aware") return ReplayMode::kSpanAware;
  if (name == "always") return ReplayMode::kAlways;
  if (name == "step_zero") return ReplayMode::kStepZero;
  VLMGEN_FAIL("replay_mode must be 'span_aware', 'always' or 'step_zero', got '{}'", text);
}

const char* replay_mode_name(ReplayMode mode) {
  switch (mode) {
    case ReplayMode::kSpanAware: return "span_aware";
    case ReplayMode::kAlways: return "always";
    case ReplayMode::kStepZero: return "step_zero";
  }
  return "?";
}

// ---- the model a spy holds ----------------------------------------------------------------

// A spy that owns what it watches (base-from-member: the holder is built before ForwardSpy).
struct InnerModel {
  std::shared_ptr<CausalVlm> inner;
};
class OwningSpy : private InnerModel, public testing::ForwardSpy {
 public:
  explicit OwningSpy(std::shared_ptr<CausalVlm> inner) : InnerModel{std::move(inner)}, ForwardSpy(*this->inner) {}
  const std::shared_ptr<CausalVlm>& wrapped() const { return inner; }
};

// ---- bindings ------------------------------------------------------------------------------

void bind_traits(py::module_& m) {
  py::class_<KvCacheSpec> spec(m, "KvCacheSpec", "Shape of the KV cache a model keeps per token.");
  auto spec_fields = std::make_shared<KwargFields<KvCacheSpec>>();
  auto spec_field = [&](const char* name, int64_t KvCacheSpec::*member) {
    spec.def_readwrite(name, member);
    spec_fields->add(name, [member, name](KvCacheSpec& s, py::handle v) { s.*member = cast_field<int64_t>(v, name); });
  };
  spec_field("num_layers", &KvCacheSpec::num_layers);
  spec_field("num_kv_heads", &KvCacheSpec::num_kv_heads);
  spec_field("head_dim", &KvCacheSpec::head_dim);
  // An FP8 cache (at::kByte: E4M3 rows with their scales, vlmgen/fp8_kv_rows.h) is 'fp8' here.
  auto spec_dtype_name = [](const KvCacheSpec& s) { return s.dtype == at::kByte ? "fp8" : dtype_name(s.dtype); };
  auto set_spec_dtype = [](KvCacheSpec& s, py::handle v) {
    const std::string name = py::str(v);
    s.dtype = name == "fp8" || name == "e4m3" ? at::kByte : dtype_from_python(v);
  };
  spec.def_property(
      "dtype", spec_dtype_name, set_spec_dtype,
      "float32 (default), bfloat16, float16, or fp8 (E4M3 bytes and a float32 scale per key or value row)");
  spec_fields->add("dtype", set_spec_dtype);
  spec.def(py::init([spec_fields](const py::kwargs& kw) {
             KvCacheSpec s;
             spec_fields->apply(s, kw, "KvCacheSpec");
             return s;
           }),
           "KvCacheSpec(num_layers=0, num_kv_heads=0, head_dim=0, dtype='float32')");
  spec.def("bytes_per_token", &KvCacheSpec::bytes_per_token);
  spec.def("__repr__", [](const KvCacheSpec& s) {
    return fmt::format("KvCacheSpec(num_layers={}, num_kv_heads={}, head_dim={}, dtype='{}')", s.num_layers,
                       s.num_kv_heads, s.head_dim, s.dtype == at::kByte ? "fp8" : dtype_name(s.dtype));
  });

  py::class_<ModelTraits> traits(m, "ModelTraits",
                                 "What the generator needs to know about a model: vocabulary size, image token ids, "
                                 "the vision layout and whether (and how) it keeps a KV cache.");
  auto fields = std::make_shared<KwargFields<ModelTraits>>();
  auto field = [&](const char* name, auto member, const char* doc) {
    using V = std::remove_reference_t<decltype(std::declval<ModelTraits&>().*member)>;
    traits.def_readwrite(name, member, doc);
    fields->add(name, [member, name](ModelTraits& t, py::handle v) { t.*member = cast_field<V>(v, name); });
  };
  field("vocab_size", &ModelTraits::vocab_size, "logits' last dimension");
  field("image_token_id", &ModelTraits::image_token_id, "the image placeholder token (None: no images)");
  field("vision_start_token_id", &ModelTraits::vision_start_token_id, "token before an image's placeholders");
  field("vision_end_token_id", &ModelTraits::vision_end_token_id, "token after an image's placeholders");
  field("video_token_id", &ModelTraits::video_token_id, "refused in prompts (videos are not supported)");
  field("spatial_merge_size", &ModelTraits::spatial_merge_size, "patches per placeholder token along each side");
  field("tokens_per_image", &ModelTraits::tokens_per_image, "placeholder tokens per image (per-image layout)");
  field("max_sequence_length", &ModelTraits::max_sequence_length, "0: no limit");
  field("supports_kv_cache", &ModelTraits::supports_kv_cache, "False: every step recomputes the whole prefix");
  field("kv_cache_under_sequence_parallel", &ModelTraits::kv_cache_under_sequence_parallel, "");
  field("accepts_partial_image_span", &ModelTraits::accepts_partial_image_span, "");
  field("vocab_parallel_logits", &ModelTraits::vocab_parallel_logits, "");
  auto layout_get = [](const ModelTraits& t) {
    return std::string(t.vision_layout == VisionLayout::kPerImage ? "per_image" : "patch_flattened");
  };
  auto layout_set = [](ModelTraits& t, py::handle v) {
    const std::string name = cast_field<std::string>(v, "vision_layout");
    VLMGEN_CHECK(name == "per_image" || name == "patch_flattened",
                 "vision_layout must be 'patch_flattened' or 'per_image', got '{}'", name);
    t.vision_layout = name == "per_image" ? VisionLayout::kPerImage : VisionLayout::kPatchFlattened;
  };
  traits.def_property("vision_layout", layout_get, layout_set, "'patch_flattened' (Qwen-VL) or 'per_image'");
  fields->add("vision_layout", layout_set);
  auto kv_set = [](ModelTraits& t, py::handle v) {
    if (py::isinstance<py::dict>(v)) {
      t.kv_cache = py::module_::import("vlmgen._vlmgen").attr("KvCacheSpec")(**v.cast<py::dict>()).cast<KvCacheSpec>();
    } else {
      t.kv_cache = cast_field<KvCacheSpec>(v, "kv_cache");
    }
  };
  traits.def_property(
      "kv_cache", [](const ModelTraits& t) { return t.kv_cache; }, kv_set,
      "KvCacheSpec (or a dict of its fields) of the cache the generator allocates for the model");
  fields->add("kv_cache", kv_set);
  traits.def(py::init([fields](const py::kwargs& kw) {
               ModelTraits t;
               fields->apply(t, kw, "ModelTraits");
               return t;
             }),
             "ModelTraits(vocab_size=..., image_token_id=None, ..., kv_cache=KvCacheSpec(...))");
  traits.def("__repr__", [](const ModelTraits& t) {
    auto opt = [](const std::optional<int64_t>& v) { return v ? std::to_string(*v) : std::string("None"); };
    return fmt::format("ModelTraits(vocab_size={}, image_token_id={}, spatial_merge_size={}, supports_kv_cache={})",
                       t.vocab_size, opt(t.image_token_id), t.spatial_merge_size,
                       t.supports_kv_cache ? "True" : "False");
  });

  py::class_<RopePlan>(m, "RopePlan",
                       "Rotary positions of a prompt: prompt_positions [B, L] or [3, B, L] (M-RoPE), and delta[b]: "
                       "a token generated at column c of row b gets position c - pad_b + delta[b].")
      .def(py::init([](at::Tensor positions, std::vector<int64_t> delta) {
             RopePlan p;
             p.prompt_positions = std::move(positions);
             p.delta = std::move(delta);
             return p;
           }),
           py::arg("prompt_positions"), py::arg("delta"))
      .def_readwrite("prompt_positions", &RopePlan::prompt_positions)
      .def_readwrite("delta", &RopePlan::delta);
}

void bind_context(py::module_& m) {
  py::class_<ContextHandle, std::shared_ptr<ContextHandle>>(
      m, "InferenceContext",
      "A KV cache and the tokens it holds. Pass one in a request to continue a conversation: a later request "
      "whose prompt starts with the cached tokens computes only the new ones. A model's forward gets one in "
      "args.context (valid during that call only) and stores its keys and values with append_kv.")
      .def(py::init([](const KvCacheSpec& spec, int64_t batch, int64_t capacity) {
             return ContextHandle::own(
                 std::shared_ptr<InferenceContext>(InferenceContext::allocate(spec, batch, capacity)));
           }),
           py::arg("spec"), py::arg("batch"), py::arg("capacity"))
      .def_static(
          "for_model",
          [](py::handle model, int64_t batch, int64_t capacity) {
            std::shared_ptr<CausalVlm> m = model_from_python(model);
            return ContextHandle::own(std::shared_ptr<InferenceContext>(
                InferenceContext::allocate(m->traits().kv_cache, batch, capacity, m->device())));
          },
          py::arg("model"), py::arg("batch"), py::arg("capacity"), "A context shaped for `model`'s KV cache.")
      .def_property_readonly(
          "length", [](const ContextHandle& h) { return h.get().length(); }, "columns committed")
      .def_property_readonly("capacity", [](const ContextHandle& h) { return h.get().capacity(); })
      .def_property_readonly("batch_size", [](const ContextHandle& h) { return h.get().batch_size(); })
      .def_property_readonly("num_layers", [](const ContextHandle& h) { return h.get().num_layers(); })
      .def_property_readonly("bytes", [](const ContextHandle& h) { return h.get().bytes(); })
      .def(
          "append_kv",
          [](const ContextHandle& h, int64_t layer, const at::Tensor& k, const at::Tensor& v) {
            return h.get().append_kv(layer, k, v);
          },
          py::arg("layer"), py::arg("keys"), py::arg("values"),
          "Stores this call's keys and values [B, kv_heads, S, head_dim] of `layer` after the committed columns; "
          "returns (keys, values) of every column so far (committed + these).")
      .def(
          "kv", [](const ContextHandle& h, int64_t layer) { return h.get().kv(layer); }, py::arg("layer"),
          "(keys, values) of the committed columns of `layer`.")
      .def_property_readonly("tokens", [](const ContextHandle& h) { return h.get().tokens(); })
      .def_property_readonly("attention_mask", [](const ContextHandle& h) { return h.get().attention_mask(); })
      .def(
          "truncate", [](const ContextHandle& h, int64_t length) { h.get().truncate(length); }, py::arg("length"),
          "Forgets the columns from `length` on.")
      .def("clone", [](const ContextHandle& h) {
        return ContextHandle::own(std::make_shared<InferenceContext>(h.get().clone()));
      });
}

void bind_forward_args(py::module_& m) {
  py::class_<ArgsView, std::shared_ptr<ArgsView>>(
      m, "ForwardArgs",
      "What one forward call computes: the window of columns [window_start, window_end) of every row, its "
      "positions, the attention mask of columns [0, window_end), the vision tensors of exactly the images whose "
      "placeholders are in the window (None when it has none), and the KV cache (None without one).")
      .def_property_readonly(
          "input_ids", [](const ArgsView& a) { return a.args.input_ids; }, "[B, S] int64")
      .def_property_readonly(
          "position_ids", [](const ArgsView& a) { return a.args.position_ids; }, "[B, S], or [3, B, S] for M-RoPE")
      .def_property_readonly(
          "attention_mask", [](const ArgsView& a) { return a.args.attention_mask; },
          "[B, window_end]: 1 real token, 0 padding")
      .def_property_readonly("window_start", [](const ArgsView& a) { return a.args.window_start; })
      .def_property_readonly("window_end",
                             [](const ArgsView& a) { return a.args.window_start + a.args.input_ids.size(1); })
      .def_property_readonly(
          "step", [](const ArgsView& a) { return a.args.step; }, "0 for the prompt")
      .def_property_readonly(
          "last_column_logits", [](const ArgsView& a) { return a.args.last_column_logits; },
          "True: the generator reads only the last column; returning [B, 1, V] is enough")
      .def_property_readonly("pixel_values",
                             [](const ArgsView& a) { return defined_or_none(a.args.vision.pixel_values); })
      .def_property_readonly("image_grid_thw",
                             [](const ArgsView& a) { return defined_or_none(a.args.vision.image_grid_thw); })
      .def_property_readonly("image_sizes",
                             [](const ArgsView& a) { return defined_or_none(a.args.vision.image_sizes); })
      .def_property_readonly(
          "image_embeddings", [](const ArgsView& a) { return defined_or_none(a.args.image_embeddings); },
          "rows from encode_images (encoder cache) instead of pixel_values, or None")
      .def_property_readonly("vision", [](const ArgsView& a) { return a.args.vision; })
      .def_property_readonly(
          "images", [](const ArgsView& a) { return a.args.images; },
          "indices (into the request's bundle) of the images sent")
      .def_property_readonly(
          "context", [](const ArgsView& a) { return a.context; },
          "the KV cache (vlmgen.InferenceContext) or None; valid during this call only");
}

void bind_models(py::module_& m) {
  py::class_<CausalVlm, std::shared_ptr<CausalVlm>>(
      m, "Model", "A model implemented in C++ (vlmgen.load_model); Python models need not derive from it.")
      .def_property_readonly("traits", [](const CausalVlm& model) { return model.traits(); })
      .def_property_readonly("device", [](const CausalVlm& model) { return model.device().str(); })
      .def(
          "forward",
          [](CausalVlm& model, const ArgsView& args) {
            const ForwardArgs& a = args.checked();
            py::gil_scoped_release release;
            c10::InferenceMode inference_mode;
            return model.forward(a);
          },
          py::arg("args"), "Logits of the window (a Python model may delegate its forward to this).")
      .def(
          "plan_positions",
          [](const CausalVlm& model, const at::Tensor& ids, const at::Tensor& mask, const VisionInputs& vision) {
            py::gil_scoped_release release;
            return model.plan_positions(ids, mask, vision);
          },
          py::arg("input_ids"), py::arg("attention_mask"), py::arg("vision"))
      .def("placeholder_counts", &CausalVlm::placeholder_counts, py::arg("vision"),
           "Placeholder tokens each image of `vision` takes in a prompt.")
      .def_property_readonly("can_encode_images", &CausalVlm::can_encode_images)
      .def(
          "encode_images",
          [](CausalVlm& model, const VisionInputs& vision) {
            py::gil_scoped_release release;
            c10::InferenceMode inference_mode;
            return model.encode_images(vision);
          },
          py::arg("vision"));

  m.def(
      "load_model",
      [](const std::string& dir, const std::string& dtype, const std::string& device, bool huge_pages,
         const std::string& kv_cache_dtype) {
        LoadOptions options = load_options_for_dtype(dtype);
        options.device = parse_device(device);
        options.huge_pages = huge_pages;
        options.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype);
        py::gil_scoped_release release;
        return std::shared_ptr<CausalVlm>(load_model(dir, ParallelContext::single(), options));
      },
      py::arg("dir"), py::arg("dtype") = "f32", py::arg("device") = "cpu", py::arg("huge_pages") = true,
      py::arg("kv_cache_dtype") = "f32",
      "Loads a checkpoint folder (config.json + *.safetensors) of a supported family (qwen2_vl, qwen2_5_vl, "
      "qwen3_vl, gemma3, llava_next) as a vlmgen.Model. dtype: the language model's weights, 'f32' (default), 'bf16', "
      "'f16', or 'fp8' "
      "(an FP8 checkpoint's linears kept as bytes, the rest bf16; CPU); compute is float32 on the CPU. device: "
      "'cpu' (default), 'cuda' or 'cuda:N' (there a 16-bit dtype runs the linears in that dtype). huge_pages: "
      "on the CPU under Linux, the weights each decode step reads go into memory advised for transparent huge "
      "pages (faster decode, at most 2 MiB more memory); False keeps each in its own allocation. kv_cache_dtype: "
      "what the model's KV caches store, 'f32' (default, exact), 'bf16' (half the cache's memory and of the "
      "bytes a long-context decode step reads; keys and values rounded to bfloat16) or 'fp8' (E4M3 bytes and a "
      "scale per key or value row, about a quarter; rounded to 3 mantissa bits; CPU); attention stays float32.");
}

void bind_config(py::module_& m) {
  py::class_<GenerationConfig> cls(m, "GenerationConfig",
                                   "Options of one generate call, as keyword arguments: "
                                   "GenerationConfig(max_new_tokens=32, enable_kv_cache=False, temperature=0.7).");
  auto fields = std::make_shared<KwargFields<GenerationConfig>>();
  auto option = [&](const char* name, auto getter, auto setter, const char* doc) {
    using V = std::decay_t<decltype(getter(std::declval<const GenerationConfig&>()))>;
    cls.def_property(
        name, [getter](const GenerationConfig& c) { return getter(c); },
        [setter, name](GenerationConfig& c, py::handle v) { setter(c, cast_field<V>(v, name)); }, doc);
    fields->add(name, [setter, name](GenerationConfig& c, py::handle v) { setter(c, cast_field<V>(v, name)); });
  };
#define VLMGEN_PY_OPTION(name, doc)                              \
  option(                                                        \
      #name, [](const GenerationConfig& c) { return c.name(); }, \
      [](GenerationConfig& c, std::decay_t<decltype(c.name())> v) { c.name(std::move(v)); }, doc)
  VLMGEN_PY_OPTION(max_new_tokens, "new tokens per row at most (default 16)");
  VLMGEN_PY_OPTION(enable_kv_cache, "False: recompute the whole prefix at every step (default True)");
  VLMGEN_PY_OPTION(end_token_ids, "tokens that end a row (kept in its output)");
  VLMGEN_PY_OPTION(stop_token_ids, "more tokens that end a row");
  VLMGEN_PY_OPTION(pad_token_id, "token written after a row ends");
  VLMGEN_PY_OPTION(temperature, "0: greedy (default)");
  VLMGEN_PY_OPTION(top_k, "0: off");
  VLMGEN_PY_OPTION(top_p, "1.0: off");
  VLMGEN_PY_OPTION(seed, "sampling seed");
  VLMGEN_PY_OPTION(row_seeds, "one seed per row (overrides seed)");
  VLMGEN_PY_OPTION(return_logprobs, "log-probability of each chosen token");
  VLMGEN_PY_OPTION(prefill_chunk_size, "0: the whole prompt in one call");
  VLMGEN_PY_OPTION(encoder_cache, "encode each image once per request (models with encode_images)");
  VLMGEN_PY_OPTION(allow_placeholder_tokens, "");
  VLMGEN_PY_OPTION(full_logits, "ask the model for every column's logits");
  VLMGEN_PY_OPTION(check_pixel_values, "refuse NaN/infinite pixel_values");
  VLMGEN_PY_OPTION(prompt_logprobs, "log-probability of each prompt token");
  VLMGEN_PY_OPTION(top_logprobs, "the k most likely tokens at each step");
  VLMGEN_PY_OPTION(return_logits, "each step's logits");
#undef VLMGEN_PY_OPTION
  auto mode_set = [](GenerationConfig& c, py::handle v) {
    c.replay_mode(replay_mode_from(cast_field<std::string>(v, "replay_mode")));
  };
  cls.def_property(
      "replay_mode", [](const GenerationConfig& c) { return replay_mode_name(c.replay_mode()); }, mode_set,
      "'span_aware' (default: each call gets exactly the images in its window), 'always', or 'step_zero' "
      "(the upstream bug, for A/B tests only)");
  fields->add("replay_mode", mode_set);
  cls.def(py::init([fields](const py::kwargs& kw) {
            GenerationConfig c;
            fields->apply(c, kw, "GenerationConfig");
            return c;
          }),
          "GenerationConfig(**options)");
  cls.def("__repr__", [](const GenerationConfig& c) {
    return fmt::format("GenerationConfig(max_new_tokens={}, enable_kv_cache={}, replay_mode='{}', temperature={})",
                       c.max_new_tokens(), c.enable_kv_cache() ? "True" : "False", replay_mode_name(c.replay_mode()),
                       c.temperature());
  });
}

void bind_testing(py::module_& m) {
  py::module_ t = m.def_submodule("testing", "Forward-call spies for tests.");
  py::class_<testing::ForwardCall>(t, "ForwardCall", "What one forward call was given.")
      .def_readonly("index", &testing::ForwardCall::index)
      .def_readonly("step", &testing::ForwardCall::step)
      .def_readonly("window_start", &testing::ForwardCall::window_start)
      .def_readonly("window_end", &testing::ForwardCall::window_end)
      .def_readonly("batch", &testing::ForwardCall::batch)
      .def_readonly("had_context", &testing::ForwardCall::had_context)
      .def_readonly("context_length", &testing::ForwardCall::context_length)
      .def_readonly("pixel_values_shape", &testing::ForwardCall::pixel_values_shape)
      .def_readonly("image_grid_thw_shape", &testing::ForwardCall::image_grid_thw_shape)
      .def_readonly("image_sizes_shape", &testing::ForwardCall::image_sizes_shape)
      .def_readonly("image_embeddings_shape", &testing::ForwardCall::image_embeddings_shape)
      .def_readonly("images", &testing::ForwardCall::images)
      .def_property_readonly("outcome",
                             [](const testing::ForwardCall& c) {
                               switch (c.outcome) {
                                 case testing::CallOutcome::kRunning: return "running";
                                 case testing::CallOutcome::kReturned: return "returned";
                                 case testing::CallOutcome::kThrew: return "threw";
                               }
                               return "?";
                             })
      .def_readonly("error", &testing::ForwardCall::error)
      .def_property_readonly("input_ids", [](const testing::ForwardCall& c) { return defined_or_none(c.input_ids); })
      .def_property_readonly("logits", [](const testing::ForwardCall& c) { return defined_or_none(c.logits); })
      .def_property_readonly("window_size", &testing::ForwardCall::window_size)
      .def("has_pixel_values", &testing::ForwardCall::has_pixel_values)
      .def("has_all_vision", &testing::ForwardCall::has_all_vision)
      .def("has_any_vision", &testing::ForwardCall::has_any_vision)
      .def("__repr__", [](const testing::ForwardCall& c) {
        std::ostringstream os;
        testing::PrintTo(c, &os);
        return os.str();
      });
  py::class_<OwningSpy, CausalVlm, std::shared_ptr<OwningSpy>>(
      t, "ForwardSpy",
      "Wraps a model (C++ or Python) and records every forward call; use it as the model of a Generator.")
      .def(py::init([](py::handle model, bool record_tensors) {
             auto spy = std::make_shared<OwningSpy>(model_from_python(model));
             spy->record_tensors(record_tensors);
             return spy;
           }),
           py::arg("model"), py::arg("record_tensors") = false,
           "record_tensors: keep each call's input_ids and logits (CPU copies)")
      .def_property_readonly(
          "calls", [](const OwningSpy& s) { return s.calls(); }, "the calls so far, in order")
      .def("clear", &OwningSpy::clear);
}

}  // namespace

void bind_core(py::module_& m) {
  bind_traits(m);
  bind_context(m);
  bind_forward_args(m);
  bind_models(m);
  bind_config(m);
  bind_results(m);
  bind_generator(m);
  bind_testing(m);
  py::module_::import("atexit").attr("register")(py::cpp_function(&close_streams_at_exit));
}

}  // namespace vlmgen::python

PYBIND11_MODULE(_vlmgen, m) {
  namespace py = pybind11;
  py::module_::import("torch");  // torch.Tensor must exist before tensors cross
  m.doc() = "vlmgen: vision-language generation with the span rule (each forward call gets exactly its images).";
  m.attr("__version__") = fmt::format("{}.{}.{}", VLMGEN_VERSION_MAJOR, VLMGEN_VERSION_MINOR, VLMGEN_VERSION_PATCH);
  py::register_exception<vlmgen::Error>(m, "Error", PyExc_RuntimeError);
  vlmgen::python::bind_vision(m);
  vlmgen::python::bind_core(m);
  vlmgen::python::bind_text(m);
}
