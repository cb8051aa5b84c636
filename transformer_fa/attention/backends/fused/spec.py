"""What a cuDNN graph depends on: the call's non-tensor arguments (FusedCall) and the graph
description (Spec), built from tensors in a call or from params for the support check."""
from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple, Optional, Tuple

from ...params import AttentionParams

THD_SEQLEN_BUCKET = 128  # thd max_seqlen is rounded up to this, so varlen batches share graphs


class FusedCall(NamedTuple):
    """The non-tensor arguments of one call (forward and backward). Its torch.library ops take
    them flattened after their tensors (support.op_schema)."""

    q_format: str
    kv_format: str
    max_seqlen_q: int  # bucketed for thd
    max_seqlen_kv: int
    attn_mask_type: str
    window_left: int
    window_right: int
    softmax_scale: float
    dropout_p: float
    deterministic: bool  # backward only
    return_stats: bool  # forward only: the backward needs the softmax stats

    @classmethod
    def from_params(cls, p: AttentionParams, return_stats: bool) -> "FusedCall":
        sq = bucket(p.max_seqlen_q) if p.q_format == "thd" else p.max_seqlen_q
        skv = bucket(p.max_seqlen_kv) if p.kv_format == "thd" else p.max_seqlen_kv
        left, right = p.window_size
        return cls(p.q_format, p.kv_format, sq, skv, p.attn_mask_type, left, right,
                   float(p.softmax_scale), float(p.attention_dropout), bool(p.deterministic),
                   bool(return_stats))


_SPEC_FIELDS = (
    "dtype", "b", "hq", "hkv", "sq", "skv", "dqk", "dv",
    "q", "k", "v", "o", "stats",            # (b, h, s, d) strides; stats None = inference
    "ragged_q", "ragged_kv", "padding",
    "top_left", "left_bound", "right_bound", "scale", "dropout",
    "bias",                                  # None or (dims, strides)
    "backward", "do", "dq", "dk", "dv_", "dbias", "deterministic")
# Everything a cuDNN graph depends on. Built from tensors in run() on a cache miss, or from
# params (with the layout's contiguous strides) for the support check.
Spec = collections.namedtuple("Spec", _SPEC_FIELDS, defaults=(None,) * len(_SPEC_FIELDS))


def bhsd_strides(fmt: str, stride: Tuple[int, ...], max_s: int) -> Tuple[int, int, int, int]:
    """Strides of a tensor in ``fmt`` as cuDNN's logical (b, h, s, d)."""
    if fmt == "sbhd":
        return (stride[1], stride[2], stride[0], stride[3])
    if fmt == "bshd":
        return (stride[0], stride[2], stride[1], stride[3])
    # thd: [t, h, d]; batches start at ragged offsets, the b stride is nominal.
    return (max_s * stride[0], stride[1], stride[0], stride[2])


def contiguous_stride(shape) -> Tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def format_shape(fmt: str, b: int, s: int, h: int, d: int, t: Optional[int] = None):
    if fmt == "sbhd":
        return (s, b, h, d)
    if fmt == "bshd":
        return (b, s, h, d)
    return (t if t is not None else b * s, h, d)


def mask_band(mask_type: str, window: Tuple[int, int], same_lengths: bool):
    """(top_left, left_bound, right_bound) for cuDNN's diagonal band (TE semantics)."""
    left, right = window
    if "causal" in mask_type:
        right = 0
    left_bound = left + 1 if left >= 0 else None
    right_bound = right if right >= 0 else None
    top_left = mask_type in ("causal", "padding_causal")
    if left_bound is None and right_bound is None:
        top_left = True  # no band: the alignment means nothing
    elif same_lengths:
        top_left = True  # sq == skv in every sequence: both alignments coincide
    return top_left, left_bound, right_bound


def layout_strides(params: AttentionParams):
    """Contiguous strides of q, k, v for params.qkv_layout, as (b, h, s, d), with the
    token (s) stride. Packed layouts (``sb3hd``, ``bshd_bs2hd``, ...) interleave as TE's."""
    p = params
    b, sq, skv = p.batch_size, p.max_seqlen_q, p.max_seqlen_kv
    parts = p.qkv_layout.split("_")
    dims = {"q": (p.q_format, sq, p.num_heads, p.head_dim_qk),
            "k": (p.kv_format, skv, p.num_gqa_groups, p.head_dim_qk),
            "v": (p.kv_format, skv, p.num_gqa_groups, p.head_dim_v)}

    def packed(names, part):
        # part like "sb3hd", "bsh2d", "t3hd", "th2d": a buffer with an extra dim of len(names)
        n = len(names)
        fmt, s, h, d = dims[names[0]]
        if any(dims[x][2:] != (h, d) for x in names):
            raise ValueError("packed tensors differ in heads or head dim")
        heads_first = f"h{n}d" in part
        shape = list(format_shape(fmt, b, s, h, d))
        hdim = len(shape) - 2  # index of h
        shape.insert(hdim + 1 if heads_first else hdim, n)
        st = contiguous_stride(shape)
        k_dim = hdim + 1 if heads_first else hdim
        plain = tuple(x for i, x in enumerate(st) if i != k_dim)
        return {x: bhsd_strides(fmt, plain, s) for x in names}

    def plain(name):
        fmt, s, h, d = dims[name]
        st = contiguous_stride(format_shape(fmt, b, s, h, d))
        return {name: bhsd_strides(fmt, st, s)}

    out = {}
    try:
        if len(parts) == 1:
            out.update(packed(("q", "k", "v"), parts[0]))
        elif len(parts) == 2:
            out.update(plain("q"))
            out.update(packed(("k", "v"), parts[1]))
        else:
            for x in "qkv":
                out.update(plain(x))
    except Exception:
        out = {}
        for x in "qkv":
            out.update(plain(x))
    return out["q"], out["k"], out["v"]


def alibi_bias_dims(params: AttentionParams) -> Tuple[int, int, int, int]:
    p = params
    per_batch = (p.alibi_slopes_shape is not None and len(p.alibi_slopes_shape) == 2) or (
        p.is_padding and p.attn_mask_type not in ("causal", "padding_causal"))
    return (p.batch_size if per_batch else 1, p.num_heads, p.max_seqlen_q, p.max_seqlen_kv)


def bucket(n: int) -> int:
    return -(-n // THD_SEQLEN_BUCKET) * THD_SEQLEN_BUCKET


def spec_from_params(params: AttentionParams, backward: bool) -> Spec:
    """The graph a call described by params would build, with the layout's contiguous strides."""
    p = params
    b, hq, hkv = p.batch_size, p.num_heads, p.num_gqa_groups
    ragged_q, ragged_kv = p.q_format == "thd", p.kv_format == "thd"
    sq = bucket(p.max_seqlen_q) if ragged_q else p.max_seqlen_q
    skv = bucket(p.max_seqlen_kv) if ragged_kv else p.max_seqlen_kv
    q, k, v = layout_strides(dataclasses.replace(p, max_seqlen_q=sq, max_seqlen_kv=skv))
    o = bhsd_strides(p.q_format, contiguous_stride(format_shape(p.q_format, b, sq, hq,
                                                                   p.head_dim_v)), sq)
    stats = stats_strides(ragged_q, b, hq, sq)
    top_left, lb, rb = mask_band(p.attn_mask_type, p.window_size,
                                  sq == skv and not p.is_varlen)
    bias = None
    if p.core_attention_bias_type == "post_scale_bias":
        bias = bias_dims(p.core_attention_bias_shape, b, hq, sq, skv)
    elif p.core_attention_bias_type == "alibi":
        bias = alibi_bias_dims(p)
    if bias is not None:
        bias = (bias, contiguous_stride(bias))
    spec = Spec(dtype=p.dtype, b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, dqk=p.head_dim_qk,
                 dv=p.head_dim_v, q=q, k=k, v=v, o=o, stats=stats, ragged_q=ragged_q,
                 ragged_kv=ragged_kv, padding=p.is_varlen, top_left=top_left, left_bound=lb,
                 right_bound=rb, scale=float(p.softmax_scale),
                 dropout=float(p.attention_dropout), bias=bias, backward=False)
    if not backward:
        return spec
    dq = bhsd_strides(p.q_format, contiguous_stride(
        format_shape(p.q_format, b, sq, hq, p.head_dim_qk)), sq)
    dk = bhsd_strides(p.kv_format, contiguous_stride(
        format_shape(p.kv_format, b, skv, hkv, p.head_dim_qk)), skv)
    dv = bhsd_strides(p.kv_format, contiguous_stride(
        format_shape(p.kv_format, b, skv, hkv, p.head_dim_v)), skv)
    return spec._replace(backward=True, do=o, dq=dq, dk=dk, dv_=dv,
                        dbias=bool(bias is not None and p.core_attention_bias_requires_grad),
                        deterministic=bool(p.deterministic))


def bias_dims(shape_code: Optional[str], b, h, sq, skv):
    code = shape_code or "1hss"
    return (b if code[0] == "b" else 1, h if code[1] == "h" else 1, sq, skv)


def stats_strides(ragged: bool, b: int, h: int, sq: int):
    # Ragged: token-major [t, h] float32; else [b, h, sq, 1].
    return (sq * h, 1, h, 1) if ragged else (h * sq, sq, 1, 1)


def fwd_spec(call: FusedCall, q, k, v, bias, cu_q) -> Spec:
    """The forward graph of a call on these tensors."""
    q_format, kv_format, sq, skv, mask, wl, wr, scale, dropout, _, stats = call
    ragged_q, ragged_kv = q_format == "thd", kv_format == "thd"
    b = cu_q.shape[0] - 1 if cu_q is not None else (q.shape[1] if q_format == "sbhd"
                                                     else q.shape[0])
    hq, dqk = q.shape[-2], q.shape[-1]
    hkv, dv = v.shape[-2], v.shape[-1]
    o_st = contiguous_stride(format_shape(q_format, b, sq, hq, dv))
    padding = "padding" in mask or ragged_q or ragged_kv
    top_left, lb, rb = mask_band(mask, (wl, wr), sq == skv and not padding)
    return Spec(dtype=q.dtype, b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, dqk=dqk, dv=dv,
                 q=bhsd_strides(q_format, q.stride(), sq),
                 k=bhsd_strides(kv_format, k.stride(), skv),
                 v=bhsd_strides(kv_format, v.stride(), skv),
                 o=bhsd_strides(q_format, o_st, sq),
                 stats=stats_strides(ragged_q, b, hq, sq) if stats else None,
                 ragged_q=ragged_q, ragged_kv=ragged_kv, padding=padding, top_left=top_left,
                 left_bound=lb, right_bound=rb, scale=float(scale), dropout=float(dropout),
                 bias=None if bias is None else (tuple(bias.shape), tuple(bias.stride())),
                 backward=False)


def bwd_spec(call: FusedCall, q, k, v, bias, cu_q, dout, need_dbias: bool,
             packed_grads: bool = False) -> Spec:
    """The backward graph of a call on these tensors: gradients with the strides of q, k, v
    where packed_grads (``support.grads_like``), else contiguous in their formats."""
    def grad_stride(t):
        return t.stride() if packed_grads else contiguous_stride(t.shape)

    fmt_q, fmt_kv, sq, skv = call.q_format, call.kv_format, call.max_seqlen_q, call.max_seqlen_kv
    spec = fwd_spec(call, q, k, v, bias, cu_q)
    return spec._replace(
        backward=True,
        stats=stats_strides(fmt_q == "thd", spec.b, spec.hq, sq),
        do=bhsd_strides(fmt_q, dout.stride(), sq),
        dq=bhsd_strides(fmt_q, grad_stride(q), sq),
        dk=bhsd_strides(fmt_kv, grad_stride(k), skv),
        dv_=bhsd_strides(fmt_kv, grad_stride(v), skv),
        dbias=bool(need_dbias), deterministic=bool(call.deterministic))
