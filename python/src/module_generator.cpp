// vlmgen._vlmgen: the Generator, its requests (prompts as lists or tensors), token events and
// results, and token streams (a generate call on its own thread).

#include <cxxabi.h>
#include <fmt/format.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "model_adapter.h"
#include "module_parts.h"
#include "vlmgen/detail/tensor_utils.h"
#include "vlmgen/generator.h"

namespace vlmgen::python {
namespace {

// ---- finish reason as a string ------------------------------------------------------------

py::object finish_reason_or_none(FinishReason reason) {
  if (reason == FinishReason::kNotFinished) return py::none();
  return py::str(to_string(reason));
}

// ---- requests ------------------------------------------------------------------------------

struct PyRequest {
  std::vector<std::vector<int64_t>> prompts;
  VisionInputs vision;
  std::shared_ptr<ContextHandle> context;
  py::object on_token = py::none();
};

// Token-id rows from a list of lists of ints (or of 1-D tensors), or a 2-D integer tensor as an
// HF processor returns it, with its attention_mask (1 real, 0 padding) when rows are padded.
std::vector<std::vector<int64_t>> prompts_from(py::handle prompts, const std::optional<at::Tensor>& attention_mask) {
  const char* expected =
      "prompts must be a list of token-id lists (one per row), a 2-D integer tensor [rows, tokens], or a "
      "vlmgen.GenerateRequest";
  std::vector<std::vector<int64_t>> rows;
  if (THPVariable_Check(prompts.ptr())) {
    const at::Tensor ids = THPVariable_Unpack(prompts.ptr());
    VLMGEN_CHECK(ids.dim() == 2 && !at::isFloatingType(ids.scalar_type()) && ids.scalar_type() != at::kBool,
                 "{}, got a {} tensor of shape {}", expected, c10::toString(ids.scalar_type()), detail::shape_str(ids));
    const at::Tensor flat = ids.to(at::kCPU, at::kLong).contiguous();
    at::Tensor mask;
    if (attention_mask) {
      VLMGEN_CHECK(attention_mask->sizes() == ids.sizes(), "attention_mask {} must have the shape of the prompts {}",
                   detail::shape_str(*attention_mask), detail::shape_str(ids));
      mask = attention_mask->to(at::kCPU, at::kLong).contiguous();
    }
    auto id = flat.accessor<int64_t, 2>();
    for (int64_t b = 0; b < flat.size(0); ++b) {
      std::vector<int64_t> row;
      for (int64_t c = 0; c < flat.size(1); ++c) {
        if (mask.defined()) {
          const int64_t m = mask[b][c].item<int64_t>();
          VLMGEN_CHECK(m == 0 || m == 1, "attention_mask must hold 0 and 1, got {} at [{}, {}]", m, b, c);
          if (m == 0) continue;
        }
        row.push_back(id[b][c]);
      }
      rows.push_back(std::move(row));
    }
    return rows;
  }
  VLMGEN_CHECK(!attention_mask, "attention_mask goes with prompts given as a 2-D tensor");
  if (!py::isinstance<py::sequence>(prompts) || py::isinstance<py::str>(prompts)) {
    throw py::type_error(fmt::format("{}, got {}", expected, type_name(prompts)));
  }
  for (py::handle row : prompts) {
    if (THPVariable_Check(row.ptr())) {
      const at::Tensor t = THPVariable_Unpack(row.ptr());
      VLMGEN_CHECK(t.dim() == 1 && !at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kBool,
                   "a prompt row given as a tensor must be 1-D integer token ids, got {} {}",
                   c10::toString(t.scalar_type()), detail::shape_str(t));
      rows.push_back(detail::to_int64_vector(t));
      continue;
    }
    try {
      rows.push_back(row.cast<std::vector<int64_t>>());
    } catch (const py::cast_error&) {
      throw py::type_error(fmt::format("{}, got a row of type {}", expected, type_name(row)));
    }
  }
  return rows;
}

PyRequest request_from(py::handle prompts_or_request, std::optional<VisionInputs> vision,
                       std::shared_ptr<ContextHandle> context, py::object on_token,
                       const std::optional<at::Tensor>& attention_mask) {
  PyRequest r;
  if (py::isinstance<PyRequest>(prompts_or_request)) {
    r = prompts_or_request.cast<PyRequest>();
    VLMGEN_CHECK(!vision && !context && on_token.is_none() && !attention_mask,
                 "give vision, context and on_token either in the GenerateRequest or as arguments, not both");
    return r;
  }
  r.prompts = prompts_from(prompts_or_request, attention_mask);
  if (vision) r.vision = *vision;
  r.context = std::move(context);
  r.on_token = std::move(on_token);
  return r;
}

// ---- the generator -------------------------------------------------------------------------

struct PyGenerator {
  explicit PyGenerator(py::object model_object)
      : model(model_from_python(model_object)), model_ref(std::move(model_object)), generator(*model) {}

  std::shared_ptr<CausalVlm> model;
  py::object model_ref;  // the Python object, so `generator.model` gives it back
  Generator generator;
  std::mutex mutex;  // one generate at a time per generator (its state is not shared-safe)

  // Runs with the GIL released; `on_token` (if any) takes it for each event.
  GenerationResult run(const PyRequest& r, const GenerationConfig& config, TokenCallback on_token,
                       const std::atomic<bool>* cancel) {
    InferenceContext* context = r.context ? &r.context->get() : nullptr;
    GenerateRequest request(r.prompts, r.vision, context, std::move(on_token));
    request.cancel = cancel;
    // A forward or on_token that calls back into its own generator would wait for itself.
    VLMGEN_CHECK(owner.load() != std::this_thread::get_id(),
                 "generate was called re-entrantly on the same Generator (from its model's forward or an on_token "
                 "callback); use another Generator");
    std::lock_guard<std::mutex> lock(mutex);
    owner.store(std::this_thread::get_id());
    struct Release {
      std::atomic<std::thread::id>& owner;
      ~Release() { owner.store(std::thread::id()); }
    } release{owner};
    return generator.generate(request, config);
  }

  std::atomic<std::thread::id> owner{};
};

TokenCallback python_callback(const py::object& fn) {
  if (fn.is_none()) return {};
  VLMGEN_CHECK(PyCallable_Check(fn.ptr()), "on_token must be callable, got {}", type_name(fn));
  py::handle borrowed = fn;  // the request keeps it alive; no reference counting off the GIL
  return [borrowed](const TokenEvent& event) {
    py::gil_scoped_acquire gil;
    py::object keep_going = borrowed(event);
    if (keep_going.is_none()) return true;
    const int truth = PyObject_IsTrue(keep_going.ptr());
    if (truth < 0) throw py::error_already_set();
    return truth == 1;
  };
}

// Tokens as they come, from a generate call running on its own thread.
class TokenStream;

// Streams still running when the interpreter exits are closed by an atexit hook, while threads can
// still take the GIL (at finalization a thread that asks for it is ended, mid-generation).
std::mutex g_streams_mutex;
std::vector<std::weak_ptr<TokenStream>> g_streams;

class TokenStream {
 public:
  TokenStream(std::shared_ptr<PyGenerator> generator, PyRequest request, GenerationConfig config)
      : state_(std::make_shared<State>()) {
    VLMGEN_CHECK(request.on_token.is_none(), "a stream delivers the tokens itself; give no on_token");
    state_->generator = std::move(generator);
    state_->request = std::move(request);
    // The worker shares the state, so it stays valid even if the stream is dropped from the
    // worker's own thread (by the model it runs).
    worker_ = std::thread([state = state_, config]() mutable {
      try {
        auto push = [s = state.get()](const TokenEvent& event) {
          {
            std::lock_guard<std::mutex> lock(s->mutex);
            s->queue.push_back(event);
          }
          s->ready.notify_all();
          return !s->cancel.load();
        };
        GenerationResult result = state->generator->run(state->request, config, push, &state->cancel);
        std::lock_guard<std::mutex> lock(state->mutex);
        state->result = std::move(result);
      } catch (abi::__forced_unwind&) {
        throw;  // the interpreter is ending this thread (shutdown): let it
      } catch (...) {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(state->mutex);
        state->done = true;
      }
      state->ready.notify_all();
      // Last owner (the stream was dropped): its Python objects go under the GIL.
      if (state.use_count() == 1) {
        py::gil_scoped_acquire gil;
        state.reset();
      }
    });
  }
  ~TokenStream() { close(); }

  TokenEvent next() {
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(state_->mutex);
      state_->ready.wait(lock, [&] { return !state_->queue.empty() || state_->done; });
      if (!state_->queue.empty()) {
        TokenEvent event = std::move(state_->queue.front());
        state_->queue.pop_front();
        return event;
      }
    }
    join();
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      error = std::exchange(state_->error, nullptr);
    }
    if (error) std::rethrow_exception(error);
    throw py::stop_iteration();
  }

  // Stops the generation (between steps) and waits for its thread.
  void close() {
    state_->cancel.store(true);
    join();
  }

  const GenerationResult& result() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      VLMGEN_CHECK(state_->done, "the stream has not finished; iterate it to the end (or close it) first");
    }
    join();
    VLMGEN_CHECK(state_->result.has_value(),
                 "the stream ended with an error (its iteration raised it); it has no result");
    return *state_->result;
  }

 private:
  struct State {
    std::shared_ptr<PyGenerator> generator;
    PyRequest request;
    std::atomic<bool> cancel{false};
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<TokenEvent> queue;
    bool done = false;
    std::exception_ptr error;
    std::optional<GenerationResult> result;
  };

  void join() {
    // The worker may need the GIL for a Python model: never wait for it holding the GIL.
    std::optional<py::gil_scoped_release> release;
    if (PyGILState_Check()) release.emplace();
    std::lock_guard<std::mutex> lock(join_mutex_);  // close() from one thread, next() from another
    if (!worker_.joinable()) return;
    if (worker_.get_id() == std::this_thread::get_id()) {
      worker_.detach();  // dropped by the model the stream runs: the worker finishes on its own
      return;
    }
    worker_.join();
  }

  std::shared_ptr<State> state_;
  std::mutex join_mutex_;
  std::thread worker_;
};

}  // namespace

// ---- bindings ------------------------------------------------------------------------------

void bind_results(py::module_& m) {
  py::class_<TokenEvent>(m, "TokenEvent", "One new token of one row.")
      .def_readonly("row", &TokenEvent::row)
      .def_readonly("step", &TokenEvent::step)
      .def_readonly("token", &TokenEvent::token)
      .def_readonly("logprob", &TokenEvent::logprob)
      .def_readonly("top_logprobs", &TokenEvent::top_logprobs,
                    "(token, logprob) of the most likely tokens at this step")
      .def_property_readonly(
          "finish_reason", [](const TokenEvent& e) { return finish_reason_or_none(e.finish_reason); },
          "None, or why this token ends the row: 'end-id', 'stop', 'length', 'cancelled'")
      .def("__repr__", [](const TokenEvent& e) {
        return fmt::format("TokenEvent(row={}, step={}, token={}, logprob={})", e.row, e.step, e.token, e.logprob);
      });
  py::class_<SequenceOutput>(m, "SequenceOutput", "The new tokens of one row.")
      .def_readonly("tokens", &SequenceOutput::tokens)
      .def_property_readonly(
          "finish_reason", [](const SequenceOutput& s) { return std::string(to_string(s.finish_reason)); },
          "'end-id', 'stop', 'length', 'cancelled' or 'not-finished'")
      .def_readonly("logprobs", &SequenceOutput::logprobs)
      .def_readonly("prompt_logprobs", &SequenceOutput::prompt_logprobs)
      .def_readonly("top_logprobs", &SequenceOutput::top_logprobs)
      .def_property_readonly("logits", [](const SequenceOutput& s) { return defined_or_none(s.logits); });
  py::class_<GenerationStats>(m, "GenerationStats")
      .def_readonly("used_kv_cache", &GenerationStats::used_kv_cache)
      .def_readonly("forward_calls", &GenerationStats::forward_calls)
      .def_readonly("prompt_columns", &GenerationStats::prompt_columns)
      .def_readonly("generated_tokens", &GenerationStats::generated_tokens)
      .def_readonly("images_encoded", &GenerationStats::images_encoded)
      .def_readonly("time_to_first_token_s", &GenerationStats::time_to_first_token_s)
      .def_readonly("decode_tokens_per_s", &GenerationStats::decode_tokens_per_s)
      .def_readonly("total_s", &GenerationStats::total_s);
  py::class_<GenerationResult>(m, "GenerationResult")
      .def_readonly("sequences", &GenerationResult::sequences)
      .def_readonly("stats", &GenerationResult::stats)
      .def_property_readonly(
          "tokens",
          [](const GenerationResult& r) {
            std::vector<std::vector<int64_t>> out;
            for (const auto& s : r.sequences) out.push_back(s.tokens);
            return out;
          },
          "each row's new tokens");

  py::class_<PyRequest>(m, "GenerateRequest", "Prompts (one list of token ids per row), their images, a context.")
      .def(py::init([](py::handle prompts, std::optional<VisionInputs> vision, std::shared_ptr<ContextHandle> context,
                       py::object on_token, std::optional<at::Tensor> attention_mask) {
             PyRequest r;
             r.prompts = prompts_from(prompts, attention_mask);
             if (vision) r.vision = *vision;
             r.context = std::move(context);
             r.on_token = std::move(on_token);
             return r;
           }),
           py::arg("prompts"), py::arg("vision") = py::none(), py::arg("context") = py::none(),
           py::arg("on_token") = py::none(), py::arg("attention_mask") = py::none(),
           "prompts: token-id lists, or a 2-D integer tensor (with attention_mask when padded)")
      .def_readwrite("prompts", &PyRequest::prompts)
      .def_readwrite("vision", &PyRequest::vision)
      .def_readwrite("context", &PyRequest::context)
      .def_readwrite("on_token", &PyRequest::on_token);
}

void bind_generator(py::module_& m) {
  py::class_<TokenStream, std::shared_ptr<TokenStream>>(
      m, "TokenStream",
      "Iterator over TokenEvents of a generate call running on its own thread. `result` holds the "
      "GenerationResult once the iteration ends; close() (or leaving a `with` block) cancels it.")
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__", &TokenStream::next)
      .def("close", &TokenStream::close)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](TokenStream& s, py::args) { s.close(); })
      .def_property_readonly("result", &TokenStream::result);

  py::class_<PyGenerator, std::shared_ptr<PyGenerator>>(
      m, "Generator",
      "The step loop around a model: a vlmgen.Model, or any Python object with forward(args) and traits "
      "(plus, optionally, plan_positions(input_ids, attention_mask, vision), encode_images(vision) and device). "
      "Each forward call gets exactly the images whose placeholders are in its window.")
      .def(py::init([](py::object model) { return std::make_shared<PyGenerator>(std::move(model)); }), py::arg("model"))
      .def_property_readonly("model", [](const PyGenerator& g) { return g.model_ref; })
      .def(
          "generate",
          [](PyGenerator& g, py::handle prompts, std::optional<GenerationConfig> config,
             std::optional<VisionInputs> vision, std::shared_ptr<ContextHandle> context, py::object on_token,
             std::optional<at::Tensor> attention_mask) {
            PyRequest r =
                request_from(prompts, std::move(vision), std::move(context), std::move(on_token), attention_mask);
            TokenCallback callback = python_callback(r.on_token);
            py::gil_scoped_release release;
            return g.run(r, config.value_or(GenerationConfig()), std::move(callback), nullptr);
          },
          py::arg("prompts"), py::arg("config") = py::none(), py::kw_only(), py::arg("vision") = py::none(),
          py::arg("context") = py::none(), py::arg("on_token") = py::none(), py::arg("attention_mask") = py::none(),
          "Generates for `prompts` (a list of token-id lists, a 2-D integer tensor with its attention_mask when "
          "padded, or a GenerateRequest); on_token(event) is called for each new token (return False to stop that "
          "row). Raises vlmgen.Error on bad input, and whatever the model's forward raises.")
      .def(
          "stream",
          [](std::shared_ptr<PyGenerator> g, py::handle prompts, std::optional<GenerationConfig> config,
             std::optional<VisionInputs> vision, std::shared_ptr<ContextHandle> context,
             std::optional<at::Tensor> attention_mask) {
            PyRequest r = request_from(prompts, std::move(vision), std::move(context), py::none(), attention_mask);
            auto stream =
                std::make_shared<TokenStream>(std::move(g), std::move(r), config.value_or(GenerationConfig()));
            std::lock_guard<std::mutex> lock(g_streams_mutex);
            g_streams.erase(
                std::remove_if(g_streams.begin(), g_streams.end(), [](const auto& w) { return w.expired(); }),
                g_streams.end());
            g_streams.push_back(stream);
            return stream;
          },
          py::arg("prompts"), py::arg("config") = py::none(), py::kw_only(), py::arg("vision") = py::none(),
          py::arg("context") = py::none(), py::arg("attention_mask") = py::none(),
          "for event in generator.stream(prompts, config): ... (the generation runs on its own thread, ahead of "
          "the iteration)");
}

void close_streams_at_exit() {
  std::vector<std::shared_ptr<TokenStream>> live;
  {
    std::lock_guard<std::mutex> lock(g_streams_mutex);
    for (const auto& w : g_streams) {
      if (auto stream = w.lock()) live.push_back(std::move(stream));
    }
    g_streams.clear();
  }
  for (const auto& stream : live) stream->close();
}

}  // namespace vlmgen::python
