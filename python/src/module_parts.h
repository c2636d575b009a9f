#pragma once
// The parts of the `vlmgen._vlmgen` module, each bound in its own translation unit.

#include <torch/python.h>

namespace vlmgen::python {

/// VisionInputs, image loading and preprocessing, safetensors files.
void bind_vision(pybind11::module_& m);
/// Traits, contexts, forward arguments, models, the generator, results, vlmgen.testing.
void bind_core(pybind11::module_& m);
/// Token events, results and requests (module_generator.cpp; bind_core calls it).
void bind_results(pybind11::module_& m);
/// The Generator and its token streams (module_generator.cpp; bind_core calls it).
void bind_generator(pybind11::module_& m);
/// Closes the token streams still running (an atexit hook bind_core registers).
void close_streams_at_exit();
/// Tokenizer and chat prompts.
void bind_text(pybind11::module_& m);

}  // namespace vlmgen::python
