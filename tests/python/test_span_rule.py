"""The seeds' A/B in Python: a plain-PyTorch Qwen2-VL driven by vlmgen.Generator."""

import vlmgen
from torch_qwen2_vl import TorchQwen2VL, image_prompt, ref, vision_for

GRIDS = [(1, 4, 4), (1, 4, 8)]
# Two rows of different lengths (the shorter is left-padded), one image each.
PROMPTS = [image_prompt([1, 2, 3], GRIDS[0], [4, 5]), image_prompt([7], GRIDS[1], [8, 9, 10])]
NEW_TOKENS = 6


def prompt_drift(calls, prompt_columns):
    """Largest change of the prompt tokens' logits between the first call and any later one
    (padding columns, which attend to nothing, are left out)."""
    drift = 0.0
    for row, prompt in enumerate(PROMPTS):
        real = slice(prompt_columns - len(prompt), prompt_columns)
        first = calls[0].logits[row, real]
        drift = max([drift] + [float((c.logits[row, real] - first).abs().max()) for c in calls[1:]])
    return drift


def run_no_cache(replay_mode):
    spy = vlmgen.testing.ForwardSpy(TorchQwen2VL(kv_cache=False), record_tensors=True)
    config = vlmgen.GenerationConfig(max_new_tokens=NEW_TOKENS, enable_kv_cache=False, replay_mode=replay_mode)
    result = vlmgen.Generator(spy).generate(PROMPTS, config, vision=vision_for(GRIDS))
    return result, spy.calls


def test_without_a_kv_cache_every_recompute_gets_the_images_and_the_prompt_logits_do_not_move():
    result, calls = run_no_cache("span_aware")
    assert not result.stats.used_kv_cache
    assert len(calls) == NEW_TOKENS
    prompt_columns = max(len(p) for p in PROMPTS)
    for call in calls:
        assert call.window_start == 0 and call.had_context is False
        assert call.has_pixel_values(), repr(call)
        assert call.image_grid_thw_shape == [2, 3] and call.images == [0, 1]
    assert prompt_drift(calls, prompt_columns) <= 1e-5

    kv_spy = vlmgen.testing.ForwardSpy(TorchQwen2VL(kv_cache=True))
    with_cache = vlmgen.Generator(kv_spy).generate(
        PROMPTS, vlmgen.GenerationConfig(max_new_tokens=NEW_TOKENS), vision=vision_for(GRIDS))
    assert with_cache.stats.used_kv_cache
    assert with_cache.tokens == result.tokens


def test_under_the_step_zero_gate_the_recomputes_lose_the_images_and_the_prompt_drifts():
    result, calls = run_no_cache("step_zero")
    assert calls[0].has_pixel_values()
    assert not any(c.has_any_vision() for c in calls[1:])
    prompt_columns = max(len(p) for p in PROMPTS)
    # The placeholders' hidden states change once the image embeddings are gone: far above the
    # 1e-5 of the span rule (the tiny model's logits are of order 1).
    assert prompt_drift(calls, prompt_columns) > 1e-2


def test_a_model_with_its_own_kv_cache_gets_the_images_at_prefill_only_and_equals_no_cache():
    model = TorchQwen2VL(kv_cache=True)
    spy = vlmgen.testing.ForwardSpy(model)
    result = vlmgen.Generator(spy).generate(
        PROMPTS, vlmgen.GenerationConfig(max_new_tokens=NEW_TOKENS), vision=vision_for(GRIDS))
    calls = spy.calls
    assert calls[0].had_context and calls[0].context_length == 0 and calls[0].has_pixel_values()
    for call in calls[1:]:
        assert call.had_context and call.window_size == 1 and not call.has_any_vision(), repr(call)
    assert model.calls_with_pixels == 1
    no_cache, _ = run_no_cache("span_aware")
    assert result.tokens == no_cache.tokens


def test_a_cached_text_turn_then_an_image_turn_sends_the_new_image():
    """The seeds' second report: a cached prefix, then a turn whose image arrives after it."""
    model = TorchQwen2VL(kv_cache=True)
    spy = vlmgen.testing.ForwardSpy(model)
    generator = vlmgen.Generator(spy)
    context = vlmgen.InferenceContext.for_model(model, batch=1, capacity=128)
    system = [1, 2, 3, 4]
    first = generator.generate([system], vlmgen.GenerationConfig(max_new_tokens=0), context=context)
    assert first.tokens == [[]] and context.length == len(system)
    spy.clear()
    turn = image_prompt(system + [5], GRIDS[0], [6])
    vision = vision_for(GRIDS[:1])
    cached = generator.generate([turn], vlmgen.GenerationConfig(max_new_tokens=4), vision=vision, context=context)
    assert spy.calls[0].window_start == len(system) and spy.calls[0].has_pixel_values()
    fresh = vlmgen.Generator(TorchQwen2VL(kv_cache=False)).generate(
        [turn], vlmgen.GenerationConfig(max_new_tokens=4, enable_kv_cache=False), vision=vision)
    assert cached.tokens == fresh.tokens


class Encoding(TorchQwen2VL):
    """The same model with its vision tower behind encode_images: the generator encodes each image
    once per request and hands the rows to every call whose window holds the image."""

    def __init__(self, kv_cache=False):
        super().__init__(kv_cache)
        self.images_encoded = 0

    def encode_images(self, vision):
        self.images_encoded += vision.num_images
        return ref.vision_tower(vision.pixel_values, vision.image_grid_thw)

    def forward(self, args):
        assert args.pixel_values is None or args.image_embeddings is None
        if args.image_embeddings is None:
            return super().forward(args)
        kv = args.context.append_kv if args.context is not None else None
        return ref.lm(args.input_ids, args.attention_mask, args.position_ids, args.image_embeddings, kv=kv)


def test_a_python_encode_images_feeds_every_recompute_from_the_encoder_cache():
    model = Encoding(kv_cache=False)
    spy = vlmgen.testing.ForwardSpy(model)
    config = vlmgen.GenerationConfig(max_new_tokens=NEW_TOKENS, enable_kv_cache=False)
    result = vlmgen.Generator(spy).generate(PROMPTS, config, vision=vision_for(GRIDS))
    assert model.images_encoded == 2 and result.stats.images_encoded == 2
    for call in spy.calls:
        assert call.image_embeddings_shape == [4 + 8, 64] and not call.has_pixel_values(), repr(call)
    plain, _ = run_no_cache("span_aware")
    assert result.tokens == plain.tokens
    off = vlmgen.Generator(Encoding()).generate(
        PROMPTS, vlmgen.GenerationConfig(max_new_tokens=NEW_TOKENS, enable_kv_cache=False, encoder_cache=False),
        vision=vision_for(GRIDS))
    assert off.stats.images_encoded == 0 and off.tokens == plain.tokens
