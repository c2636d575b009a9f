# Independent PyTorch transcription of HF transformers' Gemma-3 (Gemma3ForConditionalGeneration: the
# Gemma3 text model, the SigLIP vision tower and Gemma3MultiModalProjector), run on hash-derived weights
# so the C++ test can rebuild the same model without a checkpoint. Prints the golden header
# tests/model/gemma3_golden.h.
#
# Transcribed from transformers' src/transformers/models/gemma3/modeling_gemma3.py as of commits
# f14d0cbc824e447ef294d8cdc0f8ad4222f3dfee (Gemma3RMSNorm, Gemma3TextScaledWordEmbedding, Gemma3MLP,
# Gemma3Attention with q_norm/k_norm before RoPE, Gemma3DecoderLayer's four norms, rotary_emb_local =
# a copy of the config with rope_theta = rope_local_base_freq and rope_scaling default,
# Gemma3MultiModalProjector, token_type_ids_mask_function and the image_group_ids built in
# Gemma3Model.forward) and 0018aa647bb13801f061e2d1027c326f531b59fb (same arithmetic; per-layer-type
# rope_parameters instead of rotary_emb_local); src/transformers/masking_utils.py as of
# 00c4411cbe15d4c56d54d3b56d4d171e9c289dac (causal_mask_function kv <= q, sliding_window_overlay
# kv > q - window, the or_mask_function OR-ed over the (sliding) causal mask); and
# src/transformers/models/siglip/modeling_siglip.py as of 00b206564aa29563b46bfce0511de4a4f1eefc8c
# (SiglipVisionEmbeddings, SiglipAttention, SiglipEncoderLayer, SiglipMLP, post_layernorm).
# Image tokens attend bidirectionally within their image as HF does when the processor's
# token_type_ids (1 on the image token, 0 on boi/eoi) reach the model.
#
#   /usr/bin/python3 tests/model/reference/gemma3_reference.py > tests/model/gemma3_golden.h
#   clang-format -i tests/model/gemma3_golden.h
import math

import torch
import torch.nn.functional as F

torch.set_default_dtype(torch.float32)

# Gemma3Config::tiny() on the C++ side.
T = dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=96, eps=1e-6,
         query_pre_attn_scalar=24, sliding_window=5, pattern=2, theta=1e6, factor=8.0, local_theta=10000.0)
V = dict(hidden=32, inter=48, layers=2, heads=2, ch=3, image=16, patch=4, eps=1e-6)
IMG, BOI, EOI, MM_TOKENS = 90, 88, 89, 4
H, HD = T["hidden"], T["head_dim"]
E = V["hidden"]
PP = V["image"] // V["patch"]  # patches per side


def name_key(name):
    return sum((j + 1) * ord(c) for j, c in enumerate(name)) % 9973


def hashed(n, k, amp):
    i = torch.arange(n, dtype=torch.float64)
    h = torch.sin((i + 1) * 12.9898 + (k + 1) * 78.233) * 43758.5453
    return ((h - torch.floor(h) - 0.5) * 2 * amp).float()


LAYER_NORMS = ("layer_norm1.weight", "layer_norm2.weight", "vision_model.post_layernorm.weight")
GEMMA_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "pre_feedforward_layernorm.weight",
               "post_feedforward_layernorm.weight", "q_norm.weight", "k_norm.weight",
               "language_model.norm.weight", "mm_soft_emb_norm.weight")
W = {}


def w(name, *shape):
    n = math.prod(shape)
    key = name_key(name)
    if name.endswith(LAYER_NORMS):  # SigLIP nn.LayerNorm: stores the scale itself
        t = 1.0 + hashed(n, key, 0.2)
    elif name.endswith(GEMMA_NORMS):  # Gemma3RMSNorm: stores w, uses 1 + w
        t = hashed(n, key, 0.2)
    elif name.endswith("position_embedding.weight"):
        t = hashed(n, key, 0.5)
    else:
        t = hashed(n, key, 0.1)
    W[name] = t.view(*shape)


LM = "model.language_model"
VM = "model.vision_tower.vision_model"
PJ = "model.multi_modal_projector"
w(f"{LM}.embed_tokens.weight", T["vocab"], H)
for i in range(T["layers"]):
    p = f"{LM}.layers.{i}"
    for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
              "post_feedforward_layernorm"):
        w(f"{p}.{n}.weight", H)
    w(f"{p}.self_attn.q_proj.weight", T["heads"] * HD, H)
    w(f"{p}.self_attn.k_proj.weight", T["kv_heads"] * HD, H)
    w(f"{p}.self_attn.v_proj.weight", T["kv_heads"] * HD, H)
    w(f"{p}.self_attn.o_proj.weight", H, T["heads"] * HD)
    w(f"{p}.self_attn.q_norm.weight", HD)
    w(f"{p}.self_attn.k_norm.weight", HD)
    w(f"{p}.mlp.gate_proj.weight", T["inter"], H)
    w(f"{p}.mlp.up_proj.weight", T["inter"], H)
    w(f"{p}.mlp.down_proj.weight", H, T["inter"])
w(f"{LM}.norm.weight", H)
w(f"{VM}.embeddings.patch_embedding.weight", E, V["ch"], V["patch"], V["patch"])
w(f"{VM}.embeddings.patch_embedding.bias", E)
w(f"{VM}.embeddings.position_embedding.weight", PP * PP, E)
for i in range(V["layers"]):
    p = f"{VM}.encoder.layers.{i}"
    for n in ("layer_norm1", "layer_norm2"):
        w(f"{p}.{n}.weight", E)
        w(f"{p}.{n}.bias", E)
    for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
        w(f"{p}.self_attn.{n}.weight", E, E)
        w(f"{p}.self_attn.{n}.bias", E)
    w(f"{p}.mlp.fc1.weight", V["inter"], E)
    w(f"{p}.mlp.fc1.bias", V["inter"])
    w(f"{p}.mlp.fc2.weight", E, V["inter"])
    w(f"{p}.mlp.fc2.bias", E)
w(f"{VM}.post_layernorm.weight", E)
w(f"{VM}.post_layernorm.bias", E)
w(f"{PJ}.mm_soft_emb_norm.weight", E)
w(f"{PJ}.mm_input_projection_weight", E, H)

# The planted changes (the C++ test's bugs); the golden numbers use BASE.
BASE = dict(causal_images=False, ignore_window=False, window=T["sliding_window"], global_rope_everywhere=False,
            rms_plain_w=False)


def gemma_rms(x, weight, eps, opt):
    """Gemma3RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), computed in float32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    scale = weight.float() if opt["rms_plain_w"] else 1.0 + weight.float()
    return (y * scale).type_as(x)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ---- SigLIP vision tower + Gemma3MultiModalProjector ----
def siglip_layer(x, p):
    n, d = x.shape[0], x.shape[1]  # x: [images, patches, E]
    nh = V["heads"]
    vhd = E // nh
    h = F.layer_norm(x, (E,), W[f"{p}.layer_norm1.weight"], W[f"{p}.layer_norm1.bias"], V["eps"])
    q = F.linear(h, W[f"{p}.self_attn.q_proj.weight"], W[f"{p}.self_attn.q_proj.bias"])
    k = F.linear(h, W[f"{p}.self_attn.k_proj.weight"], W[f"{p}.self_attn.k_proj.bias"])
    v = F.linear(h, W[f"{p}.self_attn.v_proj.weight"], W[f"{p}.self_attn.v_proj.bias"])
    q, k, v = (t.view(n, d, nh, vhd).transpose(1, 2) for t in (q, k, v))
    a = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * vhd ** -0.5, dim=-1, dtype=torch.float32)
    o = torch.matmul(a, v).transpose(1, 2).reshape(n, d, E)
    x = x + F.linear(o, W[f"{p}.self_attn.out_proj.weight"], W[f"{p}.self_attn.out_proj.bias"])
    h = F.layer_norm(x, (E,), W[f"{p}.layer_norm2.weight"], W[f"{p}.layer_norm2.bias"], V["eps"])
    h = F.gelu(F.linear(h, W[f"{p}.mlp.fc1.weight"], W[f"{p}.mlp.fc1.bias"]), approximate="tanh")
    return x + F.linear(h, W[f"{p}.mlp.fc2.weight"], W[f"{p}.mlp.fc2.bias"])


def image_features(pixels, opt):
    """pixels [N, 3, 16, 16] -> [N, MM_TOKENS, H] (HF's get_image_features)."""
    x = F.conv2d(pixels, W[f"{VM}.embeddings.patch_embedding.weight"], W[f"{VM}.embeddings.patch_embedding.bias"],
                 stride=V["patch"])
    x = x.flatten(2).transpose(1, 2)  # [N, patches, E], patches row-major over the grid
    x = x + W[f"{VM}.embeddings.position_embedding.weight"][None]
    for i in range(V["layers"]):
        x = siglip_layer(x, f"{VM}.encoder.layers.{i}")
    x = F.layer_norm(x, (E,), W[f"{VM}.post_layernorm.weight"], W[f"{VM}.post_layernorm.bias"], V["eps"])
    n = x.shape[0]
    grid = x.transpose(1, 2).reshape(n, E, PP, PP).contiguous()
    kernel = PP // int(MM_TOKENS ** 0.5)
    pooled = F.avg_pool2d(grid, kernel_size=kernel, stride=kernel).flatten(2).transpose(1, 2)
    normed = gemma_rms(pooled, W[f"{PJ}.mm_soft_emb_norm.weight"], V["eps"], opt)
    return torch.matmul(normed, W[f"{PJ}.mm_input_projection_weight"])


# ---- Gemma3 language model (one unpadded row, positions arange(L)) ----
def is_sliding(i):
    return (i + 1) % T["pattern"] != 0


def image_groups(ids):
    """HF's image_group_ids: index of the maximal run of image tokens, -1 elsewhere."""
    groups, g, prev = [], -1, False
    for t in ids:
        img = t == IMG
        if img and not prev:
            g += 1
        groups.append(g if img else -1)
        prev = img
    return torch.tensor(groups)


def allowed(ids, sliding, opt):
    """[L, L] bool: query q may see key k."""
    L = len(ids)
    q = torch.arange(L).view(-1, 1)
    k = torch.arange(L).view(1, -1)
    ok = k <= q
    if sliding and not opt["ignore_window"]:
        ok = ok & (k > q - opt["window"])
    if not opt["causal_images"]:
        g = image_groups(ids)
        ok = ok | ((g.view(-1, 1) >= 0) & (g.view(-1, 1) == g.view(1, -1)))
    return ok


def rope(L, sliding, opt):
    if sliding and not opt["global_rope_everywhere"]:
        base, factor = T["local_theta"], 1.0
    else:
        base, factor = T["theta"], T["factor"]
    inv_freq = 1.0 / (base ** (torch.arange(0, HD, 2, dtype=torch.int64).float() / HD))
    inv_freq = inv_freq / factor  # linear rope_scaling (global layers only)
    freqs = torch.arange(L).float().view(-1, 1) * inv_freq.view(1, -1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def lm(ids, embeds, opt):
    """ids: list of L token ids; embeds: [images * MM_TOKENS, H] or None. Returns logits [L, vocab]."""
    L = len(ids)
    nh, nkv, eps = T["heads"], T["kv_heads"], T["eps"]
    rep = nh // nkv
    emb_w = W[f"{LM}.embed_tokens.weight"]
    ids_t = torch.tensor(ids)
    x = F.embedding(ids_t, emb_w) * torch.tensor(H ** 0.5).to(emb_w.dtype)
    if embeds is not None:
        mask = (ids_t == IMG).view(-1, 1).expand_as(x)
        x = x.masked_scatter(mask, embeds)  # projector output is not scaled
    min_v = torch.finfo(torch.float32).min
    for i in range(T["layers"]):
        p = f"{LM}.layers.{i}"
        sliding = is_sliding(i)
        bias = torch.zeros(L, L).masked_fill(~allowed(ids, sliding, opt), min_v)
        cos, sin = rope(L, sliding, opt)
        h = gemma_rms(x, W[f"{p}.input_layernorm.weight"], eps, opt)
        q = F.linear(h, W[f"{p}.self_attn.q_proj.weight"]).view(L, nh, HD)
        k = F.linear(h, W[f"{p}.self_attn.k_proj.weight"]).view(L, nkv, HD)
        v = F.linear(h, W[f"{p}.self_attn.v_proj.weight"]).view(L, nkv, HD)
        q = gemma_rms(q, W[f"{p}.self_attn.q_norm.weight"], eps, opt).transpose(0, 1)
        k = gemma_rms(k, W[f"{p}.self_attn.k_norm.weight"], eps, opt).transpose(0, 1)
        v = v.transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k[:, None].expand(nkv, rep, L, HD).reshape(nh, L, HD)  # query head j uses kv head j // rep
        v = v[:, None].expand(nkv, rep, L, HD).reshape(nh, L, HD)
        a = torch.matmul(q, k.transpose(1, 2)) * T["query_pre_attn_scalar"] ** -0.5 + bias
        a = torch.softmax(a, dim=-1, dtype=torch.float32)
        o = torch.matmul(a, v).transpose(0, 1).reshape(L, nh * HD)
        o = F.linear(o, W[f"{p}.self_attn.o_proj.weight"])
        x = x + gemma_rms(o, W[f"{p}.post_attention_layernorm.weight"], eps, opt)
        h = gemma_rms(x, W[f"{p}.pre_feedforward_layernorm.weight"], eps, opt)
        g = F.gelu(F.linear(h, W[f"{p}.mlp.gate_proj.weight"]), approximate="tanh")
        h = F.linear(g * F.linear(h, W[f"{p}.mlp.up_proj.weight"]), W[f"{p}.mlp.down_proj.weight"])
        x = x + gemma_rms(h, W[f"{p}.post_feedforward_layernorm.weight"], eps, opt)
    x = gemma_rms(x, W[f"{LM}.norm.weight"], eps, opt)
    return F.linear(x, emb_w)  # lm_head tied to embed_tokens; no final_logit_softcapping


# ---- the golden cases ----
u_vocab = hashed(T["vocab"], 4242, 1.0).double()
u_hidden = hashed(H, 4343, 1.0).double()
A, B, C, D = 1001, 1002, 1003, 1004


def image(key):
    return [BOI] + [IMG] * MM_TOKENS + [EOI]


def pixels(key):
    return hashed(V["ch"] * V["image"] * V["image"], key, 1.0).view(V["ch"], V["image"], V["image"])


def run_row(row, keys, opt):
    """Returns (projected logits [L] double, projected image embeddings [images * MM_TOKENS] or None, logits)."""
    embeds = None
    if keys:
        feats = image_features(torch.stack([pixels(k) for k in keys]), opt)
        embeds = feats.reshape(-1, H)
    logits = lm(row, embeds, opt)
    proj_e = None if embeds is None else embeds.double() @ u_hidden
    return logits.double() @ u_vocab, proj_e, logits


CASES = {
    "Text": [([2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [])],
    "OneImage": [([2, 5] + image(A) + [6, 7, 8, 9], [A])],
    "Batch": [([2, 3] + image(A) + [4, 5] + image(B) + [6], [A, B]), ([2, 7] + image(C) + [8, 9], [C])],
    "Turns": [([2, 9, 10, 11, 12, 13, 14, 15] + [16] + image(D) + [17, 18], [D])],
}


def with_opt(**kw):
    return dict(BASE, **kw)


def max_diff(a, b):
    return float((a - b).abs().max())


# Sanity checks. The mask with a window no row reaches equals the full (causal + same image) mask,
# and a run with that window equals one that gives the sliding layers the full mask.
for rows in CASES.values():
    for row, keys in rows:
        assert torch.equal(allowed(row, True, with_opt(window=100)), allowed(row, False, BASE))
        assert torch.equal(allowed(row, True, with_opt(causal_images=True, window=100)),
                           allowed(row, False, with_opt(causal_images=True)))
        wide = run_row(row, keys, with_opt(window=100))[0]
        full = run_row(row, keys, with_opt(ignore_window=True))[0]
        assert max_diff(wide, full) == 0.0, max_diff(wide, full)
one_row, one_keys = CASES["OneImage"][0]
causal_effect = max_diff(run_row(one_row, one_keys, BASE)[0], run_row(one_row, one_keys, with_opt(causal_images=True))[0])
assert causal_effect > 1e-3, causal_effect

PLANTED = [("causal image attention", dict(causal_images=True)),
           ("sliding window ignored", dict(ignore_window=True)),
           ("local RoPE base 1e6 with linear scaling", dict(global_rope_everywhere=True)),
           ("RMSNorm scale w instead of 1 + w", dict(rms_plain_w=True))]


def fmt(vals):
    return ", ".join(f"{v:.7g}" for v in vals)


print("#pragma once")
print()
print("// Golden numbers for the Gemma-3 model test, printed by the independent PyTorch transcription of HF's")
print("// Gemma3ForConditionalGeneration (Gemma3 text model, SigLIP vision tower, Gemma3MultiModalProjector) in")
print("// tests/model/reference/gemma3_reference.py on hash-derived weights (run with /usr/bin/python3 + Debian's")
print("// python3-torch, then clang-format; never produced by this library's code). Each row runs on its own,")
print("// unpadded, with positions 0..L-1:")
print("//   k<Case>Embedding: the projector's output rows (4 per image, images in order) projected on u_hidden")
print("//   k<Case>Row<r>: the logits of row r projected on u_vocab (one number per token)")
print("//")
print(f"// OneImage: making image attention causal moves kOneImageRow0 by max|diff| {causal_effect:.4g}.")
print("// Planted changes, max|diff| they cause in kBatchRow0 / kTextRow0:")
base_batch = run_row(*CASES["Batch"][0], BASE)[0]
base_text = run_row(*CASES["Text"][0], BASE)[0]
for label, kw in PLANTED:
    o = with_opt(**kw)
    db = max_diff(base_batch, run_row(*CASES["Batch"][0], o)[0])
    dt = max_diff(base_text, run_row(*CASES["Text"][0], o)[0])
    print(f"//   {label}: {db:.4g} / {dt:.4g}")
print()
print("#include <vector>")
print()
print("namespace vlmgen::gemma3_test::golden {")
print()
for name, rows in CASES.items():
    all_embeds, greedy, max_logit = [], [], 0.0
    lines = []
    for r, (row, keys) in enumerate(rows):
        proj, proj_e, logits = run_row(row, keys, BASE)
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
print("}  // namespace vlmgen::gemma3_test::golden")
