"""FlashAttention: this repo's own CUDA flash kernels (csrc/), bound as ``transformer_fa_flash``.

The kernels are not written yet (their issue fills them in); until then the extension does
not exist and this backend says so, so selection falls through to the next backend.
"""
from __future__ import annotations

import importlib.util
from typing import List

from ..params import AttentionInputs, AttentionParams

NAME = "FlashAttention"
EXTENSION = "transformer_fa_flash"


def is_built() -> bool:
    return importlib.util.find_spec(EXTENSION) is not None


def not_supported_reasons(params: AttentionParams) -> List[str]:
    if params.device_type != "cuda":
        return [f"as it requires CUDA tensors, got device {params.device_type}"]
    if not is_built():
        return ["as the transformer_fa CUDA kernels (csrc/) are not built in this install"]
    return ["as the transformer_fa CUDA kernels do not implement any configuration yet"]


def run(inputs: AttentionInputs, params: AttentionParams):
    raise RuntimeError("FlashAttention.run called although not_supported_reasons was not empty")
