#!/usr/bin/python3
"""vlmgen against llama.cpp on the bench's 100M Qwen2-VL language model, side by side: one
markdown table of medians over interleaved rounds (per-round values in --json).

    /usr/bin/python3 bench/side_by_side.py [--rounds 3] [--threads 1] [--build build]
        [--scratch DIR] [--json out.json] [--greedy-new 16] [--llama-dir DIR]

Steps:
  1. BUILD/bench/vlmgen-bench --write-checkpoint SCRATCH/bench100m (f32, seed 1: the weights
     vlmgen-bench --speed loads); GGUFs f32, f16, q8_0 of it (bench/gguf_writer.py);
     an FP8 copy SCRATCH/bench100m-fp8 (BUILD/tools/vlmgen-quantize --quantize-lm-head, hf-block,
     the embedding left unquantized) for the fp8 memory figure.
  2. Greedy check: vlmgen (Python bindings, BUILD/python) against llama.cpp on the f32 GGUF
     (bench/llama_cpp_check.py; f32 KV cache, flash attention off). A mismatch fails the script.
  3. Per round (the order of the engines alternates between rounds): vlmgen-bench --speed
     --rounds 1 (f32, bf16, and fp8 where the binary reports it); the llama.cpp peer
     (bench/llama_cpp_peer.mjs) on each GGUF, decode at contexts 128/512/2048 and prefill of
     512/2048 tokens (batch 1; its "decode tokens/s, batch 1" is 1000 / decode ms at context 128);
     memory: vlmgen-bench --memory DTYPE --checkpoint CKPT for f32, bf16, fp8 (peak RSS after a
     512-token prompt and 9 decode steps; skipped with a note when the binary has no --memory), and
     the same work by the peer on each GGUF (--contexts 512, a process of its own).
Columns pair vlmgen f32 / llama.cpp f32, vlmgen bf16 / llama.cpp f16, vlmgen fp8 / llama.cpp q8_0.
Ratios are vlmgen / llama.cpp for times and memory and llama.cpp / vlmgen for rates: below 1 means
vlmgen is faster (or smaller). "—": not measured. llama.cpp's weights are memory-mapped (its RSS
counts the pages touched); its KV cache is f16, vlmgen's f32.
Needs: the targets vlmgen-bench, vlmgen-quantize and vlmgen_python built in BUILD; node >= 20
and node-llama-cpp (--llama-dir, default BUILD/npm-llama, else build/npm-llama of this repository,
where bench/llama_cpp_peer.sh installs it).
Progress goes to stderr; the table to stdout. About 40 s of setup, then ~2.5 min per round (one
thread, 2-core machine).
"""

import argparse
import datetime
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree
import llama_cpp_check  # noqa: E402 (the bench's prompt generator and id limit)

CONTEXTS = (128, 512, 2048)
PREFILL = (512, 2048)
SPEED_FIGURES = [f"decode ms/token, context {c}" for c in CONTEXTS] + \
    [f"decode tokens/s, batch {b}" for b in (1, 4, 16)] + \
    [f"prefill tokens/s, {s} tokens" for s in PREFILL]
KV16 = ", bf16 KV cache"  # vlmgen's 16-bit and fp8 weights over a bfloat16 KV cache (llama.cpp's KV is f16)
KV16_FIGURES = [f"decode ms/token, context {c}{KV16}" for c in CONTEXTS]
KV8 = ", fp8 KV cache"  # the same over an FP8 KV cache (--kv-dtype fp8)
KV8_FIGURES = [f"decode ms/token, context {c}{KV8}" for c in CONTEXTS]
RSS, WEIGHTS = "peak RSS (MB)", "weights (MB)"
FIGURES = SPEED_FIGURES + KV16_FIGURES + KV8_FIGURES + [RSS, WEIGHTS]
# (vlmgen weights dtype, llama.cpp GGUF type): one column pair each.
PAIRS = [("f32", "f32"), ("bf16", "f16"), ("fp8", "q8_0")]
COMMAND_TIMEOUT_S = 3600

T0 = time.monotonic()
BUSY_SEEN = set()  # build processes seen before or after any command of the run


def say(msg):
    print(f"[side-by-side {time.monotonic() - T0:6.0f}s] {msg}", file=sys.stderr, flush=True)


def fail(msg):
    say(f"error: {msg}")
    sys.exit(1)


def run(cmd, what, env=None, check=True):
    """Runs cmd, returns (rc, stdout, stderr); on failure (check) exits naming `what`."""
    BUSY_SEEN.update(compiling())
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                           timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        fail(f"{what} ran past {COMMAND_TIMEOUT_S} s: {' '.join(cmd)}")
    BUSY_SEEN.update(compiling())
    if check and p.returncode != 0:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])
        fail(f"{what} failed (exit status {p.returncode}): {' '.join(cmd)}\n{tail}")
    return p.returncode, p.stdout, p.stderr


def load_average():
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


BUILD_COMMANDS = ("ninja", "make", "cmake", "cc1plus", "cc1", "collect2", "ld", "ld.bfd", "ld.gold", "ld.lld",
                  "clang", "clang++", "ctest")


def compiling():
    """Build or test processes running now (they skew the timings): compilers, linkers, ctest and
    the project's test binaries (vlmgen_*)."""
    out = subprocess.run(["ps", "-eo", "comm="], stdout=subprocess.PIPE, text=True).stdout.split()
    return sorted({c for c in out if c in BUILD_COMMANDS or c.startswith("vlmgen_")})


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# ---------------------------------------------------------------------------------------------
# the two engines


def check_tools(build, llama_dir):
    bench = os.path.join(build, "bench", "vlmgen-bench")
    quantize = os.path.join(build, "tools", "vlmgen-quantize")
    missing = []
    if not os.access(bench, os.X_OK):
        missing.append(f"{bench} (build the target vlmgen-bench)")
    if not os.access(quantize, os.X_OK):
        missing.append(f"{quantize} (build the target vlmgen-quantize)")
    if not glob.glob(os.path.join(build, "python", "vlmgen", "_vlmgen*.so")):
        missing.append(f"{build}/python/vlmgen/_vlmgen*.so (build the target vlmgen_python)")
    if shutil.which("node") is None:
        missing.append("node (node >= 20, for the llama.cpp peer)")
    if not os.path.isfile(os.path.join(llama_dir, "node_modules", "node-llama-cpp", "package.json")):
        missing.append(f"node-llama-cpp in {llama_dir} (`DTYPES=f32 bash bench/llama_cpp_peer.sh DIR`, on any "
                       f"checkpoint DIR, installs it into {os.path.join(ROOT, 'build', 'npm-llama')}; "
                       "or pass --llama-dir)")
    if missing:
        fail("missing:\n  " + "\n  ".join(missing))
    return bench, quantize


def vlmgen_speed(bench, threads, json_path, log_path):
    _, out, err = run([bench, "--speed", "--rounds", "1", "--threads", str(threads), "--json", json_path],
                      "vlmgen-bench --speed")
    with open(log_path, "w") as f:
        f.write(out + err)
    with open(json_path) as f:
        data = json.load(f)
    first = out.splitlines()[0] if out else ""
    m = re.search(r"kernels: (.*?) \(supported: (.*)\)", first)
    isa = {"kernels": m.group(1), "supported": m.group(2)} if m else {"kernels": first or "unknown"}
    figures = {}
    for name in SPEED_FIGURES:
        entry = data.get(name) or {}
        figures[name] = {d: entry.get(d) for d, _ in PAIRS if isinstance(entry.get(d), (int, float))}
    for names, marker, suffix in ((KV16_FIGURES, KV16, "_kv16"), (KV8_FIGURES, KV8, "_kv8")):
        for name in names:
            entry = data.get(name[:-len(marker)]) or {}
            figures[name] = {d: entry.get(d + suffix) for d, _ in PAIRS
                             if isinstance(entry.get(d + suffix), (int, float))}
    figures["read_bandwidth_gbs"] = data.get("read_bandwidth_gbs")
    return figures, isa, first


def vlmgen_memory(bench, threads, dtype, checkpoint):
    """The JSON line of vlmgen-bench --memory, or (None, why)."""
    rc, out, err = run([bench, "--memory", dtype, "--checkpoint", checkpoint, "--threads", str(threads)],
                       f"vlmgen-bench --memory {dtype}", check=False)
    if rc != 0 and "--memory" in err and ("unrecognized" in err or "unknown" in err):
        return None, "unsupported"
    lines = [l for l in out.splitlines() if l.strip().startswith("{")]
    if rc != 0 or not lines:
        tail = " | ".join((err or out).strip().splitlines()[-3:])
        return None, f"exit status {rc}: {tail}"
    try:
        return json.loads(lines[-1]), None
    except json.JSONDecodeError as e:
        return None, f"unreadable output ({e}): {lines[-1][:200]}"


def llama_peer(llama_dir, gguf, threads, limit, contexts=CONTEXTS, prefill=PREFILL):
    _, out, _ = run(["node", os.path.join(HERE, "llama_cpp_peer.mjs"), "--model", gguf, "--llama-dir", llama_dir,
                     "--threads", str(threads), "--id-limit", str(limit),
                     "--contexts", ",".join(map(str, contexts)), "--prefill", ",".join(map(str, prefill))],
                    f"the llama.cpp peer on {os.path.basename(gguf)}")
    peer = json.loads(out)
    dm, pf = peer["decode_ms_per_token"], peer["prefill_tokens_per_s"]
    figures = {f"decode ms/token, context {c}": dm.get(str(c)) for c in CONTEXTS}
    figures["decode tokens/s, batch 1"] = 1000.0 / dm[str(128)] if dm.get(str(128)) else None
    figures.update({f"prefill tokens/s, {s} tokens": pf.get(str(s)) for s in PREFILL})
    figures["timing_peak_rss_mb"] = peer.get("peak_rss_mb")
    figures[WEIGHTS] = peer.get("model_size_mb")
    info = {k: peer.get(k) for k in ("node_llama_cpp", "llama_cpp_release", "build", "cpu_backend", "flash_attention",
                                     "kv_cache_type", "model_type", "context_size", "batch_size")}
    return figures, info


def greedy_check(build, llama_dir, checkpoint, gguf, scratch, new):
    """bench/llama_cpp_check.py on the peer's exact greedy run; returns its report and whether it matched."""
    limit = llama_cpp_check.id_limit(checkpoint)
    _, out, _ = run(["node", os.path.join(HERE, "llama_cpp_peer.mjs"), "--model", gguf, "--llama-dir", llama_dir,
                     "--threads", "1", "--id-limit", str(limit), "--contexts", "", "--prefill", "",
                     "--greedy-length", "16", "--greedy-new", str(new), "--greedy-settings", "exact"],
                    "the llama.cpp peer's greedy run")
    peer_json = os.path.join(scratch, "greedy-peer-f32.json")
    with open(peer_json, "w") as f:
        f.write(out)
    env = dict(os.environ, VLMGEN_PYTHON=os.path.join(build, "python"))
    rc, out, err = run([sys.executable, os.path.join(HERE, "llama_cpp_check.py"), checkpoint, peer_json],
                       "bench/llama_cpp_check.py", env=env, check=False)
    try:
        report = json.loads(out)
    except json.JSONDecodeError:
        fail(f"bench/llama_cpp_check.py failed (exit status {rc}):\n" + "\n".join(err.strip().splitlines()[-15:]))
    run_report = report.get("peer") or next(v for k, v in report.items() if isinstance(v, dict))
    return run_report, rc == 0 and run_report.get("match", False)


# ---------------------------------------------------------------------------------------------
# the table


def fmt_value(name, v):
    if v is None:
        return "—"
    if "ms/" in name:
        return f"{v:.2f}"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def ratio(name, ours, theirs):
    """< 1: vlmgen faster / smaller."""
    if ours is None or theirs is None or ours == 0 or theirs == 0:
        return None
    return theirs / ours if "tokens/s" in name else ours / theirs


def table(medians):
    head = ["figure (medians)"]
    for ours, theirs in PAIRS:
        head += [f"vlmgen {ours}", f"llama.cpp {theirs}", "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in FIGURES:
        row = [name]
        for ours, theirs in PAIRS:
            # llama.cpp runs with its own f16 KV cache in every row
            peer_name = name.replace(KV16, "").replace(KV8, "")
            a, b = medians["vlmgen"][ours].get(name), medians["llama.cpp"][theirs].get(peer_name)
            r = ratio(name, a, b)
            row += [fmt_value(name, a), fmt_value(name, b), "—" if r is None else f"{r:.2f}x"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="the CMake build folder")
    ap.add_argument("--scratch", help="folder for the checkpoints and GGUFs (kept); default a temporary one")
    ap.add_argument("--json", help="write medians and per-round values here")
    ap.add_argument("--greedy-new", type=int, default=16, help="tokens of the greedy check")
    ap.add_argument("--llama-dir", help="where node-llama-cpp is installed (default BUILD/npm-llama, "
                    "else build/npm-llama of this repository)")
    args = ap.parse_args()
    if args.rounds < 1 or args.threads < 1:
        fail("--rounds and --threads must be at least 1")

    build = os.path.abspath(args.build)
    llama_dir = args.llama_dir and os.path.abspath(args.llama_dir)
    if not llama_dir:
        llama_dir = os.path.join(build, "npm-llama")
        fallback = os.path.join(ROOT, "build", "npm-llama")
        if not os.path.isdir(llama_dir) and os.path.isdir(fallback):
            llama_dir = fallback
    bench, quantize = check_tools(build, llama_dir)
    if args.scratch:
        scratch = os.path.abspath(args.scratch)
        os.makedirs(scratch, exist_ok=True)
    else:
        scratch = tempfile.mkdtemp(prefix="vlmgen-side-by-side-")
    try:
        return side_by_side(args, build, bench, quantize, llama_dir, scratch)
    finally:
        if not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def side_by_side(args, build, bench, quantize, llama_dir, scratch):
    notes = []
    busy = compiling()
    if busy:
        notes.append(f"build or test processes were running at the start ({', '.join(busy)}): timings are skewed")
        say(f"warning: {notes[-1]}")
    load_before = load_average()

    # 1. checkpoints and GGUFs
    ckpt = os.path.join(scratch, "bench100m")
    say(f"writing the 100M bench checkpoint to {ckpt}")
    run([bench, "--write-checkpoint", ckpt], "vlmgen-bench --write-checkpoint")
    ggufs = {}
    for _, dtype in PAIRS:
        ggufs[dtype] = os.path.join(scratch, f"model-{dtype}.gguf")
        say(f"writing {ggufs[dtype]}")
        run([sys.executable, os.path.join(HERE, "gguf_writer.py"), ckpt, ggufs[dtype], "--dtype", dtype],
            f"bench/gguf_writer.py --dtype {dtype}")
    ckpt_fp8 = os.path.join(scratch, "bench100m-fp8")
    say(f"writing the FP8 copy {ckpt_fp8}")
    shutil.rmtree(ckpt_fp8, ignore_errors=True)  # vlmgen-quantize wants a new or empty folder
    rc, _, err = run([quantize, "--in", ckpt, "--out", ckpt_fp8, "--quantize-lm-head", "--quiet"], "vlmgen-quantize",
                     check=False)
    if rc != 0:
        notes.append(f"vlmgen-quantize failed (exit status {rc}): no fp8 memory figure; "
                     + " | ".join(err.strip().splitlines()[-2:]))
        say(f"warning: {notes[-1]}")
        ckpt_fp8 = None
    mem_ckpt = {"f32": ckpt, "bf16": ckpt, "fp8": ckpt_fp8}

    # 2. greedy tokens
    say("greedy check: vlmgen against llama.cpp on the f32 GGUF")
    greedy, match = greedy_check(build, llama_dir, ckpt, ggufs["f32"], scratch, args.greedy_new)
    verdict = ("MATCH" if match else f"MISMATCH from position {greedy.get('first_difference')}") + \
        (f", max |logprob difference| {greedy['max_logprob_difference']:.1e}"
         if greedy.get("max_logprob_difference") is not None else "")
    say(f"greedy tokens, vlmgen f32 vs llama.cpp f32: {verdict}")
    if not match:
        print(json.dumps(greedy, indent=1), file=sys.stderr)
        fail("vlmgen and llama.cpp disagree on the f32 greedy tokens: the two engines do not run the same model")

    # 3. rounds
    limit = llama_cpp_check.id_limit(ckpt)
    rounds, isa, isa_line, llama_info, memory_state = [], None, "", None, None
    for r in range(args.rounds):
        record = {"vlmgen": {d: {} for d, _ in PAIRS}, "llama.cpp": {}, "vlmgen_memory": {}}

        def do_vlmgen():
            nonlocal isa, isa_line
            say(f"round {r + 1}/{args.rounds}: vlmgen-bench --speed --threads {args.threads}")
            figures, isa, isa_line = vlmgen_speed(bench, args.threads, os.path.join(scratch, f"vlmgen-{r}.json"),
                                                  os.path.join(scratch, f"vlmgen-{r}.txt"))
            record["read_bandwidth_gbs"] = figures.pop("read_bandwidth_gbs")
            for name, per_dtype in figures.items():
                for d, v in per_dtype.items():
                    record["vlmgen"][d][name] = v

        def do_llama():
            nonlocal llama_info
            order = [t for _, t in PAIRS] if r % 2 == 0 else [t for _, t in reversed(PAIRS)]
            for dtype in order:
                say(f"round {r + 1}/{args.rounds}: llama.cpp on {os.path.basename(ggufs[dtype])}")
                record["llama.cpp"][dtype], llama_info = llama_peer(llama_dir, ggufs[dtype], args.threads, limit)

        def do_memory():
            nonlocal memory_state
            # llama.cpp: what vlmgen-bench --memory does (a 512-token prompt, a warm-up and 8 decode
            # steps), in a process of its own per GGUF.
            for _, dtype in PAIRS:
                say(f"round {r + 1}/{args.rounds}: llama.cpp memory on {os.path.basename(ggufs[dtype])}")
                m, _ = llama_peer(llama_dir, ggufs[dtype], args.threads, limit, contexts=(512,), prefill=())
                record["llama.cpp"][dtype][RSS] = m["timing_peak_rss_mb"]
            if memory_state == "unsupported":
                return
            for d, _ in PAIRS:
                if mem_ckpt[d] is None:
                    continue
                say(f"round {r + 1}/{args.rounds}: vlmgen-bench --memory {d}")
                m, why = vlmgen_memory(bench, args.threads, d, mem_ckpt[d])
                if why == "unsupported":
                    memory_state = "unsupported"
                    notes.append("vlmgen-bench has no --memory option yet: vlmgen's memory rows are not measured")
                    say(f"note: {notes[-1]}")
                    return
                if m is None:
                    note = f"vlmgen-bench --memory {d}: {why}"
                    if note not in notes:
                        notes.append(note)
                        say(f"warning: {note}")
                    continue
                record["vlmgen_memory"][d] = m
                record["vlmgen"][d][RSS] = m.get("peak_rss_mb")
                record["vlmgen"][d][WEIGHTS] = m.get("weights_mb")

        # Alternate which engine goes first, so a drift of the machine does not favour one.
        steps = [do_vlmgen, do_llama] if r % 2 == 0 else [do_llama, do_vlmgen]
        for step in steps + [do_memory]:
            step()
        rounds.append(record)

    load_after = load_average()
    if BUSY_SEEN - set(busy):
        notes.append(f"build or test processes ran during the run ({', '.join(sorted(BUSY_SEEN))}): timings are skewed")
        say(f"warning: {notes[-1]}")
    medians = {"vlmgen": {}, "llama.cpp": {}}
    for ours, theirs in PAIRS:
        medians["vlmgen"][ours] = {n: median([rd["vlmgen"][ours].get(n) for rd in rounds]) for n in FIGURES}
        medians["llama.cpp"][theirs] = {n: median([rd["llama.cpp"][theirs].get(n) for rd in rounds]) for n in FIGURES}
    if all(medians["vlmgen"]["fp8"].get(n) is None for n in SPEED_FIGURES):
        notes.append("vlmgen-bench --speed reports no fp8 figures (yet): the vlmgen fp8 speed column is empty")
    notes.append("llama.cpp runs decode at batch 1 only: its batch 4 and 16 cells are empty; its batch-1 "
                 "tokens/s is 1000 / its decode ms/token at context 128")
    bandwidth = median([rd.get("read_bandwidth_gbs") for rd in rounds])

    machine = {
        "cpu": cpu_model(), "cpus": os.cpu_count(), "threads": args.threads, "rounds": args.rounds,
        "load_average_before": load_before, "load_average_after": load_after,
        "vlmgen_kernels": isa, "vlmgen_bench_first_line": isa_line, "read_bandwidth_gbs": bandwidth,
        "llama_cpp": llama_info, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "build_processes_at_start": busy, "build_processes_seen": sorted(BUSY_SEEN),
    }
    li = llama_info or {}
    isa_text = (isa or {}).get("kernels", "unknown") + \
        (f" (supported: {isa['supported']})" if isa and isa.get("supported") else "")
    print(f"### vlmgen vs llama.cpp, 100M Qwen2-VL LM (CPU, {args.threads} thread(s), median of {args.rounds} "
          f"interleaved round(s))\n")
    print(table(medians))
    print()
    print(f"- CPU: {machine['cpu']} ({machine['cpus']} logical CPUs), threads: {args.threads}")
    print("- load average (1/5/15 min): before {} / after {}".format(
        " ".join(f"{x:.2f}" for x in load_before), " ".join(f"{x:.2f}" for x in load_after)))
    print(f"- vlmgen kernels: {isa_text}" + (f"; read bandwidth {bandwidth:.1f} GB/s" if bandwidth else ""))
    print(f"- llama.cpp: node-llama-cpp {li.get('node_llama_cpp')} (llama.cpp release label "
          f"{li.get('llama_cpp_release')}), "
          f"{li.get('build')}, CPU backend {li.get('cpu_backend')}, flash attention "
          f"{ {True: 'on', False: 'off'}.get(li.get('flash_attention'), li.get('flash_attention')) }, "
          f"KV cache {li.get('kv_cache_type')}")
    print(f"- greedy tokens ({args.greedy_new}, f32, f32 KV cache, flash attention off): {verdict}")
    print("- ratio: vlmgen / llama.cpp for ms and MB, llama.cpp / vlmgen for tokens/s: < 1 means vlmgen is "
          "faster or smaller")
    print("- vlmgen fp8: decoder linears and lm_head E4M3 with a scale per 128x128 block, embedding bf16; "
          "llama.cpp q8_0: every matrix (embedding and output included) int8 with an f16 scale per 32 weights")
    print("- memory: peak RSS after a 512-token prompt and 9 decode steps, one process per engine and dtype; "
          "vlmgen's weights include the vision tower (the checkpoint's), llama.cpp's GGUF is the LM only and "
          "memory-mapped; KV cache: vlmgen f32, llama.cpp f16")
    print(f"- rows ending '{KV16}': vlmgen's bf16 and fp8 weights over a bfloat16 KV cache (--kv-dtype bf16), "
          f"against llama.cpp's same runs (f16 KV cache by default); rows ending '{KV8}' the same over an FP8 KV "
          "cache (--kv-dtype fp8: E4M3 bytes and a float32 scale per key or value row); every other vlmgen row "
          "has an f32 KV cache")
    for note in notes:
        print(f"- note: {note}")

    if args.json:
        out = {"machine": machine, "greedy": greedy, "greedy_match": match, "notes": notes,
               "medians": medians, "rounds": rounds,
               "ratio_convention": "vlmgen/llama.cpp for ms and MB, llama.cpp/vlmgen for tokens/s; < 1: vlmgen better"}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
