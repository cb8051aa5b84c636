"""FlashAttention: this repo's own CUDA flash kernels (csrc/), bound as ``transformer_fa_flash``.

What the kernels do: forward and backward (FlashAttention-2 work partitioning, online softmax)
for fp16/bf16 and every head dim that is a multiple of 8 up to 256 (kernels are built for
``transformer_fa_flash.HEAD_DIMS`` = 64, 128, 192, 256; a smaller d runs on the next one up),
with no mask, causal top-left and bottom-right masks, sliding windows, ALiBi, dropout,
GQA/MQA without K/V copies, sq != skv, varlen through cu_seqlens (thd, and padding masks on
sbhd/bshd), every layout's strides (packed sb3hd-style views and GQA split views without a
copy), and a deterministic backward on request.

Forward-only calls of a few query tokens (decode steps, with or without a paged KV cache) run
on a split-KV decode kernel instead (``uses_decode_kernel``; ``flash_attn_with_kvcache`` is
FlashAttention's call onto it).

Dropout: the kernels draw a Philox mask from a (seed, offset) pair that this module draws from
torch's generator and saves; the backward regenerates the same mask from it. The mask is
specified in csrc/flash/flash.h, and written in torch in tests/gpu/philox.py.

``not_supported_reasons`` claims only what ``tests/gpu/test_flash.py`` covers and passed on
a GPU. Eager calls go to the extension directly (through an autograd.Function when gradients
are needed); under torch.compile the torch.library ops ``transformer_fa::flash_attn_fwd`` and
``transformer_fa::flash_attn_bwd`` (fake and autograd registrations) run instead.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from .. import environment, masks
from ..constants import (ENV_FLASH_BWD_FAMILY, ENV_FLASH_FAMILY, ENV_FLASH_KERNELS,
                         FLASH_FAMILIES, FLASH_FORMAT_CODES, FLASH_MAX_HEAD_DIM, MAX_GRID_YZ)
from ..params import AttentionInputs, AttentionParams
from .support import (aligned, bindable, dropout_rng_state, fresh, grads_like, needs_grad,
                      never_raises, op_schema, packed_extent, reference_only_reasons,
                      strides_aligned)

NAME = "FlashAttention"
EXTENSION = "transformer_fa_flash"

# What the GPU tests (tests/gpu/test_flash.py) cover, and so what is claimed.
MAX_HEAD_DIM = FLASH_MAX_HEAD_DIM  # head dims: multiples of 8 up to this, one for q, k and v
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_ARCH_MAJORS = (9,)  # kernels built for sm_80 and sm_90a; only sm_90 (H100) tested
MAX_BATCH_OR_HEADS = MAX_GRID_YZ  # the kernels' grids hold heads and sequences in y and z

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}  # as in the kernels' names
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
    ext = _extension()
    if ext is None:
        return [f"as the transformer_fa CUDA kernels failed to load ({_ext_error})"]
    cc = p.compute_capability
    if cc is None or cc[0] not in SUPPORTED_ARCH_MAJORS:
        return [f"as it does not support compute capability {cc} (tested and supported: sm90)"]
    reasons = []
    if p.dtype not in SUPPORTED_DTYPES:
        reasons.append(f"as it does not support dtype {p.dtype} (fp16 and bf16 only)")
    d = p.head_dim_qk
    if p.head_dim_v != d or d % 8 or not 0 < d <= MAX_HEAD_DIM:
        reasons.append(f"as it does not support head_dim_qk = {d}, head_dim_v = {p.head_dim_v} "
                       f"(supported: equal, a multiple of 8, at most {MAX_HEAD_DIM})")
    elif p.dtype in SUPPORTED_DTYPES:
        # A build may hold a subset of the kernels (TRANSFORMER_FA_FLASH_KERNELS); d runs on
        # the kernel of the next head dim up.
        kernel = f"{_DTYPE_NAMES[p.dtype]}_hdim{min(hd for hd in ext.HEAD_DIMS if hd >= d)}"
        if kernel not in ext.INSTANTIATIONS:
            # (ext.INSTANTIATIONS: the sm80 family's, which serves every call; the sm90 one
            # serves a subset, so a build of sm90 kernels alone serves none)
            reasons.append(f"as this build has no {kernel} kernel for head dim {d} (built: "
                           f"{', '.join(ext.INSTANTIATIONS) or 'none'} of the sm80 family, "
                           f"which serves every call; see {ENV_FLASH_KERNELS})")
    if max(p.batch_size, p.num_heads) > MAX_BATCH_OR_HEADS:
        reasons.append(f"as it supports at most {MAX_BATCH_OR_HEADS} sequences and heads per "
                       f"call, got batch_size = {p.batch_size}, num_heads = {p.num_heads}")
    if p.attn_mask_type == "arbitrary":
        reasons.append("as it does not support attn_mask_type = arbitrary")
    if p.core_attention_bias_type not in ("no_bias", "alibi"):
        reasons.append(f"as it does not support core_attention_bias_type = "
                       f"{p.core_attention_bias_type}")
    if not 0.0 <= p.attention_dropout < 1.0:
        reasons.append(f"as it does not support attention_dropout = {p.attention_dropout}")
    reasons += reference_only_reasons(p)
    if not reasons and requested_family() == FLASH_FAMILIES["sm90"]:
        family, why_not_sm90 = forward_family(p)
        if family != "sm90":
            reasons.append(f"as {ENV_FLASH_FAMILY}=sm90 and the sm90 kernels do not serve this "
                           f"call: {why_not_sm90}")
    return reasons

# Why this backend cannot serve params (each reads after "Disabling <NAME> ").
not_supported_reasons = never_raises(_reasons)


def _family_from_env(env: str) -> int:
    name = os.environ.get(env, "auto").strip().lower() or "auto"
    if name not in FLASH_FAMILIES:
        raise ValueError(f"{env} must be one of {', '.join(FLASH_FAMILIES)}, got {name!r}")
    return FLASH_FAMILIES[name]


def requested_family() -> int:
    """The forward kernel family asked for by TRANSFORMER_FA_FLASH_FAMILY (0: any)."""
    return _family_from_env(ENV_FLASH_FAMILY)


def requested_bwd_family() -> int:
    """The backward kernel family asked for by TRANSFORMER_FA_FLASH_BWD_FAMILY (0: any)."""
    return _family_from_env(ENV_FLASH_BWD_FAMILY)


def _shape_args(p: AttentionParams) -> tuple:
    """The binding's family rules' arguments that describe a call's shape (fwd_family's)."""
    cc = p.compute_capability
    left, right = FlashCall.window_of(p)
    return (cc[0] * 10 + cc[1], p.dtype == torch.bfloat16, int(p.head_dim_qk),
            int(p.max_seqlen_q), int(p.max_seqlen_kv), bool(p.is_varlen), left, right,
            bool(p.is_bottom_right), p.core_attention_bias_type == "alibi",
            p.attention_dropout > 0.0)


def forward_family(p: AttentionParams) -> Tuple[str, str]:
    """(the kernel family the forward of params runs on, why not sm90 when it is not): the
    binding's own rule (csrc/flash_api.cpp, fwd_family), asked with the call's shape."""
    return tuple(_extension().fwd_family(*_shape_args(p), requested_family()))


def backward_family(p: AttentionParams) -> Tuple[str, str]:
    """The same for the backward (csrc/flash_api.cpp, bwd_family)."""
    return tuple(_extension().bwd_family(
        *_shape_args(p), p.num_gqa_groups != p.num_heads, bool(p.deterministic),
        requested_bwd_family()))


# The decode kernel (split-KV, csrc/flash/sm80/decode_kernel.cuh) serves forward-only calls
# with at most this many query rows per KV head (query tokens x query heads per KV head):
# there one CTA per 128-row query tile would leave most SMs idle, while the decode kernel
# splits the keys over the GPU and reads each K/V row once for a whole GQA group.
DECODE_MAX_ROWS = 64


def uses_decode_kernel(p: AttentionParams) -> bool:
    """Whether the forward of params runs on the split-KV decode kernel: no gradient (it
    writes no LSE), no dropout or ALiBi, a decode-sized query (DECODE_MAX_ROWS), and no
    kernel family asked for by name."""
    if (p.requires_grad or p.attention_dropout > 0.0 or p.core_attention_bias_type != "no_bias"
            or p.is_compiling or requested_family() != FLASH_FAMILIES["auto"]):
        return False
    return p.max_seqlen_q * (p.num_heads // p.num_gqa_groups) <= DECODE_MAX_ROWS


def reads_kv_pages(p: AttentionParams) -> bool:
    """A paged KV cache reaches this backend as page pools (not gathered) when the decode
    kernel serves the call (a prefill gets the gathered pages and the forward kernels); its
    pages must hold whole 16-key chunks."""
    return p.kv_page_size > 0 and p.kv_page_size % 16 == 0 and uses_decode_kernel(p)


# Where FlashAttention goes before FusedAttention on Hopper (selection.preference_order): the
# call shapes where our sm90 kernels were measured faster than cuDNN in every run of the grid
# beside it (bf16, batch * s = 16k, hidden 2048, sq = skv, dense, MHA; H200, 2026-12-01:
# benchmarks/results/NVIDIA-H200-2026-12-01-grid and -grid3, one pass and three, with today's
# forward A/B runs of the same kernels beside cuDNN). (head dim, causal) -> the shortest length.
# Forward-only calls: 1.01-1.24x in every one of those runs (d64 from 2k unmasked and 4k
# causal, d128 at 16k unmasked and from 2k causal, d256 causal from 4k); d128 unmasked 8k
# (1.00-1.05x) and d256 unmasked (0.95-1.06x, 0.98-1.00x in the A/B runs) stay with cuDNN.
FASTER_THAN_CUDNN_FORWARD = {(64, False): 2048, (64, True): 4096, (128, False): 16384,
                             (128, True): 2048, (256, True): 4096}
# Training calls: forward + backward time, from the same two grids (each call's forward and
# backward on the sm90 kernels): d64 1.01-1.07x from 2k unmasked and at every causal length
# (1k unmasked 0.97x in one), d256 1.07-1.11x from 8k unmasked (4k 0.93x in one) and
# 1.04-1.09x at 16k causal; d128 0.92-1.00x everywhere. Deterministic mode is measured only
# against cuDNN's default (non-deterministic) backward, so it keeps cuDNN first.
FASTER_THAN_CUDNN_TRAINING = {(64, False): 2048, (64, True): 512, (256, False): 8192,
                              (256, True): 16384}


def faster_than_cudnn(p: AttentionParams) -> Optional[str]:
    """Why FlashAttention goes before FusedAttention for this call on an sm90 GPU (a call
    shape of FASTER_THAN_CUDNN_FORWARD, or of FASTER_THAN_CUDNN_TRAINING with a gradient, run
    by the sm90 kernels), or None."""
    window = FlashCall.window_of(p)
    if (p.compute_capability is None or p.compute_capability[0] != 9
            or p.dtype != torch.bfloat16 or p.head_dim_qk != p.head_dim_v
            or p.num_gqa_groups != p.num_heads or p.is_varlen
            or p.max_seqlen_q != p.max_seqlen_kv or window not in ((-1, -1), (-1, 0))
            or p.core_attention_bias_type != "no_bias" or p.attention_dropout > 0.0
            or (p.requires_grad and p.deterministic)):
        return None
    causal = window == (-1, 0)
    table = FASTER_THAN_CUDNN_TRAINING if p.requires_grad else FASTER_THAN_CUDNN_FORWARD
    shortest = table.get((p.head_dim_qk, causal))
    if (shortest is None or p.max_seqlen_q < shortest or _extension() is None
            or uses_decode_kernel(p) or forward_family(p)[0] != "sm90"
            or (p.requires_grad and backward_family(p)[0] != "sm90")):
        return None
    what = ("its sm90 forward and backward were measured faster than cuDNN for bf16 training "
            "calls" if p.requires_grad else
            "its sm90 forward was measured faster than cuDNN for forward-only bf16 calls")
    return (f"{what} at head dim {p.head_dim_qk}{', causal,' if causal else ''} from "
            f"s = {shortest} (H200, 2026-12-01)")


def describe_choice(p: AttentionParams) -> str:
    """What runs inside the backend, for the debug log after it is selected."""
    if uses_decode_kernel(p):
        pages = f", paged K/V (page_size = {p.kv_page_size})" if p.kv_page_size else ""
        return f"FlashAttention decode kernel (split-KV, sm80 family{pages})"
    family, why_not_sm90 = forward_family(p)
    if family == "sm90":
        line = "FlashAttention forward kernel family = sm90 (wgmma, TMA)"
    else:
        line = f"FlashAttention kernel family = sm80 (not sm90: {why_not_sm90})"
    if not p.requires_grad:
        return line
    bwd, bwd_why_not_sm90 = backward_family(p)
    return line + f", backward = {bwd}" + (f" (not sm90: {bwd_why_not_sm90})" if bwd != "sm90"
                                           else " (wgmma, TMA)")


# --------------------------------------------------------------------------------------------
# One call's arguments, and the binding's calls
# --------------------------------------------------------------------------------------------
class FlashCall(NamedTuple):
    """The non-tensor arguments of one call, forward and backward (the binding's, with format
    names). The tensors that go with them, after q, k, v (and dout, out, lse in the backward):
    cu_seqlens_q, cu_seqlens_kv (varlen), rng_state (dropout), alibi_slopes (float32 ``[h]``
    or ``[b, h]``), each None where unused."""

    q_format: str
    kv_format: str
    max_seqlen_q: int
    max_seqlen_kv: int
    softmax_scale: float
    window_left: int
    window_right: int  # 0 for causal masks
    bottom_right: bool  # the diagonal's alignment (masks and ALiBi)
    dropout_p: float
    deterministic: bool  # backward only
    return_lse: bool  # forward only; the backward needs the LSE
    family: int = 0  # forward only: the kernel family asked for (0: the fastest that serves)
    bwd_family: int = 0  # backward only: the kernel family asked for (0: the binding's choice)

    @staticmethod
    def window_of(p: AttentionParams) -> Tuple[int, int]:
        """The kernels' (window_left, window_right): right is 0 for causal masks."""
        left, right = p.window_size
        return int(left), 0 if p.is_causal else int(right)

    @classmethod
    def from_params(cls, p: AttentionParams, return_lse: bool) -> "FlashCall":
        left, right = cls.window_of(p)
        return cls(p.q_format, p.kv_format, int(p.max_seqlen_q), int(p.max_seqlen_kv),
                   float(p.softmax_scale), left, right, bool(p.is_bottom_right),
                   float(p.attention_dropout), bool(p.deterministic), bool(return_lse),
                   requested_family(), requested_bwd_family())


def _ready(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy where the kernels cannot read t as it is (the binding raises)."""
    return t if aligned(t) else fresh(t)


def _fwd_ext(q, k, v, cu_q, cu_kv, rng, slopes, call: FlashCall):
    """The binding's fwd on kernel-ready q, k, v: (out in q's format, contiguous; lse float32,
    ``[h, t]`` for thd q, else ``[b, h, sq]``, or an empty tensor unless call.return_lse)."""
    c = call
    out, lse = _ext.fwd(q, k, v, cu_q, cu_kv, FLASH_FORMAT_CODES[c.q_format],
                        FLASH_FORMAT_CODES[c.kv_format], c.max_seqlen_q, c.max_seqlen_kv,
                        c.softmax_scale, c.window_left, c.window_right, c.bottom_right,
                        c.return_lse, c.dropout_p, rng, slopes, c.family)
    return out, lse


def _decode_ext(q, k, v, cu_q, cu_kv, page_table, call: FlashCall, num_splits: int = 0,
                seqlens_k: Optional[torch.Tensor] = None):
    """The binding's split-KV decode forward on kernel-ready q, k, v (k, v: page pools when
    page_table is given; seqlens_k: int32 [b] keys per sequence, instead of cu_kv): out in
    q's format."""
    c = call
    return _ext.fwd_kvcache(q, k, v, cu_q, cu_kv, page_table,
                            FLASH_FORMAT_CODES[c.q_format], FLASH_FORMAT_CODES[c.kv_format],
                            c.max_seqlen_q, c.max_seqlen_kv, c.softmax_scale, c.window_left,
                            c.window_right, c.bottom_right, num_splits, seqlens_k)


def _decode(q, k, v, cu_q, cu_kv, page_table, call: FlashCall, num_splits: int = 0,
            seqlens_k: Optional[torch.Tensor] = None):
    """_decode_ext on any q, k, v (copies of those the kernel cannot read)."""
    return _decode_ext(_ready(q), _ready(k), _ready(v), cu_q, cu_kv, page_table, call,
                       num_splits, seqlens_k)


def _fwd_impl(q, k, v, cu_q, cu_kv, rng, slopes, call: FlashCall):
    """_fwd_ext on any q, k, v (copies of those the kernels cannot read)."""
    return _fwd_ext(_ready(q), _ready(k), _ready(v), cu_q, cu_kv, rng, slopes, call)


def _bwd_ext(dout, q, k, v, out, lse, cu_q, cu_kv, rng, slopes, call: FlashCall,
             packed_grads: bool = False):
    """The binding's bwd on kernel-ready tensors: (dq, dk, dv), each contiguous with the
    shape of q, k, v; or, with packed_grads where q, k, v tile one buffer (a packed layout),
    views of one buffer laid out as q, k, v are (the split before the attention then takes
    them without a copy; not for the torch.library op, whose outputs must not alias)."""
    c = call
    extent = packed_extent((q, k, v)) if packed_grads else None
    grads = None if extent is None else list(grads_like((q, k, v), torch.empty, extent))
    # The family only where one is asked for (0, the binding's choice, is its default).
    family = {} if c.bwd_family == FLASH_FAMILIES["auto"] else {"family": c.bwd_family}
    dq, dk, dv = _ext.bwd(dout, q, k, v, out, lse, cu_q, cu_kv, FLASH_FORMAT_CODES[c.q_format],
                          FLASH_FORMAT_CODES[c.kv_format], c.max_seqlen_q, c.max_seqlen_kv,
                          c.softmax_scale, c.window_left, c.window_right, c.bottom_right,
                          c.dropout_p, rng, slopes, c.deterministic, grads, **family)
    return dq, dk, dv


def _bwd_impl(dout, q, k, v, out, lse, cu_q, cu_kv, rng, slopes, call: FlashCall):
    """_bwd_ext on any dout, q, k, v, out."""
    return _bwd_ext(_ready(dout), _ready(q), _ready(k), _ready(v), _ready(out), lse, cu_q,
                    cu_kv, rng, slopes, call)


def _require_extension() -> None:
    if _ext is None and _extension() is None:
        raise RuntimeError(f"transformer_fa_flash is not available ({_ext_error})")


# --------------------------------------------------------------------------------------------
# Autograd: eager (autograd.Function) and torch.library custom ops (torch.compile)
# --------------------------------------------------------------------------------------------
# Both save (q, k, v, out, lse, cu_q, cu_kv, rng, slopes) and the FlashCall.
class _FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_kv, rng, slopes, call):
        q, k, v = _ready(q), _ready(k), _ready(v)  # saved as read: no copy in the backward
        out, lse = _fwd_ext(q, k, v, cu_q, cu_kv, rng, slopes, call)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_kv, rng, slopes)
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_kv, rng, slopes = ctx.saved_tensors
        dq, dk, dv = _bwd_ext(_ready(dout), q, k, v, out, lse, cu_q, cu_kv, rng, slopes,
                              ctx.call, packed_grads=True)
        return dq, dk, dv, None, None, None, None, None


def _lse_shape(q_format: str, q: torch.Tensor, cu_q: Optional[torch.Tensor]):
    h = q.shape[-2]
    if q_format == "thd":
        return (h, q.shape[0])
    b = cu_q.shape[0] - 1 if cu_q is not None else (q.shape[1] if q_format == "sbhd"
                                                     else q.shape[0])
    sq = q.shape[0] if q_format == "sbhd" else q.shape[1]
    return (b, h, sq)


_OPTIONAL_TENSORS = ("Tensor? cu_seqlens_q, Tensor? cu_seqlens_kv, Tensor? rng_state, "
                     "Tensor? alibi_slopes")
FWD_SCHEMA = op_schema(FlashCall, f"Tensor q, Tensor k, Tensor v, {_OPTIONAL_TENSORS}",
                       "(Tensor, Tensor)")
BWD_SCHEMA = op_schema(FlashCall, "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                       f"Tensor lse, {_OPTIONAL_TENSORS}", "(Tensor, Tensor, Tensor)")
_FWD_TENSORS = 7  # the fwd op's tensor arguments, before the FlashCall's fields


def _register_ops() -> None:
    try:
        torch.ops.transformer_fa.flash_attn_bwd  # noqa: B018  (already registered: a reload)
        return
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("transformer_fa::flash_attn_fwd", mutates_args=(),
                             device_types="cuda", schema=FWD_SCHEMA)
    def flash_attn_fwd(q, k, v, cu_q, cu_kv, rng, slopes, *call):
        _require_extension()
        return _fwd_impl(q, k, v, cu_q, cu_kv, rng, slopes, FlashCall._make(call))

    @flash_attn_fwd.register_fake
    def _(q, k, v, cu_q, cu_kv, rng, slopes, *call):
        call = FlashCall._make(call)
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        shape = _lse_shape(call.q_format, q, cu_q) if call.return_lse else (0,)
        return out, q.new_empty(shape, dtype=torch.float32)

    @torch.library.custom_op("transformer_fa::flash_attn_bwd", mutates_args=(),
                             device_types="cuda", schema=BWD_SCHEMA)
    def flash_attn_bwd(dout, q, k, v, out, lse, cu_q, cu_kv, rng, slopes, *call):
        _require_extension()
        return _bwd_impl(dout, q, k, v, out, lse, cu_q, cu_kv, rng, slopes,
                         FlashCall._make(call))

    @flash_attn_bwd.register_fake
    def _(dout, q, k, v, out, lse, cu_q, cu_kv, rng, slopes, *call):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_kv, rng, slopes = inputs[:_FWD_TENSORS]
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_kv, rng, slopes)
        ctx.call = FlashCall._make(inputs[_FWD_TENSORS:])

    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_kv, rng, slopes = ctx.saved_tensors
        if not ctx.call.return_lse:
            raise RuntimeError("transformer_fa::flash_attn_fwd: the backward needs the LSE; "
                               "call the forward with return_lse=True")
        dq, dk, dv = torch.ops.transformer_fa.flash_attn_bwd(
            dout, q, k, v, out, lse, cu_q, cu_kv, rng, slopes, *ctx.call)
        return (dq, dk, dv) + (None,) * (_FWD_TENSORS - 3 + len(ctx.call))

    torch.library.register_autograd("transformer_fa::flash_attn_fwd", backward,
                                    setup_context=setup_context)


_register_ops()


# --------------------------------------------------------------------------------------------
# The backend entry point
# --------------------------------------------------------------------------------------------
def _alibi_slopes(inputs: AttentionInputs, p: AttentionParams, device) -> torch.Tensor:
    """float32 contiguous ``[h]`` or ``[b, h]`` (the binding's form)."""
    slopes = inputs.alibi_slopes
    if slopes is None:
        slopes = masks.default_alibi_slopes(p.num_heads).to(device)
    if slopes.dtype != torch.float32 or not slopes.is_contiguous():
        slopes = slopes.float().contiguous()
    return slopes


def _plan(p: AttentionParams, need_grad: bool) -> Tuple[FlashCall, bool]:
    """(the call's FlashCall, whether the split-KV decode kernel runs it)."""
    return (FlashCall.from_params(p, return_lse=need_grad),
            not need_grad and uses_decode_kernel(p))


# _plan by (params, need_grad, the raw kernel-family variables: all it reads besides the
# params), for eager calls: built anew it costs several µs of a call's host time (two
# environment reads, the params' properties). Emptied by selection.clear_cache.
_read_families = environment.reader((ENV_FLASH_FAMILY, ENV_FLASH_BWD_FAMILY))
_plans: Dict[tuple, Tuple[FlashCall, bool]] = {}
_PLANS_LIMIT = 1024


def _remembered_plan(p: AttentionParams, need_grad: bool) -> Tuple[FlashCall, bool]:
    key = (p, need_grad, _read_families())
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(p, need_grad)  # raises on a bad family variable, every call
        if len(_plans) >= _PLANS_LIMIT:
            _plans.clear()
        _plans[key] = plan
    return plan


def clear_cache() -> None:
    """Forgets the remembered plans (selection.clear_cache calls it)."""
    _plans.clear()


def run(inputs: AttentionInputs, params: AttentionParams) -> torch.Tensor:
    p = params
    q, k, v = inputs.q, inputs.k, inputs.v
    cu_q, cu_kv = inputs.cu_seqlens_q, inputs.cu_seqlens_kv
    if not p.is_varlen:
        cu_q = cu_kv = None
    rng = dropout_rng_state(q.device) if p.attention_dropout > 0.0 else None
    slopes = _alibi_slopes(inputs, p, q.device) if p.core_attention_bias_type == "alibi" else None
    need_grad = needs_grad(q, k, v)
    compiling = p.is_compiling or torch.compiler.is_compiling()
    # Traced code builds the plan anew, as it did before the memo (no dict for the tracer).
    call, decode = _plan(p, need_grad) if compiling else _remembered_plan(p, need_grad)
    if compiling and not decode:
        out = torch.ops.transformer_fa.flash_attn_fwd(q, k, v, cu_q, cu_kv, rng, slopes,
                                                      *call)[0]
        return out.flatten(-2)  # heads merged (out is contiguous)
    _require_extension()
    return _eager_forward(q, k, v, cu_q, cu_kv, rng, slopes, inputs.page_table, call, decode,
                          need_grad)


def _eager_forward(q, k, v, cu_q, cu_kv, rng, slopes, page_table, call: FlashCall,
                   decode: bool, need_grad: bool, ready=_ready) -> torch.Tensor:
    """The planned call outside torch.compile: the decode kernel, the autograd.Function or
    the plain forward; heads merged. ready: what makes q, k, v kernel-ready (bind's runner
    passes them as they are, having checked them)."""
    if decode:
        out = _decode_ext(ready(q), ready(k), ready(v), cu_q, cu_kv, page_table, call)
    elif need_grad:
        out = _FlashAttnFunction.apply(q, k, v, cu_q, cu_kv, rng, slopes, call)
    else:
        out = _fwd_ext(ready(q), ready(k), ready(v), cu_q, cu_kv, rng, slopes, call)[0]
    return out.flatten(-2)  # heads merged (out is contiguous)


def bind(inputs: AttentionInputs, params: AttentionParams):
    """A runner of this decision for DotProductAttention's remembered dense calls, or None.

    The calls it serves share the key of the call memo: shapes, strides, dtypes, grad and
    deterministic modes, the module's settings and every variable that run() reads (the
    NVTE_* switches and kernel families). So the plan and the stride half of the alignment
    checks are made here once; per call, runner(q, k, v) checks the data pointers (16-byte
    boundaries) and calls the binding, or hands a misaligned call to run() (which copies).
    Dense calls without dropout or ALiBi (the decode step, plain forwards and training)."""
    p = params
    q, k, v = inputs.q, inputs.k, inputs.v
    if (_ext is None or not bindable(p)
            or not (strides_aligned(q) and strides_aligned(k) and strides_aligned(v))):
        return None
    need_grad = needs_grad(q, k, v)
    call, decode = _remembered_plan(p, need_grad)

    def runner(q, k, v):
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            return run(AttentionInputs(q, k, v), p)
        return _eager_forward(q, k, v, None, None, None, None, None, call, decode, need_grad,
                              ready=_as_is)

    return runner


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


# --------------------------------------------------------------------------------------------
# FlashAttention's KV-cache call
# --------------------------------------------------------------------------------------------
def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_seqlens=None, block_table: Optional[torch.Tensor] = None,
                            softmax_scale: Optional[float] = None, causal: bool = False,
                            window_size: Tuple[int, int] = (-1, -1),
                            num_splits: int = 0) -> torch.Tensor:
    """FlashAttention's ``flash_attn_with_kvcache`` (its attention; the cache is written by
    the caller, e.g. InferenceParams): q ``[b, sq, h, d]`` against k_cache / v_cache
    ``[b, s_cache, h_k, d]``, or with ``block_table`` (int32 ``[b, pages per sequence]``) the
    page pools ``[pages, page_size, h_k, d]`` (page_size a multiple of 16).

    cache_seqlens: int32 ``[b]`` or an int, the keys of each sequence (default: all of
    s_cache; needed with a block table), each at most s_cache (pages per row * page_size).
    An int is checked; a tensor's lengths are not read on the host (that would wait for the
    GPU on every decode step): the kernel clamps them to [0, s_cache], so a bad length cannot
    read past the cache. causal aligns bottom-right: query i of sq sees the keys
    up to cache_seqlens - sq + i. window_size: (left, right), -1 unbounded. num_splits: CTAs per
    sequence and KV head over the keys (0: chosen from the shape and the GPU). Runs the
    split-KV decode kernel; returns ``[b, sq, h, d]``.
    """
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
        if not t.is_cuda or t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be a float16 or bfloat16 CUDA tensor, got "
                             f"{t.dtype} on {t.device}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache and v_cache must have one dtype, got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError("q, k_cache and v_cache must be on one device")
    b, sq, h, d = q.shape
    if k_cache.shape != v_cache.shape or k_cache.shape[-1] != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         f"must have one shape with q's head dim {d}")
    h_k = k_cache.shape[2]
    if d % 8 or d > MAX_HEAD_DIM or h % h_k:
        raise ValueError(f"head dim {d} must be a multiple of 8 up to {MAX_HEAD_DIM}, and "
                         f"q's {h} heads a multiple of the cache's {h_k}")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen), got {num_splits!r}")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) for w in window_size)):
        raise ValueError(f"window_size must be a (left, right) pair of ints, got "
                         f"{window_size!r}")
    if block_table is not None:
        if (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32
                or block_table.dim() != 2 or block_table.shape[0] != b
                or block_table.device != q.device):
            raise ValueError(f"block_table must be an int32 [b={b}, pages] tensor on "
                             f"{q.device}")
        if k_cache.shape[1] % 16:
            raise ValueError(f"page_size (k_cache.shape[1]) must be a multiple of 16, got "
                             f"{k_cache.shape[1]}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is required with a block_table")
        max_k = block_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] != b:
            raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, q {b}")
        max_k = k_cache.shape[1]
    if cache_seqlens is not None:
        if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
            if not 0 <= cache_seqlens <= max_k:
                raise ValueError(f"cache_seqlens must be in [0, {max_k}] (the cache's keys per "
                                 f"sequence), got {cache_seqlens}")
            cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
        if (not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32
                or cache_seqlens.shape != (b,) or cache_seqlens.device != q.device
                or not cache_seqlens.is_contiguous()):
            raise ValueError(f"cache_seqlens must be an int or a contiguous int32 [b={b}] "
                             f"tensor on {q.device}")
    _require_extension()
    scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
    left, right = int(window_size[0]), 0 if causal else int(window_size[1])
    call = FlashCall("bshd", "bshd", sq, max_k, scale, left, right, True, 0.0, False, False)
    return _decode(q, k_cache, v_cache, None, None, block_table, call, num_splits,
                   cache_seqlens)
