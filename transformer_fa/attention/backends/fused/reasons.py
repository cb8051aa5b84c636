"""FusedAttention's support check: plain reasons first, then cuDNN's own verdict on the graph
that a call described by the params would build (with the layout's contiguous strides)."""
from __future__ import annotations

from typing import List

import torch

from ...constants import FUSED_HEAD_DIMS
from ...params import AttentionParams
from ..support import reference_only_reasons
from . import cudnn_lib
from .plans import GraphCache
from .spec import spec_from_params

# What the GPU tests (tests/gpu/test_fused.py) cover, and so what is claimed.
MIN_CUDNN_VERSION = (9, 19, 0)  # the version the GPU tests ran on
SUPPORTED_ARCH_MAJORS = (9,)  # Hopper: the tests ran on an H100; Ampere is not tested yet
SUPPORTED_HEAD_DIMS = FUSED_HEAD_DIMS
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def not_supported(p: AttentionParams, cache: GraphCache) -> List[str]:
    """Why FusedAttention cannot serve p (see backends/__init__.py): the machine, the
    features, then cuDNN's verdict on the graph, through cache (which keeps the graphs it
    validated for the plan builder)."""
    reasons = environment_reasons(p) or feature_reasons(p)
    if reasons:
        return reasons
    device_index = torch.cuda.current_device()
    training = p.requires_grad or p.core_attention_bias_requires_grad
    fwd = spec_from_params(p, backward=False)
    msg = cache.verdict(fwd._replace(stats=fwd.stats if training else None), device_index)
    if msg is None and training:
        msg = cache.verdict(spec_from_params(p, backward=True), device_index)
        if msg is not None:
            return [f"as cuDNN does not support the backward of this configuration ({msg})"]
    if msg is not None:
        return [f"as cuDNN does not support this configuration ({msg})"]
    return []


def environment_reasons(p: AttentionParams) -> List[str]:
    """The device, cudnn-frontend, the cuDNN version, the GPU architecture."""
    if p.device_type != "cuda":
        return [f"as it requires CUDA tensors (got device type {p.device_type})"]
    if cudnn_lib.get() is None:
        return [f"as cudnn-frontend is not installed or failed to import "
                f"({cudnn_lib.import_error()})"]
    if not torch.cuda.is_available():
        return ["as no CUDA GPU is available"]
    ver = cudnn_lib.backend_version()
    if ver is None:
        return ["as the cuDNN library could not be loaded by cudnn-frontend"]
    if ver < MIN_CUDNN_VERSION:
        return ["as cuDNN %s is too old (needs %s or newer)" % (
            ".".join(map(str, ver)), ".".join(map(str, MIN_CUDNN_VERSION)))]
    cc = p.compute_capability
    if cc is None or cc[0] not in SUPPORTED_ARCH_MAJORS:
        return [f"as it does not support compute capability {cc}"
                " (tested and supported: sm90)"]
    return []


def feature_reasons(p: AttentionParams) -> List[str]:
    """What the params ask for that this backend does not claim (no GPU needed)."""
    reasons = []
    if p.dtype not in SUPPORTED_DTYPES:
        reasons.append(f"as it does not support dtype {p.dtype} (fp16 and bf16 only)")
    if (p.head_dim_qk, p.head_dim_v) not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"as it does not support head_dim_qk = {p.head_dim_qk}, head_dim_v = "
                       f"{p.head_dim_v}")
    if p.attn_mask_type == "arbitrary":
        reasons.append("as it does not support attn_mask_type = arbitrary")
    if p.core_attention_bias_type == "pre_scale_bias":
        reasons.append("as it does not support core_attention_bias_type = pre_scale_bias")
    if p.core_attention_bias_shape == "111s":
        reasons.append("as it does not support core_attention_bias_shape = 111s")
    reasons += reference_only_reasons(p)
    thd = "thd" in (p.q_format, p.kv_format)
    if thd and p.core_attention_bias_type in ("post_scale_bias", "alibi"):
        reasons.append(f"as it does not support core_attention_bias_type = "
                       f"{p.core_attention_bias_type} with the thd format")
    return reasons
