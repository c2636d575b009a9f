"""vlmgen: vision-language generation where every forward call gets exactly its images.

The generator carries a request's images through its step loop and sends each forward call the
images whose placeholder tokens are in the window it computes: every step without a KV cache,
the prefill only with one, a new turn's images after a cached prefix. It drives vlmgen's own C++
models (``load_model``) or any Python object with ``forward(args)`` and ``traits``::

    import vlmgen

    class MyModel:
        traits = vlmgen.ModelTraits(vocab_size=151936, image_token_id=151655, spatial_merge_size=2)

        def forward(self, args):            # args: vlmgen.ForwardArgs
            return hf_model(input_ids=args.input_ids, ...).logits

    gen = vlmgen.Generator(MyModel())
    out = gen.generate([prompt_ids], vlmgen.GenerationConfig(max_new_tokens=32), vision=vision)
"""

import torch as _torch  # noqa: F401  (torch.Tensor must exist before tensors cross into Python)

from ._vlmgen import (  # noqa: F401
    ChatPrompt,
    ChatProcessor,
    Error,
    ForwardArgs,
    GenerateRequest,
    GenerationConfig,
    GenerationResult,
    GenerationStats,
    Generator,
    InferenceContext,
    KvCacheSpec,
    Model,
    ModelTraits,
    RopePlan,
    SequenceOutput,
    Tokenizer,
    TokenEvent,
    TokenStream,
    VisionInputs,
    __version__,
    end_token_ids,
    load_image,
    load_model,
    load_safetensors,
    preprocess_images,
    save_safetensors,
)
from . import testing  # noqa: F401

Error.__module__ = "vlmgen"  # shown as vlmgen.Error in tracebacks
