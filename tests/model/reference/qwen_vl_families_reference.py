# Independent PyTorch transcription of HF transformers' Qwen2.5-VL and Qwen3-VL modeling code,
# run on hash-derived weights so the C++ test (tests/model/qwen_families_test.cpp) can rebuild
# the same models without a checkpoint. Prints golden numbers for that test.
#
# Transcribed from transformers' modeling_qwen2_5_vl.py (Qwen2_5_VisionTransformerPretrainedModel:
# get_window_index, rot_pos_emb, the window reordering and its reverse after the merger,
# Qwen2_5_VLVisionBlock with Qwen2RMSNorm and Qwen2_5_VLMLP, Qwen2_5_VLPatchMerger) and
# modeling_qwen3_vl.py as of transformers commit 8cb5963cc22174954e7dca2c0a3320b7dc2f4edc
# (Qwen3VLVisionModel: fast_pos_embed_interpolate, rot_pos_emb, Qwen3VLVisionBlock,
# Qwen3VLVisionPatchMerger with and without postshuffle norm, deepstack_merger_list;
# Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope, Qwen3VLTextAttention with q_norm/k_norm,
# Qwen3VLTextModel._deepstack_process); get_rope_index for images (Qwen2.5-VL gives every frame of
# an image time 0, Qwen3-VL counts frames).
#
#   python3 tests/model/reference/qwen_vl_families_reference.py qwen2_5_vl
#   python3 tests/model/reference/qwen_vl_families_reference.py qwen3_vl
import math
import sys

import torch
import torch.nn.functional as F

torch.set_default_dtype(torch.float32)
FAMILY = sys.argv[1] if len(sys.argv) > 1 else "qwen2_5_vl"
assert FAMILY in ("qwen2_5_vl", "qwen3_vl")
Q3 = FAMILY == "qwen3_vl"

# QwenVlConfig::tiny(family)
C = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128, eps=1e-6, theta=10000.0,
         mrope=[3, 3, 2] if Q3 else [2, 3, 3], vocab=96, image=90, vs=88, ve=89)
V = dict(depth=3 if Q3 else 2, embed=32, heads=2, inter=48, ch=3, patch=4, tp=2, merge=2,
         window=16, fullatt=[1], pos=16, deepstack=[1, 2])


def name_key(name):
    return sum((j + 1) * ord(c) for j, c in enumerate(name)) % 9973


def hashed(n, k, amp):
    i = torch.arange(n, dtype=torch.float64)
    h = torch.sin((i + 1) * 12.9898 + (k + 1) * 78.233) * 43758.5453
    return ((h - torch.floor(h) - 0.5) * 2 * amp).float()


def is_norm(name):
    return any(name.endswith(s) for s in ("norm1.weight", "norm2.weight", "ln_q.weight", "norm.weight",
                                          "layernorm.weight"))


W = {}


def w(name, *shape):
    n = 1
    for s in shape:
        n *= s
    if is_norm(name):
        t = 1.0 + hashed(n, name_key(name), 0.2)
    elif name.endswith("pos_embed.weight"):
        t = hashed(n, name_key(name), 0.5)
    else:
        t = hashed(n, name_key(name), 0.1)
    W[name] = t.view(*shape)


E, m = V["embed"], V["merge"]
MU = m * m
w("visual.patch_embed.proj.weight", E, V["ch"], V["tp"], V["patch"], V["patch"])
if Q3:
    w("visual.patch_embed.proj.bias", E)
    w("visual.pos_embed.weight", V["pos"], E)
for i in range(V["depth"]):
    p = f"visual.blocks.{i}"
    for n in ("norm1", "norm2"):
        w(f"{p}.{n}.weight", E)
        if Q3:
            w(f"{p}.{n}.bias", E)
    w(f"{p}.attn.qkv.weight", 3 * E, E); w(f"{p}.attn.qkv.bias", 3 * E)
    w(f"{p}.attn.proj.weight", E, E); w(f"{p}.attn.proj.bias", E)
    if Q3:
        w(f"{p}.mlp.linear_fc1.weight", V["inter"], E); w(f"{p}.mlp.linear_fc1.bias", V["inter"])
        w(f"{p}.mlp.linear_fc2.weight", E, V["inter"]); w(f"{p}.mlp.linear_fc2.bias", E)
    else:
        for n in ("gate_proj", "up_proj"):
            w(f"{p}.mlp.{n}.weight", V["inter"], E); w(f"{p}.mlp.{n}.bias", V["inter"])
        w(f"{p}.mlp.down_proj.weight", E, V["inter"]); w(f"{p}.mlp.down_proj.bias", E)
if Q3:
    mergers = [("visual.merger", False)] + [(f"visual.deepstack_merger_list.{k}", True)
                                            for k in range(len(V["deepstack"]))]
    for p, post in mergers:
        w(f"{p}.norm.weight", E * MU if post else E); w(f"{p}.norm.bias", E * MU if post else E)
        w(f"{p}.linear_fc1.weight", E * MU, E * MU); w(f"{p}.linear_fc1.bias", E * MU)
        w(f"{p}.linear_fc2.weight", C["hidden"], E * MU); w(f"{p}.linear_fc2.bias", C["hidden"])
else:
    w("visual.merger.ln_q.weight", E)
    w("visual.merger.mlp.0.weight", E * MU, E * MU); w("visual.merger.mlp.0.bias", E * MU)
    w("visual.merger.mlp.2.weight", C["hidden"], E * MU); w("visual.merger.mlp.2.bias", C["hidden"])
H, hd = C["hidden"], C["head_dim"]
w("model.embed_tokens.weight", C["vocab"], H)
for i in range(C["layers"]):
    p = f"model.layers.{i}"
    w(f"{p}.self_attn.q_proj.weight", C["heads"] * hd, H)
    w(f"{p}.self_attn.k_proj.weight", C["kv_heads"] * hd, H)
    w(f"{p}.self_attn.v_proj.weight", C["kv_heads"] * hd, H)
    if Q3:
        w(f"{p}.self_attn.q_norm.weight", hd); w(f"{p}.self_attn.k_norm.weight", hd)
    else:
        w(f"{p}.self_attn.q_proj.bias", C["heads"] * hd)
        w(f"{p}.self_attn.k_proj.bias", C["kv_heads"] * hd)
        w(f"{p}.self_attn.v_proj.bias", C["kv_heads"] * hd)
    w(f"{p}.self_attn.o_proj.weight", H, C["heads"] * hd)
    w(f"{p}.mlp.gate_proj.weight", C["inter"], H); w(f"{p}.mlp.up_proj.weight", C["inter"], H)
    w(f"{p}.mlp.down_proj.weight", H, C["inter"])
    w(f"{p}.input_layernorm.weight", H); w(f"{p}.post_attention_layernorm.weight", H)
w("model.norm.weight", H)
w("lm_head.weight", C["vocab"], H)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rms(x, weight, eps):
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


# ---- vision (HF structure) ----
def rot_pos_emb(grid_thw, vhd):
    pos_ids = []
    for t, h, ww in grid_thw.tolist():
        hpos = torch.arange(h).unsqueeze(1).expand(-1, ww)
        hpos = hpos.reshape(h // m, m, ww // m, m).permute(0, 2, 1, 3).flatten()
        wpos = torch.arange(ww).unsqueeze(0).expand(h, -1)
        wpos = wpos.reshape(h // m, m, ww // m, m).permute(0, 2, 1, 3).flatten()
        pos_ids.append(torch.stack([hpos, wpos], dim=-1).repeat(t, 1))
    pos_ids = torch.cat(pos_ids, dim=0)
    max_grid = int(grid_thw[:, 1:].max())
    dim = vhd // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    full = torch.outer(torch.arange(max_grid, dtype=torch.float), inv_freq)
    return full[pos_ids].flatten(1)


def get_window_index(grid_thw):
    window_index = []
    cu_window_seqlens = [0]
    window_index_id = 0
    vmws = V["window"] // m // V["patch"]
    for gt, gh, gw in grid_thw.tolist():
        lh, lw = gh // m, gw // m
        index = torch.arange(gt * lh * lw).reshape(gt, lh, lw)
        pad_h = vmws - lh % vmws
        pad_w = vmws - lw % vmws
        nwh = (lh + pad_h) // vmws
        nww = (lw + pad_w) // vmws
        ip = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        ip = ip.reshape(gt, nwh, vmws, nww, vmws).permute(0, 1, 3, 2, 4).reshape(gt, nwh * nww, vmws, vmws)
        seqlens = (ip != -100).sum([2, 3]).reshape(-1)
        ip = ip.reshape(-1)
        window_index.append(ip[ip != -100] + window_index_id)
        cu_tmp = seqlens.cumsum(0) * MU + cu_window_seqlens[-1]
        cu_window_seqlens.extend(cu_tmp.tolist())
        window_index_id += gt * lh * lw
    return torch.cat(window_index, dim=0), cu_window_seqlens


def fast_pos_embed_interpolate(grid_thw):
    side = int(V["pos"] ** 0.5)
    idx_list = [[] for _ in range(4)]
    weight_list = [[] for _ in range(4)]
    for t, h, ww in grid_thw.tolist():
        h_idxs = torch.linspace(0, side - 1, h)
        w_idxs = torch.linspace(0, side - 1, ww)
        h_floor = h_idxs.int()
        w_floor = w_idxs.int()
        h_ceil = (h_idxs.int() + 1).clip(max=side - 1)
        w_ceil = (w_idxs.int() + 1).clip(max=side - 1)
        dh = h_idxs - h_floor
        dw = w_idxs - w_floor
        base_h = h_floor * side
        base_h_ceil = h_ceil * side
        indices = [(base_h[None].T + w_floor[None]).flatten(), (base_h[None].T + w_ceil[None]).flatten(),
                   (base_h_ceil[None].T + w_floor[None]).flatten(), (base_h_ceil[None].T + w_ceil[None]).flatten()]
        weights = [((1 - dh)[None].T * (1 - dw)[None]).flatten(), ((1 - dh)[None].T * dw[None]).flatten(),
                   (dh[None].T * (1 - dw)[None]).flatten(), (dh[None].T * dw[None]).flatten()]
        for i in range(4):
            idx_list[i].extend(indices[i].tolist())
            weight_list[i].extend(weights[i].tolist())
    idx = torch.tensor(idx_list, dtype=torch.long)
    wt = torch.tensor(weight_list, dtype=torch.float32)
    pe = F.embedding(idx, W["visual.pos_embed.weight"]) * wt[:, :, None]
    patch_pos = pe[0] + pe[1] + pe[2] + pe[3]
    patch_pos = patch_pos.split([h * ww for _, h, ww in grid_thw.tolist()])
    out = []
    for pos, (t, h, ww) in zip(patch_pos, grid_thw.tolist()):
        pos = pos.repeat(t, 1)
        pos = pos.view(t, h // m, m, ww // m, m, -1).permute(0, 1, 3, 2, 4, 5).flatten(0, 4)
        out.append(pos)
    return torch.cat(out)


def block_mask(cu, n):
    mask = torch.full([1, n, n], torch.finfo(torch.float32).min)
    for j in range(1, len(cu)):
        mask[..., cu[j - 1]:cu[j], cu[j - 1]:cu[j]] = 0
    return mask


def vision_block(x, p, cos, sin, mask):
    n = x.shape[0]
    vhd = E // V["heads"]
    if Q3:
        h = F.layer_norm(x, (E,), W[f"{p}.norm1.weight"], W[f"{p}.norm1.bias"], 1e-6)
    else:
        h = rms(x, W[f"{p}.norm1.weight"], 1e-6)
    q, k, v = F.linear(h, W[f"{p}.attn.qkv.weight"], W[f"{p}.attn.qkv.bias"]).reshape(
        n, 3, V["heads"], -1).permute(1, 0, 2, 3).unbind(0)
    q = q * cos.unsqueeze(-2) + rotate_half(q) * sin.unsqueeze(-2)
    k = k * cos.unsqueeze(-2) + rotate_half(k) * sin.unsqueeze(-2)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    a = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(vhd) + mask
    a = torch.softmax(a, dim=-1)
    o = torch.matmul(a, v).transpose(0, 1).reshape(n, -1)
    x = x + F.linear(o, W[f"{p}.attn.proj.weight"], W[f"{p}.attn.proj.bias"])
    if Q3:
        h = F.layer_norm(x, (E,), W[f"{p}.norm2.weight"], W[f"{p}.norm2.bias"], 1e-6)
        h = F.gelu(F.linear(h, W[f"{p}.mlp.linear_fc1.weight"], W[f"{p}.mlp.linear_fc1.bias"]), approximate="tanh")
        return x + F.linear(h, W[f"{p}.mlp.linear_fc2.weight"], W[f"{p}.mlp.linear_fc2.bias"])
    h = rms(x, W[f"{p}.norm2.weight"], 1e-6)
    g = F.silu(F.linear(h, W[f"{p}.mlp.gate_proj.weight"], W[f"{p}.mlp.gate_proj.bias"]))
    u = F.linear(h, W[f"{p}.mlp.up_proj.weight"], W[f"{p}.mlp.up_proj.bias"])
    return x + F.linear(g * u, W[f"{p}.mlp.down_proj.weight"], W[f"{p}.mlp.down_proj.bias"])


def q3_merger(x, p, post):
    if post:
        x = F.layer_norm(x.view(-1, E * MU), (E * MU,), W[f"{p}.norm.weight"], W[f"{p}.norm.bias"], 1e-6)
    else:
        x = F.layer_norm(x, (E,), W[f"{p}.norm.weight"], W[f"{p}.norm.bias"], 1e-6).view(-1, E * MU)
    x = F.gelu(F.linear(x, W[f"{p}.linear_fc1.weight"], W[f"{p}.linear_fc1.bias"]))
    return F.linear(x, W[f"{p}.linear_fc2.weight"], W[f"{p}.linear_fc2.bias"])


def vision_tower(pixels, grid_thw):
    """Returns (merged embeddings [N, H], list of DeepStack features [N, H])."""
    x = pixels.view(-1, V["ch"], V["tp"], V["patch"], V["patch"])
    bias = W.get("visual.patch_embed.proj.bias")
    x = F.conv3d(x, W["visual.patch_embed.proj.weight"], bias, stride=(V["tp"], V["patch"], V["patch"])).view(-1, E)
    rot = rot_pos_emb(grid_thw, E // V["heads"])
    cu = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(0)
    cu = F.pad(cu, (1, 0), value=0).tolist()
    n = x.shape[0]
    if Q3:
        x = x + fast_pos_embed_interpolate(grid_thw)
        emb = torch.cat((rot, rot), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        deepstack = []
        for i in range(V["depth"]):
            x = vision_block(x, f"visual.blocks.{i}", cos, sin, block_mask(cu, n))
            if i in V["deepstack"]:
                k = V["deepstack"].index(i)
                deepstack.append(q3_merger(x, f"visual.deepstack_merger_list.{k}", True))
        return q3_merger(x, "visual.merger", False), deepstack
    window_index, cu_window = get_window_index(grid_thw)
    cu_window = torch.unique_consecutive(torch.tensor(cu_window)).tolist()
    x = x.reshape(n // MU, MU, -1)[window_index, :, :].reshape(n, -1)
    rot = rot.reshape(n // MU, MU, -1)[window_index, :, :].reshape(n, -1)
    emb = torch.cat((rot, rot), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    for i in range(V["depth"]):
        mask = block_mask(cu if i in V["fullatt"] else cu_window, n)
        x = vision_block(x, f"visual.blocks.{i}", cos, sin, mask)
    x = rms(x, W["visual.merger.ln_q.weight"], 1e-6).view(-1, E * MU)
    x = F.gelu(F.linear(x, W["visual.merger.mlp.0.weight"], W["visual.merger.mlp.0.bias"]))
    x = F.linear(x, W["visual.merger.mlp.2.weight"], W["visual.merger.mlp.2.bias"])
    reverse = torch.argsort(window_index)
    return x[reverse, :], []


# ---- get_rope_index (HF, images; Qwen2.5-VL gives every frame of an image time 0) ----
def get_rope_index(input_ids, grid, attention_mask):
    position_ids = torch.ones(3, input_ids.shape[0], input_ids.shape[1], dtype=torch.long)
    image_index = 0
    for i, ids in enumerate(input_ids):
        ids = ids[attention_mask[i] == 1]
        starts = torch.argwhere(ids == C["vs"]).squeeze(1)
        image_nums = int((ids[starts + 1] == C["image"]).sum())
        tokens = ids.tolist()
        parts = []
        st = 0
        for _ in range(image_nums):
            ed = tokens.index(C["image"], st)
            t, h, ww = grid[image_index].tolist()
            image_index += 1
            gt, gh, gw = t, h // m, ww // m
            text_len = ed - st
            st_idx = parts[-1].max() + 1 if parts else 0
            parts.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
            # Qwen2.5-VL: arange(t) * second_per_grid_t * tokens_per_second, with
            # second_per_grid_t = 0 for images; Qwen3-VL: arange(t).
            t_i = torch.arange(gt).view(-1, 1).expand(-1, gh * gw)
            t_i = (t_i if Q3 else (t_i * 0 * 2).long()).flatten()
            h_i = torch.arange(gh).view(1, -1, 1).expand(gt, -1, gw).flatten()
            w_i = torch.arange(gw).view(1, 1, -1).expand(gt, gh, -1).flatten()
            parts.append(torch.stack([t_i, h_i, w_i]) + text_len + st_idx)
            st = ed + gt * gh * gw
        if st < len(tokens):
            st_idx = parts[-1].max() + 1 if parts else 0
            parts.append(torch.arange(len(tokens) - st).view(1, -1).expand(3, -1) + st_idx)
        pos = torch.cat(parts, dim=1).reshape(3, -1)
        position_ids[:, i, attention_mask[i] == 1] = pos
    return position_ids


# ---- LM (HF structure) ----
def mrope_cos_sin(position_ids, B):
    inv_freq = 1.0 / (C["theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    inv_exp = inv_freq[None, None, :, None].float().expand(3, B, -1, 1)
    pos_exp = position_ids[:, :, None, :].float()
    freqs = (inv_exp @ pos_exp).transpose(2, 3)  # [3, B, S, hd / 2]
    if Q3:  # apply_interleaved_mrope
        freqs_t = freqs[0].clone()
        for dim, offset in enumerate((1, 2), start=1):
            length = C["mrope"][dim] * 3
            idx = slice(offset, length, 3)
            freqs_t[..., idx] = freqs[dim, ..., idx]
        emb = torch.cat((freqs_t, freqs_t), dim=-1)
        return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    sec = C["mrope"] * 2
    cos = torch.cat([c[i % 3] for i, c in enumerate(cos.split(sec, dim=-1))], dim=-1).unsqueeze(1)
    sin = torch.cat([s[i % 3] for i, s in enumerate(sin.split(sec, dim=-1))], dim=-1).unsqueeze(1)
    return cos, sin


def lm(input_ids, attention_mask, position_ids, image_embeds, deepstack):
    B, S = input_ids.shape
    x = F.embedding(input_ids, W["model.embed_tokens.weight"])
    image_mask = (input_ids == C["image"]).unsqueeze(-1).expand_as(x)
    if image_embeds is not None:
        x = x.masked_scatter(image_mask, image_embeds)
    visual_pos_masks = image_mask[..., 0]
    cos, sin = mrope_cos_sin(position_ids, B)
    min_v = torch.finfo(torch.float32).min
    causal = torch.full((S, S), min_v)
    causal = causal * (torch.arange(S) > torch.arange(S).reshape(-1, 1))
    causal = causal[None, None].expand(B, 1, -1, -1).clone()
    pad = (causal + attention_mask[:, None, None, :]) == 0
    causal = causal.masked_fill(pad, min_v)
    nh, nkv = C["heads"], C["kv_heads"]
    for i in range(C["layers"]):
        p = f"model.layers.{i}"
        h = rms(x, W[f"{p}.input_layernorm.weight"], C["eps"])
        q = F.linear(h, W[f"{p}.self_attn.q_proj.weight"], W.get(f"{p}.self_attn.q_proj.bias")).view(B, S, nh, hd)
        k = F.linear(h, W[f"{p}.self_attn.k_proj.weight"], W.get(f"{p}.self_attn.k_proj.bias")).view(B, S, nkv, hd)
        v = F.linear(h, W[f"{p}.self_attn.v_proj.weight"], W.get(f"{p}.self_attn.v_proj.bias")).view(B, S, nkv, hd)
        if Q3:
            q = rms(q, W[f"{p}.self_attn.q_norm.weight"], C["eps"])
            k = rms(k, W[f"{p}.self_attn.k_norm.weight"], C["eps"])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = nh // nkv
        k = k[:, :, None].expand(B, nkv, rep, S, hd).reshape(B, nh, S, hd)
        v = v[:, :, None].expand(B, nkv, rep, S, hd).reshape(B, nh, S, hd)
        a = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(hd) + causal
        a = torch.softmax(a, dim=-1, dtype=torch.float32)
        o = torch.matmul(a, v).transpose(1, 2).reshape(B, S, -1)
        x = x + F.linear(o, W[f"{p}.self_attn.o_proj.weight"])
        h = rms(x, W[f"{p}.post_attention_layernorm.weight"], C["eps"])
        h = F.linear(F.silu(F.linear(h, W[f"{p}.mlp.gate_proj.weight"])) * F.linear(h, W[f"{p}.mlp.up_proj.weight"]),
                     W[f"{p}.mlp.down_proj.weight"])
        x = x + h
        if deepstack and i < len(deepstack):  # _deepstack_process
            x = x.clone()
            x[visual_pos_masks, :] = x[visual_pos_masks, :].clone() + deepstack[i]
    x = rms(x, W["model.norm.weight"], C["eps"])
    return F.linear(x, W["lm_head.weight"])


# ---- the golden cases ----
VS, VE, IMG = C["vs"], C["ve"], C["image"]
PDIM = V["ch"] * V["tp"] * V["patch"] * V["patch"]
u_h = hashed(H, 4343, 1.0).double()
u_v = hashed(C["vocab"], 4242, 1.0).double()


def image(grid):
    t, h, ww = grid
    return [VS] + [IMG] * (t * h * ww // MU) + [VE]


def pixels_for(grid, key):
    n = grid[0] * grid[1] * grid[2]
    return hashed(n * PDIM, key, 1.0).view(n, PDIM)


def fmt(vals):
    return ", ".join(f"{v:.7g}" for v in vals)


def run(name, rows, grids, keys):
    """Left-pads `rows`, runs tower + rope index + LM, prints the logit projection of each row."""
    L = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, L - len(row):] = torch.tensor(row)
        mask[r, L - len(row):] = 1
    embeds, deepstack = None, []
    if grids:
        grid = torch.tensor(grids)
        pixels = torch.cat([pixels_for(g, k) for g, k in zip(grids, keys)])
        embeds, deepstack = vision_tower(pixels, grid)
        print(f"// {name}: embedding projection")
        print(f"const std::vector<double> k{name}Embedding = {{{fmt((embeds.double() @ u_h).tolist())}}};")
        for k, d in enumerate(deepstack):
            print(f"const std::vector<double> k{name}DeepStack{k} = {{{fmt((d.double() @ u_h).tolist())}}};")
    pos = get_rope_index(ids, torch.tensor(grids) if grids else torch.zeros(0, 3, dtype=torch.long), mask)
    logits = lm(ids, mask, pos, embeds, deepstack)
    proj = logits.double() @ u_v
    for r, row in enumerate(rows):
        print(f"const std::vector<double> k{name}Row{r} = {{{fmt(proj[r, L - len(row):].tolist())}}};")
    print(f"// {name}: max |logit| {float(logits.abs().max()):.4g}; greedy last:",
          [int(logits[r, -1].argmax()) for r in range(len(rows))])


print(f"// {FAMILY}")
# Text only.
run("Text", [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]], [], [])
# Ragged batch: row 0 holds two images of different grids (one 2x2-token window; 3x4 tokens in
# 2x2 windows with partial edges); row 1 (left-padded) a two-frame image of 2x3 tokens.
g_a, g_b, g_c = [1, 4, 4], [1, 6, 8], [2, 4, 6]
run("Batch", [[1, 2] + image(g_a) + [3, 4] + image(g_b) + [5], [6] + image(g_c) + [7, 8]],
    [g_a, g_b, g_c], [1001, 1002, 1003])
# A two-turn row: the continuation's window holds a new image (grid 1x8x4).
g_d = [1, 8, 4]
run("Turns", [[9, 10] + image(g_a) + [11, 12, 13] + [14, 15] + image(g_d) + [16, 17]], [g_a, g_d], [1001, 1004])
