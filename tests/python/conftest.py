import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import torch_qwen2_vl  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """The reference model's weights as an HF Qwen2-VL folder (for vlmgen.load_model and the CLI)."""
    return torch_qwen2_vl.write_checkpoint(str(tmp_path_factory.mktemp("qwen2_vl_reference")))


def tool(name):
    """A vlmgen executable ctest passes in the environment (VLMGEN_GENERATE, ...)."""
    path = os.environ.get(name)
    if not path:
        pytest.skip(f"{name} is not set (ctest sets it)")
    return path
