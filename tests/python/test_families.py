"""Gemma-3 and LLaVA-NeXT checkpoints from Python: vlmgen.load_model takes them like the Qwen-VL
families, and the tokens equal vlmgen-generate's on the same folder; a Gemma-3 folder with its
real tokenizer and chat template writes chat prompts."""

import os
import re
import shutil
import subprocess

import pytest
import torch

import vlmgen
from conftest import tool

PROMPT = [2, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("family", ["gemma3", "llava_next"])
def test_load_model_takes_the_per_image_families_and_matches_the_cli(tmp_path, family):
    folder = str(tmp_path / family)
    subprocess.run([tool("VLMGEN_MAKE_TINY_CHECKPOINT"), "--out", folder, "--family", family, "--seed", "5"],
                   check=True, capture_output=True, timeout=120)
    model = vlmgen.load_model(folder)
    assert isinstance(model, vlmgen.Model)
    config = vlmgen.GenerationConfig(max_new_tokens=8, temperature=1.0, seed=3)
    from_python = vlmgen.Generator(model).generate([PROMPT], config).tokens[0]
    out = subprocess.run([tool("VLMGEN_GENERATE"), "--checkpoint", folder, "--prompt", " ".join(map(str, PROMPT)),
                          "--max-new-tokens", "8", "--temperature", "1.0", "--seed", "3"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    match = re.search(r"^tokens:([ 0-9]*)$", out, re.M)
    assert match, out
    assert from_python == [int(t) for t in match.group(1).split()]
    assert len(from_python) == 8


def test_a_gemma3_folder_with_its_real_tokenizer_chats_from_python(tmp_path):
    tokenizer_dir = os.path.join(os.environ.get("VLMGEN_NPM_DIR", ""), "node_modules", "@lenml", "tokenizer-gemma3",
                                 "models")
    if not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
        pytest.skip("the Gemma-3 tokenizer.json of the npm references is not installed (scripts/npm-deps.sh)")
    folder = str(tmp_path / "gemma3_chat")
    subprocess.run([tool("VLMGEN_MAKE_TINY_CHECKPOINT"), "--out", folder, "--family", "gemma3", "--real-vocab"],
                   check=True, capture_output=True, timeout=120)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the chat template is in tokenizer_config.json
        shutil.copy(os.path.join(tokenizer_dir, name), folder)
    chat = vlmgen.ChatProcessor.from_pretrained(folder)
    image = torch.zeros(40, 56, 3, dtype=torch.uint8)
    prompt = chat.build([{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": " What is this? "}]}])
    tokenizer = chat.tokenizer
    model = vlmgen.load_model(folder)
    assert prompt.ids[0] == tokenizer.token_id("<bos>")
    assert prompt.ids.count(tokenizer.token_id("<image_soft_token>")) == model.placeholder_counts(prompt.vision)[0]
    text = tokenizer.decode(prompt.ids)
    assert "<start_of_turn>user\nBe brief.\n\n\n\n<start_of_image>" in text
    assert text.endswith("<end_of_image>\n\nWhat is this?<end_of_turn>\n<start_of_turn>model\n")
    result = vlmgen.Generator(model).generate([prompt.ids], vlmgen.GenerationConfig(max_new_tokens=3),
                                              vision=prompt.vision)
    assert len(result.tokens[0]) == 3
