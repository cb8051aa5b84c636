"""FusedAttention: cuDNN's fused SDPA through cudnn-frontend's Python graph API.

pip package ``nvidia-cudnn-frontend`` (``import cudnn``), an optional extra.

How a call runs
- q, k, v go to cuDNN as logical ``(b, h, s, d)`` tensors with their real strides: every
  sbhd/bshd layout, packed ``sb3hd``-style views and GQA split views go in as they are, no
  copies. thd tensors are ragged: cuDNN gets ``(b, h, max_s, d)`` plus a ragged-offset tensor
  built from cu_seqlens (``cu_seqlens * token_stride``) and the padding-mask sequence lengths
  it requires. Padding masks on sbhd/bshd use sequence-length tensors.
- Masks (TE semantics) map to cuDNN's diagonal band: ``left_bound = left + 1``,
  ``right_bound = right`` (causal: 0); top-left alignment for "causal"/"padding_causal",
  bottom-right (per-sequence actual lengths) for every other type. ALiBi becomes a
  post-scale bias ``-slope * |i + off - j|`` less its row maximum, in the input dtype.
- Graphs are cached (LRU) by a key made of the call's scalars and the tensors' shapes and
  strides, so a configuration is built once per process; the build time goes to the debug
  log. Graphs run on torch's current stream, with their workspace from torch's allocator
  (small workspaces are kept per stream and reused).
- ``not_supported_reasons`` asks cuDNN itself (validate + check_support, no plan build) about
  a graph described from the params with the layout's contiguous strides; the answer is
  cached, and a rejection becomes a reason, never an exception. The support check and the
  plan builder share one ``plans.GraphCache`` (``CACHE``): a graph the check validated is the
  one the first call builds.
- The ops are registered with torch.library (``transformer_fa::fused_attn_fwd`` and
  ``transformer_fa::fused_attn_bwd``, with fake and autograd registrations) and torch.compile
  traces through them. In eager mode the same implementations run under a thin
  autograd.Function, which costs less host time than the dispatcher path. The call's
  non-tensor arguments travel as one ``FusedCall``.

Modules: cudnn_lib (import, versions, handles, workspaces), spec (FusedCall, graph
descriptions), graph (cuDNN graph construction), plans (built plans, GraphCache), reasons
(the support check), ops (forward/backward, autograd, custom ops); this file: the entry point.
"""
from __future__ import annotations

import atexit
import gc

import torch

from ... import masks, padding
from ...params import AttentionInputs, AttentionParams
from ..support import bindable, dropout_rng_state, needs_grad, never_raises
from . import cudnn_lib, ops, reasons
from .cudnn_lib import versions
from .plans import CACHE, GraphCache
from .reasons import MIN_CUDNN_VERSION, SUPPORTED_ARCH_MAJORS, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from .spec import FusedCall

__all__ = ["NAME", "not_supported_reasons", "run", "versions", "clear_cache", "CACHE",
           "GraphCache", "FusedCall", "MIN_CUDNN_VERSION", "SUPPORTED_ARCH_MAJORS",
           "SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIMS"]

NAME = "FusedAttention"


def _reasons(params: AttentionParams):
    return reasons.not_supported(params, CACHE)


# Why this backend cannot serve params (each reads after "Disabling <NAME> ").
not_supported_reasons = never_raises(_reasons)


def clear_cache() -> None:
    """Drops every built graph, support verdict and kept workspace (tests use it)."""
    CACHE.clear()
    cudnn_lib.release_workspaces()


@atexit.register
def _release() -> None:
    # Free the cuDNN objects before the interpreter tears cudnn-frontend's bindings down.
    clear_cache()
    cudnn_lib.release_handles()
    gc.collect()


ops.register_ops()


def _alibi_bias(slopes: torch.Tensor, params: AttentionParams, cu_q, cu_kv) -> torch.Tensor:
    """The ALiBi bias (masks.alibi_bias) less each row's maximum, as a post-scale bias
    ``[b|1, h, sq, skv]`` in q's dtype."""
    p = params
    if p.is_padding:
        lens_q, lens_kv = padding.seqlens_from_cu(cu_q), padding.seqlens_from_cu(cu_kv)
    else:
        lens_q = torch.full((1,), p.max_seqlen_q, device=slopes.device)
        lens_kv = torch.full((1,), p.max_seqlen_kv, device=slopes.device)
    bias = masks.alibi_bias(slopes, p.attn_mask_type, lens_q, lens_kv, p.max_seqlen_q,
                            p.max_seqlen_kv)
    # Relative to each row's maximum (a per-row constant leaves the softmax unchanged): the
    # keys that carry the weight get small values, which fp16/bf16 hold exactly or nearly.
    # As absolute values, rows far from the diagonal (sq > skv) rounded by up to 2^-9 of a
    # bias in the thousands.
    bias = bias - bias.amax(dim=-1, keepdim=True)
    return bias.to(p.dtype).contiguous()


def run(inputs: AttentionInputs, params: AttentionParams) -> torch.Tensor:
    p = params
    q, k, v = inputs.q, inputs.k, inputs.v
    cu_q, cu_kv = inputs.cu_seqlens_q, inputs.cu_seqlens_kv
    if not p.is_varlen:
        cu_q = cu_kv = None
    bias = None
    if p.core_attention_bias_type == "post_scale_bias":
        bias = inputs.core_attention_bias
    elif p.core_attention_bias_type == "alibi":
        bias = _alibi_bias(inputs.alibi_slopes, p, cu_q, cu_kv)
    rng = None
    if p.attention_dropout > 0.0:
        # Philox seed and offset for cuDNN's dropout; saved for the backward.
        rng = dropout_rng_state(q.device)
    need_grad = needs_grad(q, k, v, bias)
    call = FusedCall.from_params(p, return_stats=need_grad)
    if p.is_compiling or torch.compiler.is_compiling():
        out = torch.ops.transformer_fa.fused_attn_fwd(q, k, v, bias, cu_q, cu_kv, rng, *call)[0]
        return out.flatten(-2)  # heads merged (out is contiguous)
    return _eager_forward(q, k, v, bias, cu_q, cu_kv, rng, call, need_grad)


def _eager_forward(q, k, v, bias, cu_q, cu_kv, rng, call: FusedCall,
                   need_grad: bool) -> torch.Tensor:
    """The call outside torch.compile (the autograd.Function or the plain forward); heads
    merged."""
    if need_grad:
        out = ops.FusedAttnFunction.apply(q, k, v, bias, cu_q, cu_kv, rng, call)
    else:
        out = ops.fwd_core(q, k, v, bias, cu_q, cu_kv, rng, call)[0]  # no stats to make
    return out.flatten(-2)  # heads merged (out is contiguous)


def bind(inputs: AttentionInputs, params: AttentionParams):
    """A runner of this decision for DotProductAttention's remembered dense calls (the key
    of its call memo fixes everything run() derives from the params and modes), or None:
    runner(q, k, v) is run(AttentionInputs(q, k, v), params) without rebuilding the call.
    Dense calls without dropout or a bias."""
    p = params
    q, k, v = inputs.q, inputs.k, inputs.v
    if not bindable(p):
        return None
    need_grad = needs_grad(q, k, v)
    call = FusedCall.from_params(p, return_stats=need_grad)

    def runner(q, k, v):
        return _eager_forward(q, k, v, None, None, None, None, call, need_grad)

    return runner
