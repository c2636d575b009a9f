#pragma once
// The parts of the `vlmgen._vlmgen` module, each bound in its own translation unit.

#include <torch/python.h>

namespace vlmgen::python {

/// VisionInputs, image loading and preprocessing, safetensors files.
void bind_vision(pybind11::module_& m);
/// Traits, contexts, forward arguments, models, the generator, results, vlmgen.testing.
void bind_core(pybind11::module_& m);
/// Tokenizer and chat prompts.
void bind_text(pybind11::module_& m);

}  // namespace vlmgen::python
