#!/usr/bin/python3
"""Image time-to-first-token: vlmgen against PyTorch eager on the same weights, side by side.

    PYTHONPATH=build/python /usr/bin/python3 bench/image_ttft.py [--build build] [--rounds 5]
        [--threads 1] [--image-size 448] [--text 16] [--checkpoint DIR] [--json out.json]

The model is the bench's 100M Qwen2-VL (`vlmgen-bench --write-checkpoint DIR`, written into a
temporary folder unless --checkpoint names one that exists). The peer is the project's
independent PyTorch transcription of HF's modeling_qwen2_vl in eager mode
(tests/model/reference/qwen2_vl_reference.py: Conv3d patch embedding, vision attention with the
per-image mask, PatchMerger, get_rope_index, the decoder with repeat_kv and a 4-D causal mask),
given the checkpoint's tensors. Both engines get the same preprocessed picture (a gradient of
--image-size squared pixels through vlmgen.preprocess_images, outside the timing) and the same
prompt (--text tokens, the image, --text tokens) and produce one greedy token: vlmgen through
Generator.generate(max_new_tokens=1), the peer through vision tower + positions + prefill +
argmax of the last column, under torch.inference_mode. One process, one LibTorch, the same thread
count (torch.set_num_threads). Rounds alternate which engine goes first; the table gives medians
of the rounds and vlmgen / eager. The first tokens must agree (the script fails otherwise).
"""

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib

# OpenBLAS sizes its thread pool when it loads (with torch), so --threads must reach it first;
# torch.set_num_threads alone leaves its products on every core.
for _i, _a in enumerate(sys.argv):
    if _a.startswith("--threads"):
        _n = _a.split("=", 1)[1] if "=" in _a else (sys.argv[_i + 1] if _i + 1 < len(sys.argv) else "")
        if _n.isdigit():
            os.environ["OPENBLAS_NUM_THREADS"] = _n
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "model", "reference"))
import qwen2_vl_reference as ref  # noqa: E402,I100

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def say(msg):
    print(f"[image-ttft] {msg}", file=sys.stderr, flush=True)


def read_safetensors(path):
    """Every tensor of one safetensors file (F32/F16/BF16) as float32."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in DTYPES:
            raise SystemExit(f"{path}: tensor {name} has dtype {meta['dtype']}; F32, F16 or BF16 expected")
        begin, end = meta["data_offsets"]
        t = torch.frombuffer(bytearray(data[base + begin:base + end]), dtype=DTYPES[meta["dtype"]])
        out[name] = t.reshape(meta["shape"]).float()
    return out


def configure_reference(checkpoint):
    """Points the reference transcription at the checkpoint: its sizes and its tensors."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        cfg = json.load(f)
    v = cfg["vision_config"]
    ref.C.update(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
                 kv_heads=cfg["num_key_value_heads"], head_dim=cfg.get("head_dim", cfg["hidden_size"] //
                                                                     cfg["num_attention_heads"]),
                 inter=cfg["intermediate_size"], eps=cfg["rms_norm_eps"], theta=cfg["rope_theta"],
                 mrope=cfg["rope_scaling"]["mrope_section"], vocab=cfg["vocab_size"], image=cfg["image_token_id"],
                 vs=cfg["vision_start_token_id"], ve=cfg["vision_end_token_id"])
    ref.V.update(depth=v["depth"], embed=v["embed_dim"], heads=v["num_heads"], ratio=v["mlp_ratio"],
                 ch=v["in_chans"], patch=v["patch_size"], tp=v["temporal_patch_size"], merge=v["spatial_merge_size"])
    ref.E, ref.m = ref.V["embed"], ref.V["merge"]
    ref.H, ref.hd = ref.C["hidden"], ref.C["head_dim"]
    ref.W.clear()
    for name in sorted(os.listdir(checkpoint)):
        if name.endswith(".safetensors"):
            ref.W.update(read_safetensors(os.path.join(checkpoint, name)))
    if "lm_head.weight" not in ref.W:  # tied
        ref.W["lm_head.weight"] = ref.W["model.embed_tokens.weight"]
    return cfg


def write_png(path, size):
    """An RGB gradient of size x size pixels."""
    rows = []
    for y in range(size):
        row = bytearray([0])
        for x in range(size):
            row += bytes(((x * 255) // size, (y * 255) // size, ((x + y) * 127) // size))
        rows.append(bytes(row))
    def chunk(kind, payload):
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)


def eager_first_token(ids, vision):
    with torch.inference_mode():
        embeds = ref.vision_tower(vision.pixel_values, vision.image_grid_thw)
        mask = torch.ones_like(ids)
        positions, _ = ref.get_rope_index(ids, vision.image_grid_thw, mask)
        logits = ref.lm(ids, mask, positions, embeds)
        return int(logits[0, -1].argmax())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--text", type=int, default=16, help="text tokens before and after the image")
    ap.add_argument("--checkpoint", help="the bench's checkpoint folder (written when missing)")
    ap.add_argument("--json", help="per-round times and medians")
    args = ap.parse_args()
    if args.rounds < 1 or args.threads < 1 or args.image_size < 28 or args.text < 0:
        raise SystemExit("--rounds and --threads must be >= 1, --image-size >= 28, --text >= 0")
    sys.path.insert(0, os.path.join(args.build, "python"))
    import vlmgen

    torch.set_num_threads(args.threads)
    scratch = tempfile.mkdtemp(prefix="vlmgen-ttft-")
    checkpoint = args.checkpoint or os.path.join(scratch, "bench100m")
    if not os.path.exists(os.path.join(checkpoint, "config.json")):
        say(f"writing the bench's checkpoint to {checkpoint}")
        subprocess.run([os.path.join(args.build, "bench", "vlmgen-bench"), "--write-checkpoint", checkpoint],
                       check=True, stdout=subprocess.DEVNULL)
    cfg = configure_reference(checkpoint)
    image = os.path.join(scratch, "gradient.png")
    write_png(image, args.image_size)
    model = vlmgen.load_model(checkpoint)
    vision = vlmgen.preprocess_images([image], checkpoint=checkpoint)
    (count,) = model.placeholder_counts(vision)
    text = [(37 * i + 11) % 15000 + 1 for i in range(2 * args.text)]
    prompt = text[:args.text] + [cfg["vision_start_token_id"]] + [cfg["image_token_id"]] * count + \
        [cfg["vision_end_token_id"]] + text[args.text:]
    ids = torch.tensor([prompt], dtype=torch.long)
    generator = vlmgen.Generator(model)
    config = vlmgen.GenerationConfig(max_new_tokens=1)

    def run_vlmgen():
        return generator.generate([prompt], config, vision=vision).tokens[0][0]

    engines = {"vlmgen": run_vlmgen, "eager": lambda: eager_first_token(ids, vision)}
    say(f"{args.image_size}x{args.image_size} image: grid {vision.image_grid_thw.tolist()[0]}, {count} image tokens, "
        f"prompt {len(prompt)} tokens, {args.threads} thread(s); warm-up")
    first = {name: run() for name, run in engines.items()}
    if first["vlmgen"] != first["eager"]:
        raise SystemExit(f"first tokens differ: vlmgen {first['vlmgen']}, eager {first['eager']}")
    times = {name: [] for name in engines}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            t = time.perf_counter()
            token = engines[name]()
            times[name].append(time.perf_counter() - t)
            if token != first[name]:
                raise SystemExit(f"{name} gave token {token} in round {r + 1}, {first[name]} before")
        say(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in engines))
    med = {name: statistics.median(v) for name, v in times.items()}
    load = os.getloadavg()[0]
    print(f"| image time to first token ({args.image_size}x{args.image_size}, {len(prompt)}-token prompt, "
          f"{args.threads} thread(s)) | vlmgen | PyTorch eager | vlmgen / eager |")
    print("| --- | --- | --- | --- |")
    print(f"| seconds, median of {args.rounds} | {med['vlmgen']:.3f} | {med['eager']:.3f} | "
          f"{med['vlmgen'] / med['eager']:.2f}x |")
    print(f"first token {first['vlmgen']} from both; load average {load:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"image_size": args.image_size, "prompt_tokens": len(prompt), "image_tokens": count,
                       "threads": args.threads, "seconds": times, "medians": med,
                       "ratio": med["vlmgen"] / med["eager"], "first_token": first["vlmgen"], "load": load}, f, indent=1)


if __name__ == "__main__":
    main()
