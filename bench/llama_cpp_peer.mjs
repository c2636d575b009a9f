// The llama.cpp peer of vlmgen's speed report: times a GGUF model (bench/gguf_writer.py) on the
// CPU through node-llama-cpp 3.21.1's prebuilt llama.cpp, feeding token ids (no text, no chat
// wrapper), and prints ONE JSON object on stdout.
//
//   node bench/llama_cpp_peer.mjs --model M.gguf [--threads 1] [--contexts 128,512,2048]
//       [--prefill 512,2048] [--decode-steps 8] [--greedy-prompt "1,2,3" | --greedy-length N]
//       [--greedy-new 16] [--greedy-settings exact|timing] [--kv-type f16|f32]
//       [--flash-attention auto|on|off] [--id-limit 16000] [--llama-dir build/npm-llama]
//
// An empty list (--contexts "") skips those figures. Defaults are llama.cpp's own: f16 KV cache,
// flash attention "auto" (enabled on CPU; the JSON says what it resolved to). Weights are
// memory-mapped, so peak RSS counts the mapped GGUF pages.
//
// Measures, like bench/speed_report.cpp does for vlmgen:
//   decode_ms_per_token[C]: a C-token prompt (seed 7), one warm-up step, then the mean of
//     --decode-steps single-token steps (each feeds the same token, seed 11, computes its logits
//     and picks the greedy next token);
//   prefill_tokens_per_s[S]: S prompt tokens (seed 5) evaluated in one batch, last-token logits;
//   greedy: --greedy-new tokens continuing --greedy-prompt (or N generated ids, seed 3) (greedy,
//     no repeat penalty, end-of-generation tokens not special-cased), with each token's
//     log-probability under the model (bench/llama_cpp_check.py compares them with vlmgen's).
//     Run in a context of its own: by default "exact" (f32 KV cache, flash attention off, the
//     numerics of vlmgen's f32 path: llama.cpp's CPU flash attention rounds through f16, which
//     flips near-ties of a randomly initialised model); "timing" uses the timing settings;
//   peak_rss_mb: the process's peak resident memory (VmHWM).
// Prompt ids come from the same generator as vlmgen's bench (bench_models.h, text_prompt):
//   x <- x * 6364136223846793005 + 1442695040888963407 (mod 2^64), id = (x >> 33) % limit,
// starting from x = seed, limit = min(--id-limit, vocab size).
// node-llama-cpp is loaded from --llama-dir (default build/npm-llama next to this repository's
// bench/, where bench/llama_cpp_peer.sh installs it); the CPU build only, never a download/build.

import {createRequire} from "node:module";
import {readFileSync} from "node:fs";
import path from "node:path";
import {fileURLToPath, pathToFileURL} from "node:url";

function parseArgs(argv) {
  const o = {
    model: null, threads: 1, contexts: [128, 512, 2048], prefill: [512, 2048], decodeSteps: 8,
    greedyPrompt: null, greedyLength: 0, greedyNew: 16, greedySettings: "exact",
    kvType: "f16", flashAttention: "auto", idLimit: 16000,
    llamaDir: path.join(path.dirname(fileURLToPath(import.meta.url)), "..", "build", "npm-llama"),
  };
  const list = (s) => s.split(",").filter((x) => x.trim() !== "").map((x) => {
    const n = Number(x);
    if (!Number.isInteger(n) || n < 0) throw new Error(`not a list of whole numbers: ${s}`);
    return n;
  });
  for (let i = 2; i < argv.length; i++) {
    const a = argv[i], v = () => {
      if (i + 1 >= argv.length) throw new Error(`${a} needs a value`);
      return argv[++i];
    };
    if (a === "--model") o.model = v();
    else if (a === "--threads") o.threads = Number(v());
    else if (a === "--contexts") o.contexts = list(v());
    else if (a === "--prefill") o.prefill = list(v());
    else if (a === "--decode-steps") o.decodeSteps = Number(v());
    else if (a === "--greedy-prompt") o.greedyPrompt = list(v());
    else if (a === "--greedy-length") o.greedyLength = Number(v());
    else if (a === "--greedy-new") o.greedyNew = Number(v());
    else if (a === "--greedy-settings") o.greedySettings = v();
    else if (a === "--kv-type") o.kvType = v();
    else if (a === "--flash-attention") o.flashAttention = v();
    else if (a === "--id-limit") o.idLimit = Number(v());
    else if (a === "--llama-dir") o.llamaDir = v();
    else if (a === "--help" || a === "-h") {
      process.stderr.write(readFileSync(fileURLToPath(import.meta.url), "utf8").split("\n\n")[0] + "\n");
      process.exit(0);
    } else throw new Error(`unknown argument ${a}`);
  }
  if (!o.model) throw new Error("--model M.gguf is required");
  if (!["f16", "f32"].includes(o.kvType)) throw new Error("--kv-type is f16 or f32");
  if (!["auto", "on", "off"].includes(o.flashAttention)) throw new Error("--flash-attention is auto, on or off");
  if (!["exact", "timing"].includes(o.greedySettings)) throw new Error("--greedy-settings is exact or timing");
  return o;
}

/** The bench's prompt ids: a 64-bit LCG (see the header). */
function textPrompt(length, limit, seed) {
  const mask = (1n << 64n) - 1n;
  let x = BigInt(seed);
  const out = new Array(length);
  for (let i = 0; i < length; i++) {
    x = (x * 6364136223846793005n + 1442695040888963407n) & mask;
    out[i] = Number((x >> 33n) % BigInt(limit));
  }
  return out;
}

/** The ggml CPU backend variant llama.cpp picked for this CPU (libggml-cpu-VARIANT.so). */
function cpuBackend() {
  try {
    const m = /libggml-cpu-([\w-]+)\.so/.exec(readFileSync("/proc/self/maps", "utf8"));
    if (m) return m[1];
  } catch {}
  return null;
}

// MB of 10^6 bytes, the unit of the weights' sizes (the kernel's "kB" are KiB).
function peakRssMb() {
  try {
    const m = /VmHWM:\s+(\d+) kB/.exec(readFileSync("/proc/self/status", "utf8"));
    if (m) return (Number(m[1]) * 1024) / 1e6;
  } catch {}
  return (process.resourceUsage().maxRSS * 1024) / 1e6;  // KiB
}

const now = () => process.hrtime.bigint();
const msSince = (t) => Number(now() - t) / 1e6;

async function main() {
  const o = parseArgs(process.argv);
  const require = createRequire(path.join(path.resolve(o.llamaDir), "package.json"));
  let entry;
  try {
    entry = require.resolve("node-llama-cpp");
  } catch {
    throw new Error(`node-llama-cpp is not installed under ${o.llamaDir} (run bench/llama_cpp_peer.sh)`);
  }
  const {getLlama, LlamaLogLevel} = await import(pathToFileURL(entry).href);
  const version = JSON.parse(readFileSync(path.join(path.dirname(entry), "..", "package.json"), "utf8")).version;

  // llama.cpp's log: warnings and errors go to stderr; a few info lines are kept for the JSON
  // (context size, what "auto" flash attention resolved to).
  const notes = [];
  const logger = (level, message) => {
    const line = String(message).trim();
    if (/Flash Attention|flash_attn|n_ctx_seq|CPU_REPACK|AMX/.test(line)) notes.push(line);
    if ([LlamaLogLevel.warn, LlamaLogLevel.error, LlamaLogLevel.fatal].includes(level) && line)
      process.stderr.write(`llama.cpp: ${line}\n`);
  };
  const llama = await getLlama({
    gpu: false, build: "never", usePrebuiltBinaries: true, skipDownload: true, progressLogs: false,
    maxThreads: o.threads, logLevel: LlamaLogLevel.info, logger,
  });
  const tLoad = now();
  const model = await llama.loadModel({modelPath: path.resolve(o.model), gpuLayers: 0});
  const loadMs = msSince(tLoad);
  const nVocab = Number(model.fileInfo.metadata?.tokenizer?.ggml?.tokens?.length ??
                        model.fileInfo.architectureMetadata?.vocab_size);
  const limit = Math.min(o.idLimit, nVocab);
  if (!o.greedyPrompt && o.greedyLength > 0) o.greedyPrompt = textPrompt(o.greedyLength, limit, 3);

  const exactGreedy = o.greedyPrompt && o.greedySettings === "exact";
  const timingGreedy = o.greedyPrompt && !exactGreedy;
  const gLen = timingGreedy ? o.greedyPrompt.length : 0;
  const longest = Math.max(0, ...o.contexts, ...o.prefill, gLen);
  const contextSize = longest + Math.max(o.decodeSteps + 2, timingGreedy ? o.greedyNew + 1 : 0) + 1;
  const batchSize = Math.max(1, ...o.contexts, ...o.prefill, gLen);
  const newContext = (size, batch, kvType, flashAttention) => model.createContext({
    contextSize: size, batchSize: batch, sequences: 1, threads: {ideal: o.threads, min: o.threads},
    flashAttention: flashAttention === "auto" ? "auto" : flashAttention === "on",
    experimentalKvCacheKeyType: kvType.toUpperCase(), experimentalKvCacheValueType: kvType.toUpperCase(),
  });
  const context = await newContext(contextSize, batchSize, o.kvType, o.flashAttention);
  let seq = context.getSequence();

  // Greedy (temperature 0), no repeat penalty: node-llama-cpp's defaults, stated for clarity.
  const sampling = {temperature: 0};
  const greedyNext = (t) => [t, {generateNext: {token: true, confidence: true, options: sampling}}];
  // Evaluates `tokens` after what the sequence holds; logits of the last one only; returns the
  // greedy next token.
  async function feed(tokens) {
    const last = (t) => [t, {generateNext: {token: true, options: sampling}}];
    const items = tokens.map((t, i) => (i === tokens.length - 1 ? last(t) : t));
    const res = await seq.controlledEvaluate(items);
    const next = res[tokens.length - 1]?.next?.token;
    if (next == null) throw new Error("no token was generated");
    return next;
  }

  const result = {
    engine: "llama.cpp", node_llama_cpp: version, llama_cpp_release: llama.llamaCppRelease?.release ?? null,
    build: `${llama.buildType}, gpu: ${llama.gpu}`, system_info: llama.systemInfo,
    model: path.resolve(o.model), model_type: model.typeDescription, model_size_mb: model.size / 1e6,
    vocab_size: nVocab, threads: o.threads, context_size: context.contextSize, batch_size: context.batchSize,
    flash_attention: context.flashAttention, kv_cache_type: o.kvType, load_ms: loadMs,
    prompt_generator: "x=x*6364136223846793005+1442695040888963407 mod 2^64, id=(x>>33)%id_limit; " +
      "seeds: decode 7 (step token 11), prefill 5, greedy 3",
    id_limit: limit, decode_steps: o.decodeSteps, decode_ms_per_token: {}, prefill_tokens_per_s: {},
  };

  for (const c of o.contexts) {
    await seq.clearHistory();
    await feed(textPrompt(c, limit, 7));
    const tok = textPrompt(1, limit, 11)[0];
    await feed([tok]);  // warm-up
    const t = now();
    for (let i = 0; i < o.decodeSteps; i++) await feed([tok]);
    result.decode_ms_per_token[c] = msSince(t) / o.decodeSteps;
  }
  for (const s of o.prefill) {
    await seq.clearHistory();
    const prompt = textPrompt(s, limit, 5);
    const t = now();
    await feed(prompt);
    result.prefill_tokens_per_s[s] = s / (msSince(t) / 1e3);
  }
  const fa = notes.find((l) => /Flash Attention (enabled|disabled)/.test(l));
  if (fa) result.flash_attention = /enabled/.test(fa);
  result.llama_cpp_log = [...new Set(notes)];  // the timing context's
  let greedyContext = null;
  if (exactGreedy) {
    await context.dispose();
    greedyContext = await newContext(o.greedyPrompt.length + o.greedyNew + 1, o.greedyPrompt.length, "f32", "off");
    seq = greedyContext.getSequence();
  }
  if (o.greedyPrompt) {
    await seq.clearHistory();
    const tokens = [], logprobs = [];
    let items = o.greedyPrompt.map((t, i) => (i === o.greedyPrompt.length - 1 ? greedyNext(t) : t));
    for (let i = 0; i < o.greedyNew; i++) {
      const res = await seq.controlledEvaluate(items);
      const next = res[items.length - 1]?.next;
      if (next?.token == null) throw new Error("no token was generated");
      tokens.push(next.token);
      logprobs.push(next.confidence != null ? Math.log(next.confidence) : null);
      items = [greedyNext(next.token)];
    }
    result.greedy = {
      prompt: o.greedyPrompt, tokens, logprobs,
      settings: exactGreedy ? "exact: f32 KV cache, flash attention off" : "timing (as above)",
    };
  }
  result.peak_rss_mb = peakRssMb();
  result.cpu_backend = cpuBackend();
  await (greedyContext ?? context).dispose();
  await model.dispose();
  await llama.dispose();
  process.stdout.write(JSON.stringify(result) + "\n");
}

main().catch((e) => {
  process.stderr.write(`llama_cpp_peer: ${e?.stack ?? e}\n`);
  setTimeout(() => process.exit(1), 300);  // llama.cpp's own error lines arrive a little later
});
