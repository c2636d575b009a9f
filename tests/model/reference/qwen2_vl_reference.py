# Independent PyTorch transcription of HF transformers' modeling_qwen2_vl (Conv3d patch embed,
# rot_pos_emb, cu_seqlens vision attention, PatchMerger, get_rope_index, Qwen2VLRotaryEmbedding,
# apply_multimodal_rotary_pos_emb, repeat_kv, 4-D causal mask, Qwen2RMSNorm, Qwen2MLP), run on
# hash-derived weights so the C++ test can rebuild the same model without a checkpoint.
# Prints golden numbers for tests/model/qwen2_vl_hf_test.cpp (Qwen2VlHfParityTest) when run; the Python
# binding tests (tests/python) import it as the model written in plain PyTorch.
import math
import torch
import torch.nn.functional as F

torch.set_default_dtype(torch.float32)

C = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=96, eps=1e-6, theta=10000.0,
         mrope=[2, 3, 3], vocab=96, image=90, vs=88, ve=89)
V = dict(depth=2, embed=32, heads=2, ratio=2, ch=3, patch=2, tp=2, merge=2)


def name_key(name):
    return sum((j + 1) * ord(c) for j, c in enumerate(name)) % 9973


def hashed(n, k, amp):
    i = torch.arange(n, dtype=torch.float64)
    h = torch.sin((i + 1) * 12.9898 + (k + 1) * 78.233) * 43758.5453
    return ((h - torch.floor(h) - 0.5) * 2 * amp).float()


def is_norm(name):
    return any(name.endswith(s) for s in ("norm1.weight", "norm2.weight", "ln_q.weight", "layernorm.weight")) or \
        name == "model.norm.weight"


W = {}


def w(name, *shape):
    n = 1
    for s in shape:
        n *= s
    if is_norm(name):
        t = 1.0 + hashed(n, name_key(name), 0.2)
    else:
        t = hashed(n, name_key(name), 0.1)
    W[name] = t.view(*shape)
    return W[name]


E, m = V["embed"], V["merge"]
w("visual.patch_embed.proj.weight", E, V["ch"], V["tp"], V["patch"], V["patch"])
for i in range(V["depth"]):
    p = f"visual.blocks.{i}"
    for n in ("norm1", "norm2"):
        w(f"{p}.{n}.weight", E); w(f"{p}.{n}.bias", E)
    w(f"{p}.attn.qkv.weight", 3 * E, E); w(f"{p}.attn.qkv.bias", 3 * E)
    w(f"{p}.attn.proj.weight", E, E); w(f"{p}.attn.proj.bias", E)
    w(f"{p}.mlp.fc1.weight", E * V["ratio"], E); w(f"{p}.mlp.fc1.bias", E * V["ratio"])
    w(f"{p}.mlp.fc2.weight", E, E * V["ratio"]); w(f"{p}.mlp.fc2.bias", E)
w("visual.merger.ln_q.weight", E); w("visual.merger.ln_q.bias", E)
w("visual.merger.mlp.0.weight", E * m * m, E * m * m); w("visual.merger.mlp.0.bias", E * m * m)
w("visual.merger.mlp.2.weight", C["hidden"], E * m * m); w("visual.merger.mlp.2.bias", C["hidden"])
H, hd = C["hidden"], C["head_dim"]
w("model.embed_tokens.weight", C["vocab"], H)
for i in range(C["layers"]):
    p = f"model.layers.{i}"
    w(f"{p}.self_attn.q_proj.weight", C["heads"] * hd, H); w(f"{p}.self_attn.q_proj.bias", C["heads"] * hd)
    w(f"{p}.self_attn.k_proj.weight", C["kv_heads"] * hd, H); w(f"{p}.self_attn.k_proj.bias", C["kv_heads"] * hd)
    w(f"{p}.self_attn.v_proj.weight", C["kv_heads"] * hd, H); w(f"{p}.self_attn.v_proj.bias", C["kv_heads"] * hd)
    w(f"{p}.self_attn.o_proj.weight", H, C["heads"] * hd)
    w(f"{p}.mlp.gate_proj.weight", C["inter"], H); w(f"{p}.mlp.up_proj.weight", C["inter"], H)
    w(f"{p}.mlp.down_proj.weight", H, C["inter"])
    w(f"{p}.input_layernorm.weight", H); w(f"{p}.post_attention_layernorm.weight", H)
w("model.norm.weight", H)
w("lm_head.weight", C["vocab"], H)


# ---- vision (HF structure) ----
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def vision_tower(pixels, grid_thw):
    x = pixels.view(-1, V["ch"], V["tp"], V["patch"], V["patch"])
    x = F.conv3d(x, W["visual.patch_embed.proj.weight"], stride=(V["tp"], V["patch"], V["patch"])).view(-1, E)
    vhd = E // V["heads"]
    # rot_pos_emb
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
    rot = full[pos_ids].flatten(1)
    cos = rot.cos().unsqueeze(1).repeat(1, 1, 2)
    sin = rot.sin().unsqueeze(1).repeat(1, 1, 2)
    cu = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(0)
    cu = F.pad(cu, (1, 0), value=0)
    n = x.shape[0]
    for i in range(V["depth"]):
        p = f"visual.blocks.{i}"
        h = F.layer_norm(x, (E,), W[f"{p}.norm1.weight"], W[f"{p}.norm1.bias"], 1e-6)
        q, k, v = F.linear(h, W[f"{p}.attn.qkv.weight"], W[f"{p}.attn.qkv.bias"]).reshape(
            n, 3, V["heads"], -1).permute(1, 0, 2, 3).unbind(0)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        mask = torch.full([1, n, n], torch.finfo(q.dtype).min)
        for j in range(1, len(cu)):
            mask[..., cu[j - 1]:cu[j], cu[j - 1]:cu[j]] = 0
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        a = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(vhd) + mask
        a = torch.softmax(a, dim=-1)
        o = torch.matmul(a, v).transpose(0, 1).reshape(n, -1)
        x = x + F.linear(o, W[f"{p}.attn.proj.weight"], W[f"{p}.attn.proj.bias"])
        h = F.layer_norm(x, (E,), W[f"{p}.norm2.weight"], W[f"{p}.norm2.bias"], 1e-6)
        h = F.linear(h, W[f"{p}.mlp.fc1.weight"], W[f"{p}.mlp.fc1.bias"])
        h = h * torch.sigmoid(1.702 * h)
        x = x + F.linear(h, W[f"{p}.mlp.fc2.weight"], W[f"{p}.mlp.fc2.bias"])
    x = F.layer_norm(x, (E,), W["visual.merger.ln_q.weight"], W["visual.merger.ln_q.bias"], 1e-6).view(-1, E * m * m)
    x = F.linear(x, W["visual.merger.mlp.0.weight"], W["visual.merger.mlp.0.bias"])
    x = F.gelu(x)
    return F.linear(x, W["visual.merger.mlp.2.weight"], W["visual.merger.mlp.2.bias"])


# ---- get_rope_index (HF) ----
def get_rope_index(input_ids, grid, attention_mask):
    position_ids = torch.ones(3, input_ids.shape[0], input_ids.shape[1], dtype=torch.long)
    deltas = []
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
            t_i = torch.arange(gt).view(-1, 1).expand(-1, gh * gw).flatten()
            h_i = torch.arange(gh).view(1, -1, 1).expand(gt, -1, gw).flatten()
            w_i = torch.arange(gw).view(1, 1, -1).expand(gt, gh, -1).flatten()
            parts.append(torch.stack([t_i, h_i, w_i]) + text_len + st_idx)
            st = ed + gt * gh * gw
        if st < len(tokens):
            st_idx = parts[-1].max() + 1 if parts else 0
            parts.append(torch.arange(len(tokens) - st).view(1, -1).expand(3, -1) + st_idx)
        pos = torch.cat(parts, dim=1).reshape(3, -1)
        position_ids[:, i, attention_mask[i] == 1] = pos
        deltas.append(int(pos.max()) + 1 - len(input_ids[i]))
    return position_ids, deltas


# ---- LM (HF structure) ----
def rms(x, weight):
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + C["eps"]))


def lm(input_ids, attention_mask, position_ids, image_embeds, kv=None):
    """Logits of the columns input_ids [B, S]. attention_mask covers every column up to the window's
    end, so with a KV cache (kv(layer, k, v) -> keys and values of all columns so far) the window
    follows attention_mask.shape[1] - S earlier columns. image_embeds None: placeholders keep their
    token embedding (what a model sent no image computes)."""
    B, S = input_ids.shape
    x = F.embedding(input_ids, W["model.embed_tokens.weight"])
    if image_embeds is not None:
        image_mask = (input_ids == C["image"]).unsqueeze(-1).expand_as(x)
        x = x.masked_scatter(image_mask, image_embeds)
    inv_freq = 1.0 / (C["theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    inv_exp = inv_freq[None, None, :, None].float().expand(3, B, -1, 1)
    pos_exp = position_ids[:, :, None, :].float()
    freqs = (inv_exp @ pos_exp).transpose(2, 3)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    sec = C["mrope"] * 2
    cos = torch.cat([c[i % 3] for i, c in enumerate(cos.split(sec, dim=-1))], dim=-1).unsqueeze(1)
    sin = torch.cat([s[i % 3] for i, s in enumerate(sin.split(sec, dim=-1))], dim=-1).unsqueeze(1)
    min_v = torch.finfo(torch.float32).min
    past = attention_mask.shape[1] - S
    causal = torch.full((S, past + S), min_v)
    causal = causal * (torch.arange(past + S) > torch.arange(S).reshape(-1, 1) + past)
    causal = causal[None, None].expand(B, 1, -1, -1).clone()
    pad = (causal + attention_mask[:, None, None, :]) == 0
    causal = causal.masked_fill(pad, min_v)
    nh, nkv = C["heads"], C["kv_heads"]
    for i in range(C["layers"]):
        p = f"model.layers.{i}"
        h = rms(x, W[f"{p}.input_layernorm.weight"])
        q = F.linear(h, W[f"{p}.self_attn.q_proj.weight"], W[f"{p}.self_attn.q_proj.bias"]).view(B, S, nh, hd).transpose(1, 2)
        k = F.linear(h, W[f"{p}.self_attn.k_proj.weight"], W[f"{p}.self_attn.k_proj.bias"]).view(B, S, nkv, hd).transpose(1, 2)
        v = F.linear(h, W[f"{p}.self_attn.v_proj.weight"], W[f"{p}.self_attn.v_proj.bias"]).view(B, S, nkv, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if kv is not None:
            k, v = kv(i, k, v)
        rep, T = nh // nkv, k.shape[2]
        k = k[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)
        v = v[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)
        a = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(hd) + causal
        a = torch.softmax(a, dim=-1, dtype=torch.float32)
        o = torch.matmul(a, v).transpose(1, 2).reshape(B, S, -1)
        x = x + F.linear(o, W[f"{p}.self_attn.o_proj.weight"])
        h = rms(x, W[f"{p}.post_attention_layernorm.weight"])
        h = F.linear(F.silu(F.linear(h, W[f"{p}.mlp.gate_proj.weight"])) * F.linear(h, W[f"{p}.mlp.up_proj.weight"]),
                     W[f"{p}.mlp.down_proj.weight"])
        x = x + h
    x = rms(x, W["model.norm.weight"])
    return F.linear(x, W["lm_head.weight"])


# ---- the golden case ----
def main():
    VS, VE, IMG = C["vs"], C["ve"], C["image"]
    row0 = [1, 2, 3, VS] + [IMG] * 4 + [VE, 4, 5, VS] + [IMG] * 8 + [VE, 6]
    row1 = [7, VS] + [IMG] * 8 + [VE, 8, 9]
    L = max(len(row0), len(row1))
    ids = torch.zeros(2, L, dtype=torch.long)
    mask = torch.zeros(2, L, dtype=torch.long)
    for r, row in enumerate([row0, row1]):
        ids[r, L - len(row):] = torch.tensor(row)
        mask[r, L - len(row):] = 1
    grid = torch.tensor([[1, 4, 4], [2, 4, 4], [1, 4, 8]])
    rows = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    pdim = V["ch"] * V["tp"] * V["patch"] * V["patch"]
    pixels = hashed(rows * pdim, 1000, 1.0).view(rows, pdim)

    embeds = vision_tower(pixels, grid)
    pos, deltas = get_rope_index(ids, grid, mask)
    logits = lm(ids, mask, pos, embeds)

    u_h = hashed(H, 4343, 1.0)
    u_v = hashed(C["vocab"], 4242, 1.0)
    emb_proj = (embeds.double() @ u_h.double())
    logit_proj = (logits.double() @ u_v.double())  # [2, L]


    def fmt(vals):
        return ", ".join(f"{v:.7g}" for v in vals)


    print("// positions t/h/w row0:", pos[:, 0].tolist())
    print("// positions t/h/w row1:", pos[:, 1].tolist())
    print("// deltas:", deltas)
    print(f"const std::vector<double> kEmbeddingProjection = {{{fmt(emb_proj.tolist())}}};")
    print(f"const std::vector<double> kLogitProjectionRow0 = {{{fmt(logit_proj[0, L - len(row0):].tolist())}}};")
    print(f"const std::vector<double> kLogitProjectionRow1 = {{{fmt(logit_proj[1, L - len(row1):].tolist())}}};")
    print("// max |logit|:", float(logits.abs().max()), " max |embed|:", float(embeds.abs().max()))
    print("// logits[1,-1,:8]:", fmt(logits[1, -1, :8].tolist()))


if __name__ == "__main__":
    main()
