"""Decode speed and time to first token on a GPU: vlmgen (bf16) against transformers' generate (bf16,
same config and weights), side by side in one run.

One random Qwen2-VL checkpoint of Qwen2-VL-2B's shape (or a small one, --small) is written by
transformers and loaded by both. Figures, each the median of --rounds interleaved rounds after a
warm-up:
- batch 1, a 448x448 image (1024 patches, 256 placeholder tokens) and text: time to first token
  (vision tower + prefill + first token), and decode tokens/s over --new-tokens tokens;
- batch 16 text rows: total decode tokens/s.
transformers runs with its dynamic cache and, when this version has it, its static cache.
Target (issue 14): vlmgen >= 2x transformers' decode tokens/s at batch 1.

--vlmgen-only (a dry run without transformers): the checkpoint comes from
vlmgen-make-tiny-checkpoint (--tools) and only vlmgen's figures are printed.

    PYTHONPATH=build/python python3 bench/gpu_speed.py --device cuda:0 --json out/speed.json
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import vlmgen

QWEN2_VL_2B = dict(
    model_type="qwen2_vl", architectures=["Qwen2VLForConditionalGeneration"], hidden_size=1536,
    intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=True, image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
    vision_end_token_id=151653, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
    vision_config=dict(depth=32, embed_dim=1280, hidden_size=1536, hidden_act="quick_gelu", mlp_ratio=4,
                       num_heads=16, in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2))
SMALL = dict(QWEN2_VL_2B, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vision_config=dict(QWEN2_VL_2B["vision_config"], depth=2, embed_dim=128,
                                                       hidden_size=256, num_heads=2))


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def image_inputs(config, pixels_side):
    vc = config["vision_config"]
    side = pixels_side // vc["patch_size"]  # 448 // 14: 32 patches a side
    patches = side * side
    pixels = torch.randn(patches, 3 * vc["temporal_patch_size"] * vc["patch_size"] ** 2,
                         generator=torch.Generator().manual_seed(1))
    placeholders = patches // vc["spatial_merge_size"] ** 2
    prompt = [151644, 872, 198] if config["vocab_size"] > 151644 else [3, 4, 5]
    prompt = prompt + [config["vision_start_token_id"]] + [config["image_token_id"]] * placeholders + \
        [config["vision_end_token_id"]] + [i % 1000 + 100 for i in range(24)]
    return prompt, pixels, torch.tensor([[1, side, side]])


def text_rows(batch, length=32):
    return [[(13 * r + 7 * i) % 5000 + 100 for i in range(length)] for r in range(batch)]


def write_checkpoint(directory, config, device, tools, vlmgen_only):
    if vlmgen_only:
        subprocess.run([os.path.join(tools, "vlmgen-make-tiny-checkpoint"), "--out", directory, "--real-vocab"],
                       check=True, stdout=subprocess.DEVNULL)
        return json.load(open(os.path.join(directory, "config.json")))
    import transformers
    hf_config = transformers.Qwen2VLConfig(**config)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2VLForConditionalGeneration(hf_config).to(torch.bfloat16)
    model.save_pretrained(directory)
    del model
    return json.load(open(os.path.join(directory, "config.json"))) | {k: config[k] for k in (
        "image_token_id", "vision_start_token_id", "vision_end_token_id", "vocab_size", "vision_config")}


class Vlmgen:
    name = "vlmgen"

    def __init__(self, directory, device):
        self.model = vlmgen.load_model(directory, dtype="bf16", device=device)
        self.device = device

    def run(self, rows, pixels, grid, new_tokens):
        vision = vlmgen.VisionInputs(pixels.to(self.device), grid.to(self.device)) if pixels is not None else None
        config = vlmgen.GenerationConfig(max_new_tokens=new_tokens, end_token_ids=[])
        result = vlmgen.Generator(self.model).generate(rows, config, vision=vision)
        assert all(len(s.tokens) == new_tokens for s in result.sequences)
        return result.stats.time_to_first_token_s, result.stats.decode_tokens_per_s


class Transformers:
    """transformers' generate on one loaded model, with its dynamic cache or its static one."""

    def __init__(self, model, device, static):
        self.model = model
        self.device = device
        self.static = static
        self.name = "transformers" + (" (static cache)" if static else "")

    @staticmethod
    def load(directory, device):
        import transformers
        return transformers.Qwen2VLForConditionalGeneration.from_pretrained(
            directory, dtype=torch.bfloat16).to(device).eval()

    def generate(self, rows, pixels, grid, new_tokens):
        ids = torch.tensor(rows, device=self.device)
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if pixels is not None:
            kwargs.update(pixel_values=pixels.to(self.device, torch.bfloat16), image_grid_thw=grid.to(self.device))
        if self.static:
            # Without disable_compile a static cache compiles the model for every new shape:
            # minutes of compiling inside the timed runs.
            kwargs.update(cache_implementation="static", disable_compile=True)
        sync(self.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(**kwargs)
        sync(self.device)
        assert out.shape[1] == ids.shape[1] + new_tokens
        return time.perf_counter() - start

    def run(self, rows, pixels, grid, new_tokens):
        first = self.generate(rows, pixels, grid, 1)
        total = self.generate(rows, pixels, grid, new_tokens)
        return first, len(rows) * (new_tokens - 1) / max(total - first, 1e-9)


def table_of(args, figures):
    where = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU (dry run)"
    table = ["", f"| {where}, bf16, {'small' if args.small else 'Qwen2-VL-2B shape'}, {args.new_tokens} new tokens, "
                 f"median of {args.rounds} | time to first token | decode tok/s | vlmgen / this |",
             "| --- | --- | --- | --- |"]
    for (case, name), (ttft, rate) in figures.items():
        ours = figures.get((case, "vlmgen"), (0.0, float("nan")))[1]
        table.append(f"| {case}: {name} | {ttft * 1e3:.1f} ms | {rate:.1f} | "
                     f"{ours / rate if rate else float('nan'):.2f}x |")
    return table


def write_json(args, figures):
    """Written after every figure, so that a run stopped at its deadline keeps what it measured."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"table": table_of(args, figures), "torch": torch.__version__,
                       "figures": {f"{c} | {n}": v for (c, n), v in figures.items()}}, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--small", action="store_true", help="a small model (dry runs)")
    parser.add_argument("--image-side", type=int, default=448, help="the image's side in pixels")
    parser.add_argument("--vlmgen-only", action="store_true", help="no transformers")
    parser.add_argument("--tools", default="build/examples", help="vlmgen-make-tiny-checkpoint's folder")
    args = parser.parse_args()
    if args.vlmgen_only:
        args.new_tokens = min(args.new_tokens, 16)
        args.image_side = min(args.image_side, 64)

    config = SMALL if args.small else QWEN2_VL_2B
    with tempfile.TemporaryDirectory() as directory:
        t0 = time.perf_counter()
        config = write_checkpoint(directory, config, args.device, args.tools, args.vlmgen_only)
        print(f"checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
        engines = [Vlmgen(directory, args.device)]
        if not args.vlmgen_only:
            hf = Transformers.load(directory, args.device)
            engines.append(Transformers(hf, args.device, static=False))
            try:
                static = Transformers(hf, args.device, static=True)
                static.run(text_rows(1), None, None, 4)
                engines.append(static)
            except Exception as e:  # this version has no static cache for the model
                print(f"note: transformers' static cache did not run: {e}")
        prompt, pixels, grid = image_inputs(config, args.image_side)
        cases = [(f"batch 1, {args.image_side}x{args.image_side} image", [prompt], pixels, grid),
                 ("batch 16, text", text_rows(16), None, None)]
        figures = {}
        for case, rows, px, g in cases:
            live = []
            for engine in engines:  # warm-up; an engine that fails here is left out of this case
                try:
                    engine.run(rows, px, g, 4)
                    live.append(engine)
                except Exception as e:
                    print(f"FAILED {case}: {engine.name}: {e}", flush=True)
            samples = {engine.name: [] for engine in live}
            for _ in range(args.rounds):
                for engine in live:
                    try:
                        samples[engine.name].append(engine.run(rows, px, g, args.new_tokens))
                    except Exception as e:
                        print(f"FAILED {case}: {engine.name}: {e}", flush=True)
            for name, runs in samples.items():
                if not runs:
                    continue
                figures[(case, name)] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
                print(f"{case:24s} {name:30s} TTFT {figures[(case, name)][0] * 1e3:8.1f} ms   decode "
                      f"{figures[(case, name)][1]:9.1f} tok/s   rounds {[round(r[1], 1) for r in runs]}", flush=True)
                write_json(args, figures)

    write_json(args, figures)
    for line in table_of(args, figures):
        print(line)
    first = cases[0][0]
    if (first, "vlmgen") not in figures or (not args.vlmgen_only and (first, "transformers") not in figures):
        print("FAILED: the batch-1 figures are incomplete")
        return 1
    if not args.vlmgen_only:
        ratio = figures[(first, "vlmgen")][1] / figures[(first, "transformers")][1]
        print(f"batch-1 decode: vlmgen / transformers = {ratio:.2f}x (target >= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
