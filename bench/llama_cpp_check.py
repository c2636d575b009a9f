#!/usr/bin/python3
"""Checks that the llama.cpp peer (bench/llama_cpp_peer.mjs on a GGUF from bench/gguf_writer.py)
runs the same model as vlmgen: the greedy continuation of a text prompt must be the same token
ids in both. Prints both lists (and the log-probs of each side) and exits 0 when they match.

    /usr/bin/python3 bench/llama_cpp_check.py CHECKPOINT_DIR [PEER_JSON] [--new 16] [--length 16]
        [--dtype f32|f16|q8_0] [--kv-type f32|f16] [--flash-attention off|on|auto]

With PEER_JSON (the peer's output, run with --greedy-prompt or --greedy-length; or the JSON of
bench/llama_cpp_peer.sh, whose f32, f16 and q8_0 runs are all compared) its prompts and tokens are
used. Without it this script writes a GGUF of --dtype into a temporary folder and runs the peer
itself (node; node-llama-cpp from build/npm-llama, see bench/llama_cpp_peer.sh) on a prompt of
--length ids from the bench's generator (seed 3), below every image/vision token id.
Exit status 1 when an f32 (or lone) run differs (f16 and q8_0 weights may flip a near-tie).
The defaults (f32 weights, f32 KV cache, flash attention off; the peer's "exact" greedy run) are
the setting whose log-probs agree to ~1e-5: llama.cpp's CPU flash attention rounds through f16
(~1e-3), which flips near-ties of the randomly initialised bench model within 16 tokens.
vlmgen is imported from $VLMGEN_PYTHON, default build/python of this repository.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def text_prompt(length, limit, seed):
    """The bench's prompt generator (bench/bench_models.h, text_prompt)."""
    out, x = [], seed
    for _ in range(length):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append((x >> 33) % limit)
    return out


def id_limit(ckpt):
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config") or {}
    ids = [cfg.get("vocab_size", text.get("vocab_size")), 16000]
    for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        if cfg.get(k) is not None:
            ids.append(cfg[k])
    return min(int(i) for i in ids if i is not None)


def run_peer(ckpt, prompt, new, dtype, kv_type, flash_attention):
    with tempfile.TemporaryDirectory(prefix="llama-cpp-check-") as tmp:
        gguf = os.path.join(tmp, f"model-{dtype}.gguf")
        subprocess.run([sys.executable, os.path.join(HERE, "gguf_writer.py"), ckpt, gguf, "--dtype", dtype],
                       check=True)
        out = subprocess.run(
            ["node", os.path.join(HERE, "llama_cpp_peer.mjs"), "--model", gguf, "--threads", "1",
             "--contexts", "", "--prefill", "", "--kv-type", kv_type, "--flash-attention", flash_attention,
             "--greedy-settings", "exact" if (kv_type, flash_attention) == ("f32", "off") else "timing",
             "--greedy-prompt", ",".join(map(str, prompt)), "--greedy-new", str(new)],
            check=True, stdout=subprocess.PIPE, text=True)
        return json.loads(out.stdout)


def vlmgen_greedy(ckpt, prompt, new):
    sys.path.insert(0, os.environ.get("VLMGEN_PYTHON", os.path.join(ROOT, "build", "python")))
    import vlmgen  # noqa: E402 (built module, found at run time)

    model = vlmgen.load_model(ckpt)
    config = vlmgen.GenerationConfig(max_new_tokens=new, temperature=0.0, end_token_ids=[],
                                     stop_token_ids=[], return_logprobs=True)
    seq = vlmgen.Generator(model).generate([prompt], config).sequences[0]
    return list(seq.tokens), list(seq.logprobs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("peer_json", nargs="?")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--length", type=int, default=16)
    ap.add_argument("--dtype", choices=["f32", "f16", "q8_0"], default="f32")
    ap.add_argument("--kv-type", choices=["f32", "f16"], default="f32")
    ap.add_argument("--flash-attention", choices=["off", "on", "auto"], default="off")
    args = ap.parse_args()

    if args.peer_json:
        with open(args.peer_json) as f:
            peer = json.load(f)
        # The peer's own JSON, or bench/llama_cpp_peer.sh's {"f32": ..., "f16": ..., "q8_0": ...}.
        runs = [(k, peer[k]) for k in ("f32", "f16", "q8_0") if isinstance(peer.get(k), dict)] or [("peer", peer)]
    else:
        prompt = text_prompt(args.length, id_limit(args.checkpoint), 3)
        runs = [(args.dtype, run_peer(args.checkpoint, prompt, args.new, args.dtype, args.kv_type,
                                      args.flash_attention))]
    for label, run in runs:
        if "greedy" not in run:
            raise SystemExit(f"{label}: no greedy run (run the peer with --greedy-prompt or --greedy-length)")

    cache = {}
    report, ok = {"checkpoint": os.path.abspath(args.checkpoint)}, True
    for label, run in runs:
        prompt, theirs = run["greedy"]["prompt"], run["greedy"]["tokens"]
        key = (tuple(prompt), len(theirs))
        if key not in cache:
            cache[key] = vlmgen_greedy(args.checkpoint, prompt, len(theirs))
        ours, our_lp = cache[key]
        first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        match = ours == theirs
        their_lp = run["greedy"].get("logprobs") or []
        lp_diff = [abs(a - b) for a, b in zip(our_lp, their_lp)
                   if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)]
        report[label] = {
            "prompt": prompt,
            "vlmgen": ours,
            "llama_cpp": theirs,
            "match": match,
            "first_difference": first_diff,
            "vlmgen_logprobs": [round(x, 5) for x in our_lp],
            "llama_cpp_logprobs": [round(x, 5) if x is not None else None for x in their_lp],
            "max_logprob_difference": max(lp_diff) if lp_diff else None,
            "peer": {"model": run.get("model"), "model_type": run.get("model_type"),
                     "settings": run["greedy"].get("settings") or
                     f"kv {run.get('kv_cache_type')}, flash attention {run.get('flash_attention')}"},
        }
        print(f"{label}: greedy tokens " + ("MATCH" if match else f"DIFFER from position {first_diff}")
              + (f", max |logprob difference| {max(lp_diff):.2e}" if lp_diff else ""), file=sys.stderr)
        # f16 and q8_0 weights may legitimately flip a near-tie; f32 (or a lone run) must match.
        if label not in ("f16", "q8_0"):
            ok = ok and match
    print(json.dumps(report, indent=1))
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
