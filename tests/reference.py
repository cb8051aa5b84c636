"""An independent float64 attention reference: one sequence at a time, masks from loops.

Written apart from transformer_fa's own mask code, from TE's documented semantics, so that
the backends are checked against a second reading of the rules.
"""
import math

import torch


def allowed(i, j, sq, skv, mask_type, window):
    """TE's rule for one query/key pair of one sequence of actual lengths sq, skv."""
    if i >= sq or j >= skv:
        return False
    top_left = mask_type in ("causal", "padding_causal")
    diag = i if top_left else i + skv - sq
    left, right = window
    if "causal" in mask_type:
        right = 0
    if left >= 0 and j < diag - left:
        return False
    if right >= 0 and j > diag + right:
        return False
    return True


def attention_one(q, k, v, mask_type="no_mask", window=(-1, -1), scale=None, bias=None,
                  alibi_slopes=None, arbitrary=None, pre_scale_bias=False, dtype=torch.float64,
                  softmax_offset=None, softcap=0.0, with_max_logit=False):
    """q [sq, h, d], k/v [skv, hkv, d(v)] (one sequence, actual lengths) -> [sq, h, dv].

    bias: [h|1, sq, skv]; alibi_slopes: [h]; arbitrary: bool [h|1, sq, skv], True = masked.
    softmax_offset: [h] or None; when given, row i of head h has the weights
    exp(s_ij) / (exp(softmax_offset[h]) + sum_j exp(s_ij)) (TE's off-by-one with zeros,
    learnable otherwise). softcap > 0: the scaled logits become softcap * tanh(s / softcap),
    before the post-scale bias and ALiBi. with_max_logit: also return, per head, the largest
    logit left by the masks (-inf where none is), as a float64 [h].
    Computed in ``dtype`` (float64 for the reference; the input dtype gives the error of the
    plain math in that precision, the yardstick of the FlashAttention error rule).
    Rows with nothing to attend give zeros.
    """
    q, k, v = q.cpu().to(dtype), k.cpu().to(dtype), v.cpu().to(dtype)
    sq, h, d = q.shape
    skv, hkv = k.shape[:2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(sq, h, v.shape[-1], dtype=dtype)
    max_logit = []
    top_left = mask_type in ("causal", "padding_causal")
    for head in range(h):
        kv_head = head // (h // hkv)
        s = q[:, head] @ k[:, kv_head].T
        if bias is not None and pre_scale_bias:
            s = s + bias[head % bias.shape[0]].cpu().to(dtype)
        s = s * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if bias is not None and not pre_scale_bias:
            s = s + bias[head % bias.shape[0]].cpu().to(dtype)
        if alibi_slopes is not None:
            off = 0 if top_left else skv - sq
            dist = torch.tensor([[abs(i + off - j) for j in range(skv)] for i in range(sq)],
                                dtype=dtype)
            s = s - float(alibi_slopes[head]) * dist
        keep = torch.tensor([[allowed(i, j, sq, skv, mask_type, window) for j in range(skv)]
                             for i in range(sq)], dtype=torch.bool)
        if arbitrary is not None:
            keep &= ~arbitrary[head % arbitrary.shape[0]].cpu()
        if with_max_logit:
            kept = [s.detach()[i, j].item() for i in range(sq) for j in range(skv) if keep[i, j]]
            max_logit.append(max(kept) if kept else float("-inf"))
        for i in range(sq):
            if not keep[i].any():
                continue
            weights = torch.exp(s[i][keep[i]])
            denominator = weights.sum()
            if softmax_offset is not None:
                denominator = denominator + torch.exp(softmax_offset[head].cpu().to(dtype))
            out[i, head] = (weights / denominator) @ v[:, kv_head][keep[i]]
    if with_max_logit:
        return out, torch.tensor(max_logit, dtype=torch.float64)
    return out
