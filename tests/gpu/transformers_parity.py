"""Parity of vlmgen against HF transformers' own model classes, on random checkpoints vlmgen writes.

For each Qwen-VL family that the installed transformers has (Qwen2VLForConditionalGeneration, and
Qwen2_5_VL / Qwen3VL when present), vlmgen-make-tiny-checkpoint writes a random checkpoint; both
libraries load it and run the same prompt (text, an image's placeholders, text; a second row
left-padded) with the same pixel_values:

- fp32 on the CPU: every real column's logits within 1e-4 of transformers', and 12 greedy tokens
  equal (vlmgen's Generator against transformers' generate);
- bf16 on the device (--device cuda:0): both libraries' bf16 logits are compared with the fp32
  reference. bf16 keeps 8 significant bits, so each library is off by rounding that depends on
  where it keeps bf16 (transformers: the whole residual stream; vlmgen: the linears' inputs and
  weights, a float32 stream). The bound: vlmgen's worst error at most 1.5x transformers' own
  plus 1e-3, and at most 2% of the largest |logit|, i.e. no worse than the reference library in
  the same dtype.

Prints a line per check and writes --json. Exit status 1 when any check fails or transformers is
missing (the GPU check must not pass by skipping). --vlmgen-only runs vlmgen's half (for a dry
run on a machine without transformers): it loads each checkpoint and checks fp32 logits and
greedy tokens with and without a KV cache against each other.

    PYTHONPATH=build/python python3 tests/gpu/transformers_parity.py --tools build/examples \\
        --device cuda:0 --json out/parity.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

import vlmgen

FAMILIES = [
    ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
]
NEW_TOKENS = 12


class Capture:
    """A Python model around a vlmgen.Model that keeps the logits of each forward call."""

    def __init__(self, model):
        self.model = model
        self.traits = model.traits
        self.device = model.device
        self.logits = []

    def plan_positions(self, input_ids, attention_mask, vision):
        return self.model.plan_positions(input_ids, attention_mask, vision)

    def forward(self, args):
        out = self.model.forward(args)
        self.logits.append(out.detach().float().cpu())
        return out


def inputs_for(config, seed):
    """Two rows (the second shorter, left-padded), an image in the first, its pixel_values."""
    vision_cfg = config["vision_config"]
    merge = vision_cfg.get("spatial_merge_size", 2)
    patch = vision_cfg["patch_size"]
    temporal = vision_cfg.get("temporal_patch_size", 2)
    channels = vision_cfg.get("in_chans", vision_cfg.get("in_channels", 3))
    grid = [1, 2 * merge, 3 * merge]
    placeholders = grid[0] * grid[1] * grid[2] // (merge * merge)
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(grid[0] * grid[1] * grid[2], channels * temporal * patch * patch, generator=gen)
    vocab_text = min(config["vision_start_token_id"], config["image_token_id"]) - 1
    text = lambda n, k: [(7 * i + k) % vocab_text + 1 for i in range(n)]
    first = text(5, 1) + [config["vision_start_token_id"]] + [config["image_token_id"]] * placeholders + \
        [config["vision_end_token_id"]] + text(4, 2)
    second = text(7, 3)
    return [first, second], pixels, torch.tensor([grid])


def padded(rows):
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, length - len(r):] = torch.tensor(r)
        mask[i, length - len(r):] = 1
    return ids, mask


def vlmgen_logits(directory, dtype, device, rows, pixels, grid):
    """Every prompt column's logits [B, L, vocab] (float32, CPU) from one no-cache call."""
    capture = Capture(vlmgen.load_model(directory, dtype=dtype, device=device))
    vision = vlmgen.VisionInputs(pixels.to(device), grid.to(device))
    config = vlmgen.GenerationConfig(max_new_tokens=1, enable_kv_cache=False, full_logits=True)
    vlmgen.Generator(capture).generate(rows, config, vision=vision)
    return capture.logits[0]


def vlmgen_tokens(directory, rows, pixels, grid, kv=True):
    model = vlmgen.load_model(directory)
    config = vlmgen.GenerationConfig(max_new_tokens=NEW_TOKENS, enable_kv_cache=kv)
    result = vlmgen.Generator(model).generate(rows, config, vision=vlmgen.VisionInputs(pixels, grid))
    return [list(s.tokens) for s in result.sequences]


def worst_real(a, b, mask):
    real = mask.bool().unsqueeze(-1)
    return float((a - b).abs().masked_fill(~real, 0).max())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tools", required=True, help="folder with vlmgen-make-tiny-checkpoint")
    parser.add_argument("--device", default="cpu", help="device of the bf16 comparison (cuda:0 on a GPU)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--vlmgen-only", action="store_true", help="no transformers: vlmgen's half only")
    args = parser.parse_args()

    transformers = None
    if not args.vlmgen_only:
        try:
            import transformers
        except ImportError as e:
            print(f"FAILED: transformers is not importable ({e}); the parity check needs it")
            return 1
        print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    results = []
    failed = 0

    def check(name, ok, detail):
        nonlocal failed
        failed += 0 if ok else 1
        results.append({"check": name, "ok": bool(ok), **detail})
        print(("PASS " if ok else "FAILED ") + name + " " + json.dumps(detail))

    with tempfile.TemporaryDirectory() as scratch:
        for family, class_name in FAMILIES:
            hf_class = getattr(transformers, class_name, None) if transformers else None
            if transformers and hf_class is None:
                print(f"note: transformers {transformers.__version__} has no {class_name}; {family} not compared")
                continue
            directory = os.path.join(scratch, family)
            subprocess.run([os.path.join(args.tools, "vlmgen-make-tiny-checkpoint"), "--out", directory, "--family",
                            family, "--seed", "3"], check=True, stdout=subprocess.DEVNULL)
            config = json.load(open(os.path.join(directory, "config.json")))
            rows, pixels, grid = inputs_for(config, seed=11)
            ids, mask = padded(rows)
            ours = vlmgen_logits(directory, "f32", "cpu", rows, pixels, grid)
            tokens = vlmgen_tokens(directory, rows, pixels, grid)
            if hf_class is None:
                check(f"{family}: vlmgen greedy tokens with and without a KV cache",
                      tokens == vlmgen_tokens(directory, rows, pixels, grid, kv=False), {"tokens": tokens[0]})
                bf16 = vlmgen_logits(directory, "bf16", args.device, rows, pixels, grid)
                scale = float(ours.abs().max())
                check(f"{family}: vlmgen bf16 on {args.device} within 2% of its fp32 logits",
                      worst_real(bf16, ours, mask) <= 0.02 * scale,
                      {"relative": worst_real(bf16, ours, mask) / scale})
                continue

            hf = hf_class.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
            with torch.no_grad():
                theirs = hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid).logits
            diff = worst_real(ours, theirs.float(), mask)
            check(f"{family}: fp32 logits on the CPU within 1e-4 of transformers", diff <= 1e-4, {"max_abs": diff})
            with torch.no_grad():
                generated = hf.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grid,
                                        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                        pad_token_id=0,
                                        # vlmgen never chooses the image/video placeholder ids
                                        suppress_tokens=[config["image_token_id"], config["video_token_id"]])
            theirs_tokens = [r[ids.shape[1]:].tolist() for r in generated]
            check(f"{family}: {NEW_TOKENS} greedy tokens equal transformers' generate (fp32)", tokens == theirs_tokens,
                  {"vlmgen": tokens, "transformers": theirs_tokens})

            # bf16 on the device, both against the fp32 reference.
            reference = theirs.float()
            hf16 = hf_class.from_pretrained(directory, dtype=torch.bfloat16).to(args.device).eval()
            with torch.no_grad():
                theirs16 = hf16(input_ids=ids.to(args.device), attention_mask=mask.to(args.device),
                                pixel_values=pixels.to(args.device, torch.bfloat16),
                                image_grid_thw=grid.to(args.device)).logits.float().cpu()
            ours16 = vlmgen_logits(directory, "bf16", args.device, rows, pixels, grid)
            err_ours = worst_real(ours16, reference, mask)
            err_theirs = worst_real(theirs16, reference, mask)
            scale = float(reference.abs().max())
            check(f"{family}: bf16 on {args.device} no worse than transformers' bf16 (vs fp32)",
                  err_ours <= 1.5 * err_theirs + 1e-3 and err_ours <= 0.02 * scale,
                  {"vlmgen_max_abs": err_ours, "transformers_max_abs": err_theirs, "max_logit": scale})
            del hf, hf16

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "failed": failed}, f, indent=1)
    if not results:
        print("FAILED: nothing was compared")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
