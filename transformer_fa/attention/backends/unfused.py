"""UnfusedDotProductAttention: the reference math in plain PyTorch, on any device.

Everything the API can express: every mask type, windows, GQA/MQA, thd, dropout, biases,
ALiBi, head_dim_qk != head_dim_v, softmax sinks (softmax_type), softcap and the max logit.
Scores are formed in the input dtype (as a tensor-core GEMM would); softmax and everything
around it in the compute dtype: float32 for fp16/bf16/float32 inputs, float64 for float64
(so that gradcheck holds). Rows with no key left give zeros.

thd inputs are padded to the longest actual sequence (from cu_seqlens), not to the declared
max_seqlen, so the cost follows the real lengths; under torch.compile the declared length is
used (the actual one is data-dependent).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import masks, padding
from ..params import AttentionInputs, AttentionParams

NAME = "UnfusedDotProductAttention"


def not_supported_reasons(params: AttentionParams) -> List[str]:
    # The reference serves every input the API accepts.
    return []


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32, and never below the input's own precision (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


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


def padded_lengths(params: AttentionParams, seqlens_q: torch.Tensor,
                   seqlens_kv: torch.Tensor) -> Tuple[int, int]:
    """The padded (sq, skv) the scores are built with.

    sbhd/bshd: the tensors' own lengths. thd in eager mode: the longest actual sequence (one
    host sync for both sides), so a generous declared max_seqlen costs nothing. Under
    torch.compile: the declared max_seqlen (a data-dependent size would break the graph).
    """
    sq, skv = params.max_seqlen_q, params.max_seqlen_kv
    thd_q, thd_kv = params.q_format == "thd", params.kv_format == "thd"
    if (thd_q or thd_kv) and not torch.compiler.is_compiling():
        longest_q, longest_kv = torch.stack([seqlens_q.max(), seqlens_kv.max()]).tolist()
        sq = longest_q if thd_q else sq
        skv = longest_kv if thd_kv else skv
    return sq, skv


def run(inputs: AttentionInputs, params: AttentionParams):
    """The output in q's format; with ``params.return_max_logit``, ``(output, max_logit [h])``."""
    p = params
    device = inputs.q.device
    seqlens_q, seqlens_kv = _lengths(inputs, p, device)
    sq, skv = padded_lengths(p, seqlens_q, seqlens_kv)
    q = _to_bhsd(inputs.q, p.q_format, inputs.cu_seqlens_q, sq)
    k = _to_bhsd(inputs.k, p.kv_format, inputs.cu_seqlens_kv, skv)
    v = _to_bhsd(inputs.v, p.kv_format, inputs.cu_seqlens_kv, skv)
    b, h = q.shape[:2]
    hkv = k.shape[1]
    group = h // hkv
    dtype = compute_dtype(q.dtype)

    # GQA without repeating K/V: the queries of a group are rows of one matrix against their
    # K/V head. K and V are made contiguous first: a GEMM over the permuted views (a KV
    # cache's [b, s, h, d]) runs several times slower than the copy costs.
    k, v = k.contiguous(), v.contiguous()
    grouped_q = q.reshape(b, hkv, group * sq, q.shape[-1])
    scores = torch.matmul(grouped_q, k.transpose(-1, -2)).reshape(b, h, sq, skv).to(dtype)

    bias = inputs.core_attention_bias
    if bias is not None:  # given for the declared lengths: trim to the padded ones
        bias = bias[..., :sq, :skv].to(dtype)
    if p.core_attention_bias_type == "pre_scale_bias":
        scores = scores + bias
    scores = scores * p.softmax_scale
    if p.softcap > 0.0:
        scores = p.softcap * torch.tanh(scores / p.softcap)
    if p.core_attention_bias_type == "post_scale_bias":
        scores = scores + bias
    elif p.core_attention_bias_type == "alibi":
        scores = scores + masks.alibi_bias(inputs.alibi_slopes, p.attn_mask_type, seqlens_q,
                                           seqlens_kv, sq, skv, p.bottom_right_diagonal,
                                           dtype=dtype)

    keep = masks.keep_mask(p.attn_mask_type, p.window_size, seqlens_q, seqlens_kv, sq, skv,
                           inputs.attention_mask, p.bottom_right_diagonal)
    # In place: scores is the scaling's (or a bias's) new tensor, which no backward reads.
    scores.masked_fill_(~keep, float("-inf"))
    max_logit = _max_logit(scores, q.dtype) if p.return_max_logit else None
    row_alive = keep.any(-1, keepdim=True)
    # Fully masked rows would be softmax(-inf...) = NaN: give them zeros instead, with a
    # gradient that stays finite.
    scores.masked_fill_(~row_alive, 0.0)
    probs = _softmax(scores, p.softmax_type, inputs.softmax_offset) * row_alive
    if p.attention_dropout > 0.0:
        probs = F.dropout(probs, p=p.attention_dropout, training=True)

    grouped_probs = probs.to(v.dtype).reshape(b, hkv, group * sq, skv)
    out = torch.matmul(grouped_probs, v).reshape(b, h, sq, v.shape[-1])
    total_q = inputs.q.shape[0] if p.q_format == "thd" else None
    out = _from_bhsd(out, p.q_format, inputs.cu_seqlens_q, total_q)
    return (out, max_logit) if p.return_max_logit else out


def _softmax(scores: torch.Tensor, softmax_type: str,
             softmax_offset: Optional[torch.Tensor]) -> torch.Tensor:
    """Softmax over keys; "off-by-one" / "learnable" add exp(offset[h]) to the denominator
    (an attention sink that takes probability mass but has no value)."""
    if softmax_type == "vanilla":
        return torch.softmax(scores, dim=-1)
    if softmax_offset is None:
        raise ValueError(f"softmax_type={softmax_type!r} needs inputs.softmax_offset [h]")
    sink = softmax_offset.to(device=scores.device, dtype=scores.dtype).view(1, -1, 1, 1)
    log_denominator = torch.logaddexp(torch.logsumexp(scores, -1, keepdim=True), sink)
    return torch.exp(scores - log_denominator)


def _max_logit(masked_scores: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """TE's max_logit: the largest logit the softmax sees (scaled, biased, masked) per head,
    ``[h]`` in the output's dtype; a statistic (for QK-clip), so it carries no gradient.
    A head with no unmasked logit at all gives -inf."""
    b, h, sq, skv = masked_scores.shape
    if b * sq * skv == 0:  # no logit at all (every sequence empty): amax has nothing to reduce
        return masked_scores.new_full((h,), float("-inf"), dtype=out_dtype)
    return masked_scores.detach().amax(dim=(0, 2, 3)).to(out_dtype)
