"""Gemma-3 and LLaVA-NeXT checkpoints from Python: vlmgen.load_model takes them like the Qwen-VL
families, and the tokens equal vlmgen-generate's on the same folder."""

import re
import subprocess

import pytest

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
