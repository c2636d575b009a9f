"""Forward-call spies: wrap a model (C++ or Python) and see what each forward call was given.

    spy = vlmgen.testing.ForwardSpy(model, record_tensors=True)
    vlmgen.Generator(spy).generate(...)
    assert all(call.has_pixel_values() for call in spy.calls)
"""

from ._vlmgen import testing as _testing

ForwardSpy = _testing.ForwardSpy
ForwardCall = _testing.ForwardCall

__all__ = ["ForwardSpy", "ForwardCall"]
