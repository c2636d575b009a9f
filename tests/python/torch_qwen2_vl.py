"""A Qwen2-VL written in plain PyTorch (the project's independent transcription of HF's
modeling_qwen2_vl, tests/model/reference/qwen2_vl_reference.py), adapted to vlmgen's model seam
the way a research harness adapts its own model: forward(args), traits, plan_positions.

The weights are the reference's hash-derived ones; write_checkpoint() stores them as an HF-style
Qwen2-VL folder, so vlmgen's C++ model can load the very same weights."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model", "reference"))
import qwen2_vl_reference as ref  # noqa: E402

import vlmgen  # noqa: E402

C, V = ref.C, ref.V
IMAGE, VISION_START, VISION_END = C["image"], C["vs"], C["ve"]


def traits(kv_cache):
    return vlmgen.ModelTraits(
        vocab_size=C["vocab"], image_token_id=IMAGE, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, spatial_merge_size=V["merge"], supports_kv_cache=kv_cache,
        kv_cache=dict(num_layers=C["layers"], num_kv_heads=C["kv_heads"], head_dim=C["head_dim"]))


class TorchQwen2VL:
    """kv_cache=False: every call recomputes the whole prefix (the seeds' no-cache path).
    kv_cache=True: the model keeps its keys and values in the context the args carry."""

    def __init__(self, kv_cache=False):
        self.traits = traits(kv_cache)
        self.calls_with_pixels = 0

    def plan_positions(self, input_ids, attention_mask, vision):
        grid = vision.image_grid_thw if vision.image_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
        positions, hf_delta = ref.get_rope_index(input_ids, grid, attention_mask)
        pads = (attention_mask == 0).sum(1).tolist()
        # HF counts a new token's position from the padded column; vlmgen from the real ones.
        return vlmgen.RopePlan(positions, [d + p for d, p in zip(hf_delta, pads)])

    def forward(self, args):
        embeds = None
        if args.pixel_values is not None:
            self.calls_with_pixels += 1
            embeds = ref.vision_tower(args.pixel_values, args.image_grid_thw)
        kv = None
        if args.context is not None:
            kv = args.context.append_kv
        return ref.lm(args.input_ids, args.attention_mask, args.position_ids, embeds, kv=kv)


def placeholders(grid):
    t, h, w = grid
    return t * (h // V["merge"]) * (w // V["merge"])


def image_prompt(before, grid, after):
    return list(before) + [VISION_START] + [IMAGE] * placeholders(grid) + [VISION_END] + list(after)


def pixels(grid, key):
    t, h, w = grid
    rows = t * h * w
    dim = V["ch"] * V["tp"] * V["patch"] * V["patch"]
    return ref.hashed(rows * dim, key, 1.0).view(rows, dim)


def vision_for(grids, key=1000):
    return vlmgen.VisionInputs(pixel_values=torch.cat([pixels(g, key + i) for i, g in enumerate(grids)]),
                               image_grid_thw=torch.tensor(grids, dtype=torch.long))


def write_checkpoint(directory):
    """The reference's weights and dimensions as an HF Qwen2-VL checkpoint folder."""
    os.makedirs(directory, exist_ok=True)
    config = {
        "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": C["hidden"], "num_hidden_layers": C["layers"], "num_attention_heads": C["heads"],
        "num_key_value_heads": C["kv_heads"], "intermediate_size": C["inter"], "rms_norm_eps": C["eps"],
        "rope_theta": C["theta"], "rope_scaling": {"type": "mrope", "mrope_section": C["mrope"]},
        "vocab_size": C["vocab"], "image_token_id": IMAGE, "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END, "video_token_id": C["vocab"] - 1, "tie_word_embeddings": False,
        "max_position_embeddings": 4096, "torch_dtype": "float32",
        "vision_config": {"depth": V["depth"], "embed_dim": V["embed"], "hidden_size": C["hidden"],
                          "num_heads": V["heads"], "mlp_ratio": V["ratio"], "in_chans": V["ch"],
                          "patch_size": V["patch"], "temporal_patch_size": V["tp"],
                          "spatial_merge_size": V["merge"]},
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    vlmgen.save_safetensors(os.path.join(directory, "model.safetensors"), dict(ref.W))
    return directory
