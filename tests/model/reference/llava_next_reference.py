# Independent PyTorch transcription of HF transformers' LLaVA-NeXT (LlavaNextForConditionalGeneration: the
# CLIP vision tower, LlavaNextMultiModalProjector, anyres packing with unpad and image_newline, and a Llama
# text model), run on hash-derived weights so the C++ test can rebuild the same model without a checkpoint.
# Prints the golden header tests/model/llava_next_golden.h.
#
# Transcribed from transformers' src/transformers/models/llava_next/modeling_llava_next.py as of commits
# 00dcc6dda6f6d8e69541a6b51f97986a80242367 (get_anyres_image_grid_shape, image_size_to_num_patches, unpad_image
# with int(round(x, 7)), pack_image_features, get_image_features: hidden_states[vision_feature_layer], "default"
# drops column 0, projector, torch.split by tile counts) and 3571987262f13e18288121900a97d950641ac2b3 (same
# arithmetic); processing_llava_next.py as of 81bb907ccf3494b5409b0b745bb10c8a617050b7 (_get_number_of_features,
# _get_unpadded_features, num_additional_image_tokens subtracted for "default"); image_processing_llava_next.py
# as of 2ccc6cae21faaf11631efa5fb9054687ae5dc931 (divide_to_patches row-major, base image first);
# src/transformers/image_processing_utils.py as of d05a9215b4f311963e465b99753ac711fb828893
# (select_best_resolution); src/transformers/models/clip/modeling_clip.py as of
# 679021a6b0ded09d623a96e2bd2f822c5a548872 (CLIPVisionEmbeddings, pre_layrnorm before the encoder, CLIPEncoder's
# hidden_states = (pre_layrnorm output, layer 1, ..., layer L), post_layernorm on the pooled CLS only);
# src/transformers/models/llama/modeling_llama.py as of 5dd4a63548857797727ae73eeb6a6e886ea02a3e (LlamaRMSNorm,
# default RoPE, repeat_kv, eager attention, LlamaMLP); src/transformers/activations.py as of
# d60525f3595f8214576d6b8f1c54ac7cd0b5c42c ("gelu" = F.gelu, the exact erf form).
#
#   /usr/bin/python3 tests/model/reference/llava_next_reference.py > tests/model/llava_next_golden.h
#   clang-format -i tests/model/llava_next_golden.h
import math
import textwrap

import torch
import torch.nn.functional as F

torch.set_default_dtype(torch.float32)

# LlavaNextConfig::tiny() on the C++ side.
T = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=96, eps=1e-5, theta=10000.0)
V = dict(hidden=32, inter=48, layers=3, heads=2, ch=3, image=8, patch=4, eps=1e-5)
IMG = 90
PINPOINTS = [[8, 16], [16, 8], [16, 16], [8, 24], [24, 8]]  # (height, width)
H, HD = T["hidden"], T["head_dim"]
E = V["hidden"]
PP = V["image"] // V["patch"]  # patches per tile side
NUM_ADDITIONAL = 1  # the CLS token (processor's num_additional_image_tokens)


def name_key(name):
    return sum((j + 1) * ord(c) for j, c in enumerate(name)) % 9973


def hashed(n, k, amp):
    i = torch.arange(n, dtype=torch.float64)
    h = torch.sin((i + 1) * 12.9898 + (k + 1) * 78.233) * 43758.5453
    return ((h - torch.floor(h) - 0.5) * 2 * amp).float()


NORMS = ("layernorm.weight", "layer_norm1.weight", "layer_norm2.weight", "pre_layrnorm.weight",
         "post_layernorm.weight", "norm.weight")
W = {}


def w(name, *shape):
    n = math.prod(shape)
    key = name_key(name)
    if name.endswith(NORMS):  # LlamaRMSNorm and nn.LayerNorm both store the scale itself
        t = 1.0 + hashed(n, key, 0.2)
    elif name.endswith(("position_embedding.weight", "class_embedding", "image_newline")):
        t = hashed(n, key, 0.5)
    else:
        t = hashed(n, key, 0.1)
    W[name] = t.view(*shape)


def wb(prefix, *shape):  # a weight and its bias
    w(f"{prefix}.weight", *shape)
    w(f"{prefix}.bias", shape[0])


LM = "model.language_model"
VM = "model.vision_tower.vision_model"
PJ = "model.multi_modal_projector"
NL = "model.image_newline"
w(f"{LM}.embed_tokens.weight", T["vocab"], H)
for i in range(T["layers"]):
    p = f"{LM}.layers.{i}"
    for n, shape in (("input_layernorm", (H,)), ("post_attention_layernorm", (H,)),
                     ("self_attn.q_proj", (T["heads"] * HD, H)), ("self_attn.k_proj", (T["kv_heads"] * HD, H)),
                     ("self_attn.v_proj", (T["kv_heads"] * HD, H)), ("self_attn.o_proj", (H, T["heads"] * HD)),
                     ("mlp.gate_proj", (T["inter"], H)), ("mlp.up_proj", (T["inter"], H)),
                     ("mlp.down_proj", (H, T["inter"]))):
        w(f"{p}.{n}.weight", *shape)
w(f"{LM}.norm.weight", H)
w("lm_head.weight", T["vocab"], H)
w(f"{VM}.embeddings.class_embedding", E)
w(f"{VM}.embeddings.patch_embedding.weight", E, V["ch"], V["patch"], V["patch"])
w(f"{VM}.embeddings.position_embedding.weight", PP * PP + 1, E)
for i in range(V["layers"]):
    p = f"{VM}.encoder.layers.{i}"
    for n, shape in (("layer_norm1", (E,)), ("layer_norm2", (E,)), ("self_attn.q_proj", (E, E)),
                     ("self_attn.k_proj", (E, E)), ("self_attn.v_proj", (E, E)), ("self_attn.out_proj", (E, E)),
                     ("mlp.fc1", (V["inter"], E)), ("mlp.fc2", (E, V["inter"]))):
        wb(f"{p}.{n}", *shape)
wb(f"{VM}.pre_layrnorm", E)
wb(f"{VM}.post_layernorm", E)  # in checkpoints; LLaVA-NeXT's features never pass through it
wb(f"{PJ}.linear_1", H, E)
wb(f"{PJ}.linear_2", H, H)
w(NL, H)

# The planted changes (the C++ test's bugs); the golden numbers use BASE.
BASE = dict(layer=-2, strategy="default", newline="keep", unpad=True, interleave=True, sizes={})


# ---- anyres geometry: the processor's count and the model's grid ----
def best_resolution(size):
    """select_best_resolution: max effective pixels, then min waste; the first pinpoint wins a full tie."""
    oh, ow = size
    best, best_eff, best_waste = None, 0, float("inf")
    for ph, pw in PINPOINTS:
        s = min(pw / ow, ph / oh)
        eff = min(int(ow * s) * int(oh * s), ow * oh)
        waste = ph * pw - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (ph, pw), eff, waste
    return best


def num_tiles(size):
    bh, bw = best_resolution(size)
    return 1 + (bh // V["image"]) * (bw // V["image"])


def processor_count(size, strategy="default"):
    """LlavaNextProcessor._get_number_of_features (integer arithmetic), minus the CLS for "default"."""
    oh, ow = size
    bh, bw = best_resolution(size)
    gh, gw = PP * (bh // V["image"]), PP * (bw // V["image"])
    if ow / oh > gw / gh:
        gh -= 2 * ((gh - (oh * gw) // ow) // 2)
    else:
        gw -= 2 * ((gw - (ow * gh) // oh) // 2)
    n = gh * gw + gh + PP * PP + NUM_ADDITIONAL
    return n - NUM_ADDITIONAL if strategy == "default" else n


def unpad(g, size):
    """unpad_image on [C, rows, cols]: float scale, int(round(., 7)), symmetric crop of (cur - new) // 2."""
    oh, ow = size
    ch, cw = g.shape[1], g.shape[2]
    if ow / oh > cw / ch:
        pad = (ch - int(round(oh * (cw / ow), 7))) // 2
        return g[:, pad:ch - pad, :]
    pad = (cw - int(round(ow * (ch / oh), 7))) // 2
    return g[:, :, pad:cw - pad]


# ---- CLIP vision tower + LlavaNextMultiModalProjector + pack_image_features ----
def clip_layer(x, p):
    n, d = x.shape[0], x.shape[1]  # x: [tiles, positions, E]
    nh, vhd = V["heads"], E // V["heads"]
    h = F.layer_norm(x, (E,), W[f"{p}.layer_norm1.weight"], W[f"{p}.layer_norm1.bias"], V["eps"])
    q, k, v = (F.linear(h, W[f"{p}.self_attn.{n_}_proj.weight"], W[f"{p}.self_attn.{n_}_proj.bias"])
               .view(n, d, nh, vhd).transpose(1, 2) for n_ in ("q", "k", "v"))
    a = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * vhd ** -0.5, dim=-1)
    o = torch.matmul(a, v).transpose(1, 2).reshape(n, d, E)
    x = x + F.linear(o, W[f"{p}.self_attn.out_proj.weight"], W[f"{p}.self_attn.out_proj.bias"])
    h = F.layer_norm(x, (E,), W[f"{p}.layer_norm2.weight"], W[f"{p}.layer_norm2.bias"], V["eps"])
    h = F.linear(h, W[f"{p}.mlp.fc1.weight"], W[f"{p}.mlp.fc1.bias"])
    h = h * torch.sigmoid(1.702 * h)  # quick_gelu
    return x + F.linear(h, W[f"{p}.mlp.fc2.weight"], W[f"{p}.mlp.fc2.bias"])


def vision_hidden_states(pixels):
    """pixels [tiles, 3, 8, 8] -> (pre_layrnorm output, after layer 1, ..., after layer L)."""
    x = F.conv2d(pixels, W[f"{VM}.embeddings.patch_embedding.weight"], stride=V["patch"])  # no bias
    x = x.flatten(2).transpose(1, 2)  # [tiles, 4, E], patches row-major
    cls = W[f"{VM}.embeddings.class_embedding"].view(1, 1, E).expand(x.shape[0], 1, E)
    x = torch.cat([cls, x], dim=1) + W[f"{VM}.embeddings.position_embedding.weight"][None]
    x = F.layer_norm(x, (E,), W[f"{VM}.pre_layrnorm.weight"], W[f"{VM}.pre_layrnorm.bias"], V["eps"])
    states = [x]
    for i in range(V["layers"]):
        x = clip_layer(x, f"{VM}.encoder.layers.{i}")
        states.append(x)
    return states


def projector(x):
    x = F.gelu(F.linear(x, W[f"{PJ}.linear_1.weight"], W[f"{PJ}.linear_1.bias"]))  # exact (erf) GELU
    return F.linear(x, W[f"{PJ}.linear_2.weight"], W[f"{PJ}.linear_2.bias"])


def pack(feats, size, opt):
    """pack_image_features for one image: feats [tiles, per-tile rows, H] -> [rows, H]."""
    base, grid = feats[0], feats[1:]
    bh, bw = best_resolution(size)
    nph, npw = bh // V["image"], bw // V["image"]
    g = grid.reshape(nph, npw, PP, PP, -1)  # HF's view: -1 absorbs whatever is left
    if opt["interleave"]:
        g = g.permute(4, 0, 2, 1, 3)  # [C, tile row, patch row, tile col, patch col]
    else:
        g = g.permute(4, 0, 1, 2, 3)  # planted: tiles not interleaved
    g = g.reshape(g.shape[0], nph * PP, npw * PP)
    if opt["unpad"]:
        g = unpad(g, size)
    if opt["newline"] != "drop":
        nl = W[NL] if opt["newline"] == "keep" else torch.zeros(H)
        g = torch.cat([g, nl.view(-1, 1, 1).expand(g.shape[0], g.shape[1], 1)], dim=2)  # one per grid row
    return torch.cat([base, g.flatten(1).transpose(0, 1)], dim=0)


def image_rows(img, opt):
    """One image's packed rows: its num_tiles pixels are hashed(tiles * 3 * 8 * 8, key, 1.0) (tile 0 the base)."""
    key, size = img
    n = num_tiles(size)
    pixels = hashed(n * V["ch"] * V["image"] ** 2, key, 1.0).view(n, V["ch"], V["image"], V["image"])
    feats = vision_hidden_states(pixels)[opt["layer"]]
    if opt["strategy"] == "default":
        feats = feats[:, 1:]
    return pack(projector(feats), opt["sizes"].get(key, size), opt)


# ---- Llama language model (one unpadded row, positions arange(L)) ----
def rms(x, weight):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + T["eps"])).type_as(x)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def lm(ids, embeds):
    """ids: list of L token ids; embeds: [image rows, H] or None. Returns logits [L, vocab]."""
    L = len(ids)
    nh, nkv, rep = T["heads"], T["kv_heads"], T["heads"] // T["kv_heads"]
    ids_t = torch.tensor(ids)
    x = F.embedding(ids_t, W[f"{LM}.embed_tokens.weight"])  # Llama: no embedding scale
    if embeds is not None:
        x = x.masked_scatter((ids_t == IMG).view(-1, 1).expand_as(x), embeds)
    bias = torch.zeros(L, L).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    inv_freq = 1.0 / (T["theta"] ** (torch.arange(0, HD, 2, dtype=torch.int64).float() / HD))
    freqs = torch.arange(L).float().view(-1, 1) * inv_freq.view(1, -1)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    for i in range(T["layers"]):
        p = f"{LM}.layers.{i}"
        h = rms(x, W[f"{p}.input_layernorm.weight"])
        q = F.linear(h, W[f"{p}.self_attn.q_proj.weight"]).view(L, nh, HD).transpose(0, 1)
        k = F.linear(h, W[f"{p}.self_attn.k_proj.weight"]).view(L, nkv, HD).transpose(0, 1)
        v = F.linear(h, W[f"{p}.self_attn.v_proj.weight"]).view(L, nkv, HD).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k[:, None].expand(nkv, rep, L, HD).reshape(nh, L, HD)  # query head j uses kv head j // rep
        v = v[:, None].expand(nkv, rep, L, HD).reshape(nh, L, HD)
        a = torch.softmax(torch.matmul(q, k.transpose(1, 2)) * HD ** -0.5 + bias, dim=-1, dtype=torch.float32)
        o = torch.matmul(a, v).transpose(0, 1).reshape(L, nh * HD)
        x = x + F.linear(o, W[f"{p}.self_attn.o_proj.weight"])
        h = rms(x, W[f"{p}.post_attention_layernorm.weight"])
        h = F.silu(F.linear(h, W[f"{p}.mlp.gate_proj.weight"])) * F.linear(h, W[f"{p}.mlp.up_proj.weight"])
        x = x + F.linear(h, W[f"{p}.mlp.down_proj.weight"])
    return F.linear(rms(x, W[f"{LM}.norm.weight"]), W["lm_head.weight"])  # lm_head not tied


# ---- the golden cases ----
u_vocab = hashed(T["vocab"], 4242, 1.0).double()
u_hidden = hashed(H, 4343, 1.0).double()
A, B, C, D = (1001, (10, 30)), (1002, (20, 12)), (1003, (20, 12)), (1004, (12, 20))
IMAGES = dict(A=A, B=B, C=C, D=D)


def run_row(row, opt):
    """row: token ids and images. Returns (projected logits [L], projected image rows or None, logits)."""
    ids, rows = [], []
    for item in row:
        if isinstance(item, tuple):
            r = image_rows(item, opt)
            n = processor_count(item[1])
            assert r.shape[0] == n, (item, r.shape[0], n)
            ids += [IMG] * n
            rows.append(r)
        else:
            ids.append(item)
    embeds = torch.cat(rows) if rows else None
    logits = lm(ids, embeds)
    proj_e = None if embeds is None else embeds.double() @ u_hidden
    return logits.double() @ u_vocab, proj_e, logits


CASES = {
    "Text": [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]],
    "OneImage": [[1, 5, A, 6, 7]],
    "Batch": [[1, 3, A, 4, B, 5], [1, 7, C, 8, 9]],
    "Turns": [[1, 9, 10, 11, A, 12, 13, D, 14, 15]],
}


def with_opt(**kw):
    return dict(BASE, **kw)


def rows_of(img, opt):
    """The packed row count under opt, or "raises" where pack_image_features' tensor ops fail."""
    try:
        return image_rows(img, opt).shape[0]
    except RuntimeError:
        return "raises"


# Sanity checks: the processor's count equals the model's packed rows for every image; A's aspect ratio
# matches its 1x3 grid exactly, so its unpad is a no-op; B/C given as (12, 20) keep their 5 tiles.
COUNTS = {name: processor_count(size) for name, (_, size) in IMAGES.items()}
for name, img in IMAGES.items():
    assert rows_of(img, BASE) == COUNTS[name], (name, rows_of(img, BASE), COUNTS[name])
assert torch.equal(image_rows(A, BASE), image_rows(A, with_opt(unpad=False)))
assert best_resolution(B[1]) == best_resolution(D[1]) == (16, 16) and best_resolution(A[1]) == (8, 24)
assert num_tiles((12, 20)) == num_tiles(B[1])

batch_row = CASES["Batch"][0]
base_batch = run_row(batch_row, BASE)[0]


def effect(**kw):
    return f"{float((base_batch - run_row(batch_row, with_opt(**kw))[0]).abs().max()):.4g}"


def counts(**kw):
    o = with_opt(**kw)
    return f"rows A {rows_of(A, o)}, B/C {rows_of(B, o)} (placeholders {COUNTS['A']}, {COUNTS['B']})"


FULL_ROWS = rows_of(A, with_opt(strategy="full"))
assert FULL_ROWS == rows_of(B, with_opt(strategy="full")) == "raises"
swapped = {B[0]: (12, 20), C[0]: (12, 20)}
PLANTED = [
    ("image_newline rows dropped", counts(newline="drop")),
    ("image_newline zeroed (rows kept)", effect(newline="zero")),
    ("image_sizes of B/C as (12, 20) (same 5 tiles)",
     f"placeholders and rows {processor_count((12, 20))} / {rows_of(B, with_opt(sizes=swapped))} (vs {COUNTS['B']})"),
    ("vision_feature_layer -1", effect(layer=-1)),
    ('"full" strategy (CLS kept)', f"placeholders A {processor_count(A[1], 'full')}, B/C "
     f"{processor_count(B[1], 'full')} (vs {COUNTS['A']}, {COUNTS['B']}); pack_image_features {FULL_ROWS} (its view "
     "gives 80 channels, image_newline has 64)"),
    ("unpad skipped", counts(unpad=False) + "; A's unpad is a no-op"),
    ("tiles not interleaved (permute 4,0,1,2,3)", effect(interleave=False)),
]


def fmt(vals):
    return ", ".join(f"{v:.7g}" for v in vals)


print("#pragma once")
print()
print("// Golden numbers for the LLaVA-NeXT model test, printed by the independent PyTorch transcription of HF's")
print("// LlavaNextForConditionalGeneration (CLIP vision tower, LlavaNextMultiModalProjector, anyres packing with")
print("// unpad and image_newline, Llama text model) in tests/model/reference/llava_next_reference.py on")
print("// hash-derived weights (run with /usr/bin/python3 + Debian's python3-torch, then clang-format; never")
print("// produced by this library's code). Each row runs on its own, unpadded, with positions 0..L-1; an image")
print("// is kCount<X> copies of token 90 (LlavaNextProcessor's count, equal to pack_image_features' rows):")
print("//   k<Case>Embedding: the packed image rows (images in order) projected on u_hidden")
print("//   k<Case>Row<r>: the logits of row r projected on u_vocab (one number per token)")
print("// Images (pixels key, original (h, w) -> best pinpoint (h, w), tiles incl. the base):")
for name, (k, size) in IMAGES.items():
    print(f"//   {name}: {k}, {size} -> {best_resolution(size)}, {num_tiles(size)}")
print("//")
print("// Planted changes, effect on kBatchRow0 (max|diff|) or on the counts:")
for label, text in PLANTED:
    print("\n".join(textwrap.wrap(f"{label}: {text}", 117, initial_indent="//   ", subsequent_indent="//     ")))
print()
print("#include <vector>")
print()
print("namespace vlmgen::llava_next_test::golden {")
print()
for name, n in COUNTS.items():
    print(f"constexpr int kCount{name} = {n};")
print()
for name, rows in CASES.items():
    all_embeds, greedy, max_logit = [], [], 0.0
    lines = []
    for r, row in enumerate(rows):
        proj, proj_e, logits = run_row(row, BASE)
        if proj_e is not None:
            all_embeds += proj_e.tolist()
        lines.append(f"const std::vector<double> k{name}Row{r} = {{{fmt(proj.tolist())}}};")
        greedy.append(int(logits[-1].argmax()))
        max_logit = max(max_logit, float(logits.abs().max()))
    if all_embeds:
        print(f"const std::vector<double> k{name}Embedding = {{{fmt(all_embeds)}}};")
    for line in lines:
        print(line)
    print(f"// {name}: max |logit| {max_logit:.4g}; greedy last: {greedy}")
print()
print("}  // namespace vlmgen::llava_next_test::golden")
