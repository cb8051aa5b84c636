"""FlashAttention: this repo's own CUDA flash kernels (csrc/), bound as ``transformer_fa_flash``.

What exists (issue 3, first step): the sm80-class forward (mma.sync, ldmatrix, cp.async;
FlashAttention-2 work partitioning, online softmax) for fp16/bf16 and head dims 64 and 128,
with no mask, causal top-left and bottom-right masks, sliding windows, GQA/MQA without K/V
copies, sq != skv, varlen through cu_seqlens (thd, and padding masks on sbhd/bshd), every
layout's strides (packed sb3hd-style views and GQA split views without a copy) and the
log-sum-exp output.
No backward yet: calls that need gradients go to another backend.

``not_supported_reasons`` claims only what ``tests/gpu/test_flash.py`` covers and passed on
a GPU. The op is registered with torch.library (``transformer_fa::flash_attn_fwd``) so that
torch.compile traces through it; eager calls go to the extension directly.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import List, Optional, Tuple

import torch

from ..params import AttentionInputs, AttentionParams
from .support import never_raises

NAME = "FlashAttention"
EXTENSION = "transformer_fa_flash"

# What the GPU tests (tests/gpu/test_flash.py) cover, and so what is claimed.
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_ARCH_MAJORS = (9,)  # sm80-class kernels built for sm_80 and sm_90a; only sm_90 (H100) tested
# Sliding windows (left, right), TE semantics with both alignments: tested on an H100.
WINDOW_SUPPORTED = True

# Tile shape per head dim (csrc/flash/fwd_launch_sm80.cuh lists the variants), from
# benchmarks/bench_flash.py on an H100 (benchmarks/results/flash_fwd_H100_2026-11-22.*): d=64 128x128, d=128 128x64, 4 warps
# with 32 query rows each, as FlashAttention-2.
TILE_VARIANT = {64: 3, 128: 2}

_FORMATS = {"bshd": 0, "sbhd": 1, "thd": 2}
_ext = None
_ext_error: Optional[str] = None


def is_built() -> bool:
    return importlib.util.find_spec(EXTENSION) is not None


def _extension():
    """The compiled extension module, or None (``_ext_error`` says why)."""
    global _ext, _ext_error
    if _ext is None and _ext_error is None:
        try:
            _ext = importlib.import_module(EXTENSION)
        except Exception as exc:  # ImportError, or a broken build raising anything
            _ext_error = f"{type(exc).__name__}: {exc}"
    return _ext


def _reasons(p: AttentionParams) -> List[str]:
    if p.device_type != "cuda":
        return [f"as it requires CUDA tensors, got device {p.device_type}"]
    if not is_built():
        return ["as the transformer_fa CUDA kernels (csrc/) are not built in this install"]
    if _extension() is None:
        return [f"as the transformer_fa CUDA kernels failed to load ({_ext_error})"]
    cc = p.compute_capability
    if cc is None or cc[0] not in SUPPORTED_ARCH_MAJORS:
        return [f"as it does not support compute capability {cc} (tested and supported: sm90)"]
    reasons = []
    if p.requires_grad:
        reasons.append("as the FlashAttention backward is not implemented yet")
    if p.dtype not in SUPPORTED_DTYPES:
        reasons.append(f"as it does not support dtype {p.dtype} (fp16 and bf16 only)")
    if p.head_dim_qk != p.head_dim_v or p.head_dim_qk not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"as it does not support head_dim_qk = {p.head_dim_qk}, head_dim_v = "
                       f"{p.head_dim_v} (supported: {SUPPORTED_HEAD_DIMS}, equal)")
    if p.attn_mask_type == "arbitrary":
        reasons.append("as it does not support attn_mask_type = arbitrary")
    if p.has_window and not WINDOW_SUPPORTED:
        reasons.append(f"as it does not support sliding windows yet (window_size = "
                       f"{p.window_size})")
    if p.core_attention_bias_type != "no_bias":
        reasons.append(f"as it does not support core_attention_bias_type = "
                       f"{p.core_attention_bias_type}")
    if p.attention_dropout > 0.0:
        reasons.append("as it does not support dropout yet")
    return reasons

# Why this backend cannot serve params (each reads after "Disabling <NAME> ").
not_supported_reasons = never_raises(_reasons)


# --------------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------------
def _kernel_ready(t: torch.Tensor) -> bool:
    """16-byte aligned data and strides, unit stride in d (what cp.async needs)."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    return all(n == 1 or s % 8 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]))


def _fresh(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def _fwd_impl(q, k, v, cu_q, cu_kv, q_format: str, kv_format: str, max_seqlen_q: int,
              max_seqlen_kv: int, softmax_scale: float, window_left: int, window_right: int,
              bottom_right: bool, return_lse: bool, tile_variant: Optional[int] = None):
    """(out in q's format [..., h, d], lse float32 ([h, t] for thd q, else [b, h, sq]) or an
    empty tensor)."""
    if tile_variant is None:
        tile_variant = TILE_VARIANT.get(q.shape[-1], 0)
    if not _kernel_ready(q):
        q = _fresh(q)
    if not _kernel_ready(k):
        k = _fresh(k)
    if not _kernel_ready(v):
        v = _fresh(v)
    return tuple(_ext.fwd(q, k, v, cu_q, cu_kv, _FORMATS[q_format], _FORMATS[kv_format],
                          max_seqlen_q, max_seqlen_kv, softmax_scale, window_left,
                          window_right, bottom_right, return_lse, tile_variant))


def _lse_shape(q_format: str, q: torch.Tensor, cu_q: Optional[torch.Tensor], max_seqlen_q: int):
    h = q.shape[-2]
    if q_format == "thd":
        return (h, q.shape[0])
    b = cu_q.shape[0] - 1 if cu_q is not None else (q.shape[1] if q_format == "sbhd"
                                                     else q.shape[0])
    sq = q.shape[0] if q_format == "sbhd" else q.shape[1]
    return (b, h, sq)


Tensor = torch.Tensor


def _register_ops() -> None:
    try:
        torch.ops.transformer_fa.flash_attn_fwd  # noqa: B018  (already registered: a reload)
        return
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("transformer_fa::flash_attn_fwd", mutates_args=(),
                             device_types="cuda")
    def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Optional[Tensor],
                       cu_seqlens_kv: Optional[Tensor], q_format: str, kv_format: str,
                       max_seqlen_q: int, max_seqlen_kv: int, softmax_scale: float,
                       window_left: int, window_right: int, bottom_right: bool,
                       return_lse: bool) -> Tuple[Tensor, Tensor]:
        if _extension() is None:
            raise RuntimeError(f"transformer_fa_flash is not available ({_ext_error})")
        return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_kv, q_format, kv_format,
                         max_seqlen_q, max_seqlen_kv, softmax_scale, window_left,
                         window_right, bottom_right, return_lse)

    @flash_attn_fwd.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_kv, q_format, kv_format, max_seqlen_q,
          max_seqlen_kv, softmax_scale, window_left, window_right, bottom_right, return_lse):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        shape = _lse_shape(q_format, q, cu_seqlens_q, max_seqlen_q) if return_lse else (0,)
        return out, q.new_empty(shape, dtype=torch.float32)


_register_ops()


def _mask_args(p: AttentionParams) -> Tuple[int, int, bool]:
    """(window_left, window_right, bottom_right) for the kernel (masks.py semantics)."""
    left, right = p.window_size
    if p.is_causal:
        right = 0
    return left, right, p.is_bottom_right


def run(inputs: AttentionInputs, params: AttentionParams) -> torch.Tensor:
    p = params
    q, k, v = inputs.q, inputs.k, inputs.v
    cu_q, cu_kv = inputs.cu_seqlens_q, inputs.cu_seqlens_kv
    if not p.is_varlen:
        cu_q = cu_kv = None
    left, right, bottom_right = _mask_args(p)
    args = (q, k, v, cu_q, cu_kv, p.q_format, p.kv_format, int(p.max_seqlen_q),
            int(p.max_seqlen_kv), float(p.softmax_scale), int(left), int(right),
            bool(bottom_right), False)
    if p.is_compiling or torch.compiler.is_compiling():
        out = torch.ops.transformer_fa.flash_attn_fwd(*args)[0]
    else:
        if _ext is None and _extension() is None:
            raise RuntimeError(f"transformer_fa_flash is not available ({_ext_error})")
        out = _fwd_impl(*args)[0]
    return out.view(*out.shape[:-2], out.shape[-2] * out.shape[-1])
