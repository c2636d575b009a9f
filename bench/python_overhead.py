"""Per-forward-call cost of the Python model seam: vlmgen's C++ tiny Qwen2-VL driven directly,
against the same model behind a Python object whose forward delegates to it (so the difference is
only the seam: GIL, argument objects, the Python call). Interleaved rounds, medians.

    PYTHONPATH=build/python /usr/bin/python3 bench/python_overhead.py \
        --make-checkpoint build/examples/vlmgen-make-tiny-checkpoint [--rounds 15] [--tokens 64]
"""

import argparse
import os
import statistics
import subprocess
import tempfile
import time

import vlmgen


def per_call_us(generator, prompt, config):
    start = time.perf_counter()
    result = generator.generate([prompt], config)
    elapsed = time.perf_counter() - start
    return elapsed / result.stats.forward_calls * 1e6, result.tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make-checkpoint", required=True, help="path of vlmgen-make-tiny-checkpoint")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([args.make_checkpoint, "--out", folder], check=True, capture_output=True)
        model = vlmgen.load_model(folder)
    prompt = list(range(1, 17))
    config = vlmgen.GenerationConfig(max_new_tokens=args.tokens)
    direct, seam = vlmgen.Generator(model), vlmgen.Generator(vlmgen.testing.DelegatingModel(model))
    per_call_us(direct, prompt, config)  # warm-up
    per_call_us(seam, prompt, config)
    cpp, py = [], []
    for i in range(args.rounds):
        print(f"\rround {i + 1}/{args.rounds}", end="", flush=True)
        t, tokens_cpp = per_call_us(direct, prompt, config)
        cpp.append(t)
        t, tokens_py = per_call_us(seam, prompt, config)
        py.append(t)
        assert tokens_cpp == tokens_py
    print()
    load = os.getloadavg()[0]
    c, p = statistics.median(cpp), statistics.median(py)
    print(f"tiny Qwen2-VL, {args.tokens} new tokens, prompt 16, KV cache; median of {args.rounds} interleaved rounds;"
          f" load {load:.2f}")
    print(f"  C++ model:                 {c:8.1f} us per forward call")
    print(f"  same model behind Python:  {p:8.1f} us per forward call")
    print(f"  added by the Python seam:  {p - c:8.1f} us per forward call (target <= 50)")


if __name__ == "__main__":
    main()
