#!/usr/bin/python3
"""Writes the language model of an HF-style Qwen2-VL checkpoint as a GGUF v3 file that llama.cpp
loads as architecture `qwen2`, for the llama.cpp peer of the bench (bench/llama_cpp_peer.sh).

    /usr/bin/python3 bench/gguf_writer.py CHECKPOINT_DIR OUT.gguf [--dtype f32|f16|q8_0]

CHECKPOINT_DIR holds config.json and model.safetensors (or model-*.safetensors shards); tensors
named model.* (or model.language_model.*) and lm_head.weight; visual.* tensors are skipped. For a
text-only prompt Qwen2-VL's M-RoPE gives every section the same position, which is plain 1-D
rotate-half ("NEOX") RoPE: exactly llama.cpp's qwen2 architecture, so no tensor is permuted.
Matrices are written in --dtype (default f32); norm weights and biases stay f32. q8_0 is ggml's
Q8_0 (what llama.cpp's own q8_0 conversion writes for every 2-D tensor, embedding and output
included): each row in blocks of 32 weights, a block being an f16 scale d = max|w| / 127 and the
32 int8 values round(w / d) (halves away from zero), 34 bytes.

The tokenizer written is synthetic (the bench feeds token ids, never text): a byte-level "gpt2"
vocabulary of vocab_size tokens, the first ones the 256 byte symbols, the rest named "<|tN|>",
no merges; eos ("<|endoftext|>") and bos ("<|bos|>", control tokens) from config.json
(eos_token_id, bos_token_id), else both vocab_size - 1; llama.cpp adds neither. Below 256 tokens
text cannot round-trip, which node-llama-cpp warns about at load; token ids are unaffected.
Heads x head_dim must equal hidden_size, and Qwen3-VL's q/k norms are refused (qwen2 has neither).
Standard library and numpy only; safetensors is parsed here (F32, F16 and BF16).
"""

import argparse
import json
import mmap
import os
import struct
import sys

import numpy as np

from byte_level import byte_symbols  # this folder

# GGUF metadata value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
# ggml tensor types and llama file types
GGML_F32, GGML_F16, GGML_Q8_0 = 0, 1, 8
FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7}  # LLAMA_FTYPE_ALL_F32, _MOSTLY_F16, _MOSTLY_Q8_0
QK8_0 = 32  # weights per Q8_0 block
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (QK8_0,))])  # 34 bytes, no padding
ALIGNMENT = 32
# llama.cpp token types
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3


# ---------------------------------------------------------------------------------------------
# safetensors


def read_safetensors(path):
    """Returns {name: numpy array} (float32/float16, views of a memory map where possible)."""
    f = open(path, "rb")
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (n,) = struct.unpack("<Q", mm[:8])
    header = json.loads(mm[8 : 8 + n].decode("utf-8"))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        dtype = info["dtype"]
        if dtype == "F32":
            a = np.frombuffer(mm, dtype="<f4", count=(end - begin) // 4, offset=base + begin)
        elif dtype == "F16":
            a = np.frombuffer(mm, dtype="<f2", count=(end - begin) // 2, offset=base + begin)
        elif dtype == "BF16":
            raw = np.frombuffer(mm, dtype="<u2", count=(end - begin) // 2, offset=base + begin)
            a = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit(f"{path}: tensor {name} has dtype {dtype}; only F32, F16, BF16 are read")
        out[name] = a.reshape(shape)
    return out


def read_checkpoint(ckpt):
    files = sorted(
        os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".safetensors")
    )
    if not files:
        raise SystemExit(f"{ckpt}: no .safetensors file")
    tensors = {}
    for path in files:
        tensors.update(read_safetensors(path))
    return tensors


# ---------------------------------------------------------------------------------------------
# GGUF


def gguf_string(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
           BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}


def gguf_value(vtype, value):
    if vtype == STRING:
        return gguf_string(value)
    return struct.pack(_SCALAR[vtype], value)


def gguf_kv(key, vtype, value, elem_type=None):
    out = gguf_string(key) + struct.pack("<I", vtype)
    if vtype == ARRAY:
        out += struct.pack("<IQ", elem_type, len(value))
        if elem_type == STRING:
            out += b"".join(gguf_string(v) for v in value)
        elif len(value):
            out += np.asarray(value, dtype=np.dtype(_SCALAR[elem_type])).tobytes()
        return out
    return out + gguf_value(vtype, value)


class Quantized:
    """A tensor of a block type: its logical (numpy-order) shape, ggml type and packed blocks."""

    def __init__(self, shape, gtype, blocks):
        self.shape, self.gtype, self.blocks = tuple(shape), gtype, blocks
        self.nbytes = blocks.nbytes


def quantize_q8_0(a):
    """ggml's reference Q8_0 of a float array whose last dimension is a multiple of 32."""
    a = np.asarray(a, dtype=np.float32)
    if a.shape[-1] % QK8_0:
        raise SystemExit(f"q8_0: a row of {a.shape[-1]} weights is not a whole number of {QK8_0}-blocks")
    x = a.reshape(-1, QK8_0)
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)  # float32, as the C reference
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    scaled = (x * inv).astype(np.float64)  # the float32 product; rounding it in float64 is exact
    q = np.copysign(np.floor(np.abs(scaled) + 0.5), scaled)  # C roundf: halves away from zero
    blocks = np.empty(x.shape[0], dtype=Q8_0_BLOCK)
    blocks["d"] = d[:, 0].astype(np.float16)  # round to nearest even, as ggml's fp32 -> fp16
    blocks["qs"] = np.clip(q, -127, 127).astype(np.int8)
    return Quantized(a.shape, GGML_Q8_0, blocks)


def pad(n, align=ALIGNMENT):
    return (align - n % align) % align


def write_gguf(path, kvs, tensors):
    """kvs: [(key, type, value[, elem_type])]; tensors: [(name, numpy array f32/f16 or Quantized)].
    GGUF lists a tensor's dims fastest-varying first: the reverse of the numpy/PyTorch shape (in
    weights, also for block types)."""
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    header += b"".join(gguf_kv(*kv) for kv in kvs)
    offset = 0
    infos = []
    for name, a in tensors:
        if isinstance(a, Quantized):
            gtype = a.gtype
        else:
            gtype = {np.dtype("float32"): GGML_F32, np.dtype("float16"): GGML_F16}[a.dtype]
        dims = list(reversed(a.shape))
        infos.append(gguf_string(name) + struct.pack("<I", len(dims))
                     + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", gtype, offset))
        offset += a.nbytes + pad(a.nbytes)
    header += b"".join(infos)
    # A regular file is written beside and renamed into place (no half-written GGUF is left);
    # anything else (a pipe, a device) is written to directly.
    regular = not os.path.exists(path) or (os.path.isfile(path) and not os.path.islink(path))
    tmp = path + ".tmp" if regular else path
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(b"\0" * pad(len(header)))
        for _, a in tensors:
            if isinstance(a, Quantized):
                data = np.ascontiguousarray(a.blocks)
            else:
                data = np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False)
            f.write(memoryview(data).cast("B"))
            f.write(b"\0" * pad(a.nbytes))
    if tmp != path:
        os.replace(tmp, path)
    return len(header) + pad(len(header)) + offset


# ---------------------------------------------------------------------------------------------
# Qwen2-VL -> llama.cpp qwen2


def synthetic_vocab(vocab_size, bos, eos):
    symbols = byte_symbols()
    tokens, types = [], []
    for i in range(vocab_size):
        if i in (bos, eos):
            tokens.append("<|endoftext|>" if i == eos else "<|bos|>")
            types.append(TOKEN_CONTROL)
        elif i < 256:
            tokens.append(symbols[i])
            types.append(TOKEN_NORMAL)
        else:
            tokens.append(f"<|t{i}|>")
            types.append(TOKEN_NORMAL)
    return tokens, types


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--dtype", choices=["f32", "f16", "q8_0"], default="f32")
    args = ap.parse_args()

    with open(os.path.join(args.checkpoint, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config") or {}
    get = lambda k, d=None: cfg.get(k, text.get(k, d))  # noqa: E731 (flat or nested configs)

    hidden = int(get("hidden_size"))
    n_layer = int(get("num_hidden_layers"))
    n_head = int(get("num_attention_heads"))
    n_kv = int(get("num_key_value_heads", n_head))
    head_dim = int(get("head_dim") or hidden // n_head)
    ffn = int(get("intermediate_size"))
    vocab = int(get("vocab_size"))
    ctx_len = int(get("max_position_embeddings", 32768))
    theta = float(get("rope_theta", 10000.0))
    eps = float(get("rms_norm_eps", 1e-6))
    tied = bool(get("tie_word_embeddings", False))
    bos = get("bos_token_id")
    eos = get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    eos = int(eos) if eos is not None and 0 <= int(eos) < vocab else vocab - 1
    bos = int(bos) if bos is not None and 0 <= int(bos) < vocab else eos

    if n_head * head_dim != hidden:
        # llama.cpp's qwen2 graph sizes attn_q/attn_output as n_embd x n_embd.
        raise SystemExit(f"{args.checkpoint}: heads x head_dim = {n_head} x {head_dim} != hidden {hidden}; "
                         "llama.cpp's qwen2 architecture needs them equal")

    src = read_checkpoint(args.checkpoint)
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in src else "model."
    if any(k.endswith("self_attn.q_norm.weight") for k in src):
        raise SystemExit(f"{args.checkpoint}: q/k norms (Qwen3-VL) are not part of llama.cpp's qwen2 architecture")

    def take(name):
        if name not in src:
            raise SystemExit(f"{args.checkpoint}: tensor {name} is missing")
        return src[name]

    def mat(name):
        a = np.asarray(take(name), dtype=np.float32)
        if args.dtype == "q8_0":
            return quantize_q8_0(a)
        return a.astype(np.float32 if args.dtype == "f32" else np.float16)

    def vec(name):
        return np.asarray(take(name), dtype=np.float32)

    out = [("token_embd.weight", mat(prefix + "embed_tokens.weight"))]
    for i in range(n_layer):
        p, b = f"{prefix}layers.{i}.", f"blk.{i}."
        out += [
            (b + "attn_norm.weight", vec(p + "input_layernorm.weight")),
            (b + "attn_q.weight", mat(p + "self_attn.q_proj.weight")),
            (b + "attn_q.bias", vec(p + "self_attn.q_proj.bias")),
            (b + "attn_k.weight", mat(p + "self_attn.k_proj.weight")),
            (b + "attn_k.bias", vec(p + "self_attn.k_proj.bias")),
            (b + "attn_v.weight", mat(p + "self_attn.v_proj.weight")),
            (b + "attn_v.bias", vec(p + "self_attn.v_proj.bias")),
            (b + "attn_output.weight", mat(p + "self_attn.o_proj.weight")),
            (b + "ffn_norm.weight", vec(p + "post_attention_layernorm.weight")),
            (b + "ffn_gate.weight", mat(p + "mlp.gate_proj.weight")),
            (b + "ffn_up.weight", mat(p + "mlp.up_proj.weight")),
            (b + "ffn_down.weight", mat(p + "mlp.down_proj.weight")),
        ]
    out.append(("output_norm.weight", vec(prefix + "norm.weight")))
    # Tied embeddings: llama.cpp's qwen2 loader reuses token_embd when output.weight is absent.
    if "lm_head.weight" in src:
        out.append(("output.weight", mat("lm_head.weight")))
    elif not tied:
        raise SystemExit(f"{args.checkpoint}: lm_head.weight is missing and embeddings are not tied")

    expect = {
        "token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden),
        "attn_q.weight": (n_head * head_dim, hidden), "attn_k.weight": (n_kv * head_dim, hidden),
        "attn_v.weight": (n_kv * head_dim, hidden), "attn_output.weight": (hidden, n_head * head_dim),
        "ffn_gate.weight": (ffn, hidden), "ffn_up.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn),
    }
    for name, a in out:
        want = expect.get(name) or expect.get(name.split(".", 2)[-1])
        if want and tuple(a.shape) != want:
            raise SystemExit(f"{name}: shape {tuple(a.shape)}, config says {want}")

    tokens, types = synthetic_vocab(vocab, bos, eos)
    arch = "qwen2"
    kvs = [
        ("general.architecture", STRING, arch),
        ("general.name", STRING, os.path.basename(os.path.normpath(args.checkpoint)) or "qwen2-vl-lm"),
        ("general.file_type", U32, FILE_TYPE[args.dtype]),
        ("general.alignment", U32, ALIGNMENT),
        (f"{arch}.context_length", U32, ctx_len),
        (f"{arch}.embedding_length", U32, hidden),
        (f"{arch}.block_count", U32, n_layer),
        (f"{arch}.feed_forward_length", U32, ffn),
        (f"{arch}.attention.head_count", U32, n_head),
        (f"{arch}.attention.head_count_kv", U32, n_kv),
        (f"{arch}.attention.key_length", U32, head_dim),
        (f"{arch}.attention.value_length", U32, head_dim),
        (f"{arch}.rope.dimension_count", U32, head_dim),
        (f"{arch}.rope.freq_base", F32, theta),
        (f"{arch}.attention.layer_norm_rms_epsilon", F32, eps),
        (f"{arch}.vocab_size", U32, vocab),
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.pre", STRING, "default"),
        ("tokenizer.ggml.tokens", ARRAY, tokens, STRING),
        ("tokenizer.ggml.token_type", ARRAY, types, I32),
        ("tokenizer.ggml.merges", ARRAY, [], STRING),
        ("tokenizer.ggml.bos_token_id", U32, bos),
        ("tokenizer.ggml.eos_token_id", U32, eos),
        ("tokenizer.ggml.add_bos_token", BOOL, False),
        ("tokenizer.ggml.add_eos_token", BOOL, False),
    ]
    size = write_gguf(args.out, kvs, out)
    print(f"wrote {args.out}: qwen2, {n_layer} layers, hidden {hidden}, heads {n_head}/{n_kv} x {head_dim}, "
          f"ffn {ffn}, vocab {vocab}, {'tied' if 'lm_head.weight' not in src else 'untied'}, "
          f"{args.dtype}, {len(out)} tensors, {size / 1e6:.1f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
