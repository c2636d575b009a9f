"""vlmgen's C++ Qwen2-VL from Python: the same tokens as from C++ (vlmgen-generate), and as the
plain-PyTorch model on the same weights."""

import os
import re
import subprocess

import pytest

import vlmgen
from conftest import tool
from torch_qwen2_vl import IMAGE, VISION_END, VISION_START, TorchQwen2VL

IMAGE_FILE = os.path.join(os.path.dirname(__file__), "..", "text", "data", "gradient.png")
MIN_PIXELS, MAX_PIXELS = 256, 1024
NEW_TOKENS = 10


def cli_tokens(checkpoint, kv_cache):
    args = [tool("VLMGEN_GENERATE"), "--checkpoint", checkpoint, "--prompt", "1 2 3 <image> 4 5", "--image",
            IMAGE_FILE, "--max-pixels", str(MAX_PIXELS), "--min-pixels", str(MIN_PIXELS), "--max-new-tokens", str(NEW_TOKENS),
            "--temperature", "1.0", "--seed", "7"]
    if not kv_cache:
        args.append("--no-kv-cache")
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout
    match = re.search(r"^tokens:([ 0-9]*)$", out, re.M)
    assert match, out
    return [int(t) for t in match.group(1).split()]


@pytest.mark.parametrize("kv_cache", [True, False])
def test_the_cpp_model_gives_the_same_tokens_from_python_as_from_cpp(checkpoint, kv_cache):
    model = vlmgen.load_model(checkpoint)
    assert isinstance(model, vlmgen.Model)
    vision = vlmgen.preprocess_images([IMAGE_FILE], checkpoint=checkpoint, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    (count,) = model.placeholder_counts(vision)
    prompt = [1, 2, 3, VISION_START] + [IMAGE] * count + [VISION_END, 4, 5]
    # Sampled (the tiny random model's greedy path settles on one token at once), seeded.
    config = vlmgen.GenerationConfig(max_new_tokens=NEW_TOKENS, enable_kv_cache=kv_cache, temperature=1.0, seed=7,
                                     prompt_logprobs=True)
    from_python = vlmgen.Generator(model).generate([prompt], config, vision=vision)
    assert from_python.sequences[0].finish_reason == "length"
    assert len(set(from_python.tokens[0])) > 3
    assert from_python.tokens[0] == cli_tokens(checkpoint, kv_cache)
    # And the plain-PyTorch transcription of HF on the same weights agrees.
    torch_model = vlmgen.Generator(TorchQwen2VL(kv_cache=kv_cache)).generate([prompt], config, vision=vision)
    assert torch_model.tokens == from_python.tokens
    assert torch_model.sequences[0].prompt_logprobs[1:] == pytest.approx(
        from_python.sequences[0].prompt_logprobs[1:], abs=1e-4)


def test_a_python_model_may_delegate_to_a_cpp_model_kv_cache_included(checkpoint):
    model = vlmgen.load_model(checkpoint)
    vision = vlmgen.preprocess_images([IMAGE_FILE], checkpoint=checkpoint, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    (count,) = model.placeholder_counts(vision)
    prompt = [5, VISION_START] + [IMAGE] * count + [VISION_END, 6]
    config = vlmgen.GenerationConfig(max_new_tokens=NEW_TOKENS, return_logprobs=True)
    direct = vlmgen.Generator(model).generate([prompt], config, vision=vision)
    spy = vlmgen.testing.ForwardSpy(vlmgen.testing.DelegatingModel(model))
    wrapped = vlmgen.Generator(spy).generate([prompt], config, vision=vision)
    assert wrapped.tokens == direct.tokens
    assert wrapped.sequences[0].logprobs == pytest.approx(direct.sequences[0].logprobs, abs=1e-6)
    assert [c.window_size for c in spy.calls] == [len(prompt)] + [1] * (NEW_TOKENS - 1)


def test_load_model_keeps_16_bit_weights_when_asked_and_refuses_unknown_dtypes(checkpoint):
    # The same values in bfloat16 and float32 give the same greedy tokens (float32 compute both).
    wide = vlmgen.load_model(checkpoint)
    vision = vlmgen.preprocess_images([IMAGE_FILE], checkpoint=checkpoint, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    (count,) = wide.placeholder_counts(vision)
    prompt = [1, 2, VISION_START] + [IMAGE] * count + [VISION_END, 3]
    config = vlmgen.GenerationConfig(max_new_tokens=NEW_TOKENS, return_logprobs=True)
    f32 = vlmgen.Generator(wide).generate([prompt], config, vision=vision)
    bf16 = vlmgen.Generator(vlmgen.load_model(checkpoint, dtype="bf16")).generate([prompt], config, vision=vision)
    # The tiny checkpoint's weights are float32: bfloat16 rounds them, so the first step's
    # log-prob moves a little (later steps may follow another token).
    assert bf16.tokens[0][0] == f32.tokens[0][0]
    assert bf16.sequences[0].logprobs[0] == pytest.approx(f32.sequences[0].logprobs[0], abs=0.05)
    assert bf16.sequences[0].logprobs[0] != f32.sequences[0].logprobs[0]  # the weights did change
    # Where the weights live changes nothing of what the model computes.
    plain = vlmgen.Generator(vlmgen.load_model(checkpoint, huge_pages=False)).generate([prompt], config, vision=vision)
    assert plain.tokens == f32.tokens and plain.sequences[0].logprobs == f32.sequences[0].logprobs
    with pytest.raises(vlmgen.Error, match="f32, bf16, f16 or fp8, got 'int4'"):
        vlmgen.load_model(checkpoint, dtype="int4")
    with pytest.raises(vlmgen.Error, match="is not FP8"):  # fp8 needs an FP8 checkpoint
        vlmgen.load_model(checkpoint, dtype="fp8")
    with pytest.raises(vlmgen.Error, match="'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        vlmgen.load_model(checkpoint, device="gpu")
    assert vlmgen.load_model(checkpoint, device="cpu").device == "cpu"


def test_load_model_with_a_bfloat16_kv_cache(checkpoint):
    # The model's caches store bfloat16 (half the bytes); its first step (the prompt, written to the
    # cache and read back rounded) stays near the float32 cache's log-prob but is not the same.
    vision = vlmgen.preprocess_images([IMAGE_FILE], checkpoint=checkpoint, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    wide = vlmgen.load_model(checkpoint)
    half = vlmgen.load_model(checkpoint, kv_cache_dtype="bf16")
    assert wide.traits.kv_cache.dtype == "float32" and half.traits.kv_cache.dtype == "bfloat16"
    (count,) = half.placeholder_counts(vision)
    prompt = [1, 2, VISION_START] + [IMAGE] * count + [VISION_END, 3]
    config = vlmgen.GenerationConfig(max_new_tokens=NEW_TOKENS, return_logprobs=True)
    f32 = vlmgen.Generator(wide).generate([prompt], config, vision=vision)
    bf16 = vlmgen.Generator(half).generate([prompt], config, vision=vision)
    assert bf16.tokens[0][0] == f32.tokens[0][0]
    assert bf16.sequences[0].logprobs[0] == pytest.approx(f32.sequences[0].logprobs[0], abs=0.05)
    assert bf16.sequences[0].logprobs[0] != f32.sequences[0].logprobs[0]
    # An FP8 cache: E4M3 bytes and a float32 scale per key or value row, through the same generator.
    quarter = vlmgen.load_model(checkpoint, kv_cache_dtype="fp8")
    assert quarter.traits.kv_cache.dtype == "fp8"
    fp8 = vlmgen.Generator(quarter).generate([prompt], config, vision=vision)
    assert 1 <= len(fp8.tokens[0]) <= NEW_TOKENS
    assert fp8.sequences[0].logprobs[0] != f32.sequences[0].logprobs[0]
    with pytest.raises(vlmgen.Error, match="KV cache dtype must be f32, bf16 or fp8, got 'f16'"):
        vlmgen.load_model(checkpoint, kv_cache_dtype="f16")
