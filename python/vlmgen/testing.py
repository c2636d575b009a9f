"""Forward-call spies: wrap a model (C++ or Python) and see what each forward call was given.

    spy = vlmgen.testing.ForwardSpy(model, record_tensors=True)
    vlmgen.Generator(spy).generate(...)
    assert all(call.has_pixel_values() for call in spy.calls)
"""

from ._vlmgen import testing as _testing

ForwardSpy = _testing.ForwardSpy
ForwardCall = _testing.ForwardCall

__all__ = ["ForwardSpy", "ForwardCall", "DelegatingModel"]


class DelegatingModel:
    """A Python model whose forward is a C++ model's (vlmgen.Model): the seam alone, for measuring
    it or as a base to subclass (override forward, call super().forward(args))."""

    def __init__(self, inner):
        self.inner = inner
        self.traits = inner.traits

    def forward(self, args):
        return self.inner.forward(args)

    def plan_positions(self, input_ids, attention_mask, vision):
        return self.inner.plan_positions(input_ids, attention_mask, vision)
