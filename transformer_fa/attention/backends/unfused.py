"""UnfusedDotProductAttention: the reference math in plain PyTorch, on any device.

Everything the API can express: every mask type, windows, GQA/MQA, thd, dropout, biases,
ALiBi. Scores are formed in the input dtype (as a tensor-core GEMM would), softmax and
everything around it in float32. Rows with no key left give zeros.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from .. import masks, padding
from ..params import AttentionInputs, AttentionParams

NAME = "UnfusedDotProductAttention"


def not_supported_reasons(params: AttentionParams) -> List[str]:
    # The reference serves every input the API accepts.
    return []


def _to_bhsd(x: torch.Tensor, fmt: str, cu_seqlens, max_len: int) -> torch.Tensor:
    if fmt == "sbhd":
        return x.permute(1, 2, 0, 3)
    if fmt == "bshd":
        return x.permute(0, 2, 1, 3)
    return padding.pad_packed(x, cu_seqlens, max_len).permute(0, 2, 1, 3)


def _from_bhsd(x: torch.Tensor, fmt: str, cu_seqlens, total: int) -> torch.Tensor:
    """``[b, h, s, d]`` -> the output shape of ``fmt``, heads merged."""
    b, h, s, d = x.shape
    if fmt == "sbhd":
        return x.permute(2, 0, 1, 3).reshape(s, b, h * d)
    bshd = x.permute(0, 2, 1, 3).reshape(b, s, h * d)
    if fmt == "bshd":
        return bshd
    return padding.unpad_to_packed(bshd, cu_seqlens, total)


def _lengths(inputs: AttentionInputs, params: AttentionParams, device):
    def one(cu, full):
        if cu is not None:
            return padding.seqlens_from_cu(cu)
        return torch.full((params.batch_size,), full, dtype=torch.int32, device=device)
    return (one(inputs.cu_seqlens_q, params.max_seqlen_q),
            one(inputs.cu_seqlens_kv, params.max_seqlen_kv))


def run(inputs: AttentionInputs, params: AttentionParams) -> torch.Tensor:
    p = params
    q = _to_bhsd(inputs.q, p.q_format, inputs.cu_seqlens_q, p.max_seqlen_q)
    k = _to_bhsd(inputs.k, p.kv_format, inputs.cu_seqlens_kv, p.max_seqlen_kv)
    v = _to_bhsd(inputs.v, p.kv_format, inputs.cu_seqlens_kv, p.max_seqlen_kv)
    b, h, sq, _ = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    group = h // hkv

    # GQA without repeating K/V: queries of one group share a K/V head by broadcasting.
    q5 = q.reshape(b, hkv, group, sq, q.shape[-1])
    scores = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)).reshape(b, h, sq, skv).float()

    if p.core_attention_bias_type == "pre_scale_bias":
        scores = scores + inputs.core_attention_bias.float()
    scores = scores * p.softmax_scale
    seqlens_q, seqlens_kv = _lengths(inputs, p, q.device)
    if p.core_attention_bias_type == "post_scale_bias":
        scores = scores + inputs.core_attention_bias.float()
    elif p.core_attention_bias_type == "alibi":
        scores = scores + masks.alibi_bias(inputs.alibi_slopes, p.attn_mask_type, seqlens_q,
                                           seqlens_kv, sq, skv)

    keep = masks.keep_mask(p.attn_mask_type, p.window_size, seqlens_q, seqlens_kv, sq, skv,
                           inputs.attention_mask)
    row_alive = keep.any(-1, keepdim=True)
    # Fully masked rows would be softmax(-inf...) = NaN: give them zeros instead, with a
    # gradient that stays finite.
    scores = scores.masked_fill(~keep, float("-inf")).masked_fill(~row_alive, 0.0)
    probs = torch.softmax(scores, dim=-1) * row_alive
    if p.attention_dropout > 0.0:
        probs = F.dropout(probs, p=p.attention_dropout, training=True)

    probs5 = probs.to(v.dtype).reshape(b, hkv, group, sq, skv)
    out = torch.matmul(probs5, v.unsqueeze(2)).reshape(b, h, sq, v.shape[-1])
    total_q = inputs.q.shape[0] if p.q_format == "thd" else None
    return _from_bhsd(out, p.q_format, inputs.cu_seqlens_q, total_q)
