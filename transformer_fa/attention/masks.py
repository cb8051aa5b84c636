"""Mask, window and ALiBi semantics (TE's), shared by every backend that builds them.

Positions: query i in [0, sq), key j in [0, skv), per sequence with its actual lengths.
The diagonal offset ``off`` is 0 for top-left alignment ("causal", "padding_causal") and
``skv_len - sq_len`` for every other mask type (bottom-right alignment, as TE's sliding
window and ``*_bottom_right`` masks use); TE's ``bottom_right_diagonal=False`` moves the
diagonal of a non-causal mask (its window, its ALiBi) to the top left. Key j is kept for query i when
  j < skv_len and i < sq_len                     (padding)
  j <= i + off                                   (causal types)
  i + off - left <= j <= i + off + right         (window (left, right); -1 = unlimited)
  and the arbitrary mask, if any, is False there (True = masked out).
"""
from __future__ import annotations

import math
import warnings
from typing import Optional, Tuple

import torch

from .params import MASK_TYPES, diagonal_is_bottom_right


def normalize_mask_type(attn_mask_type: str, name: str = "attn_mask_type") -> str:
    """TE's mask type, with TE's aliases: "padding,causal" and "causal,padding" are
    "padding_causal" (any "a,b" reads as "a_b")."""
    if isinstance(attn_mask_type, str):
        attn_mask_type = attn_mask_type.replace(",", "_")
        if attn_mask_type == "causal_padding":
            attn_mask_type = "padding_causal"
    if attn_mask_type not in MASK_TYPES:
        raise ValueError(f"{name} must be one of {MASK_TYPES} (or 'padding,causal'), "
                         f"got {attn_mask_type!r}")
    return attn_mask_type


def is_bottom_right(attn_mask_type: str, bottom_right_diagonal: Optional[bool] = None) -> bool:
    """params.diagonal_is_bottom_right, with None meaning TE's default (bottom-right)."""
    return diagonal_is_bottom_right(attn_mask_type, bottom_right_diagonal is not False)


def check_set_window_size(attn_mask_type: str, window_size: Optional[Tuple[int, int]]
                          ) -> Tuple[int, int]:
    """TE's normalization of window_size for a mask type.

    Causal masks always have right == 0 (None or (-1, -1) becomes (-1, 0)); others default
    to (-1, -1), and their (-1, 0) (TE's "causal" window) becomes (-1, -1) with a warning,
    as in TE. Values below -1 are rejected.
    """
    normalize_mask_type(attn_mask_type)
    if window_size is not None:
        if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
                or not all(isinstance(w, int) for w in window_size)):
            raise TypeError(f"window_size must be a tuple of two ints, got {window_size!r}")
        window_size = tuple(window_size)
        if min(window_size) < -1:
            raise ValueError(f"window_size entries must be >= -1, got {window_size}")
    if "causal" in attn_mask_type:
        if window_size is None or window_size == (-1, -1):
            return (-1, 0)
        if window_size[1] != 0:
            warnings.warn(f"window_size={window_size} with attn_mask_type={attn_mask_type}: "
                          f"the right side is set to 0 for causal masks")
        return (window_size[0], 0)
    if window_size == (-1, 0):
        warnings.warn(f"window_size=(-1, 0) with attn_mask_type={attn_mask_type}: a causal "
                      f"window needs a causal mask type; using (-1, -1)")
        return (-1, -1)
    return (-1, -1) if window_size is None else window_size


def diagonal_offset(attn_mask_type: str, seqlens_q: torch.Tensor, seqlens_kv: torch.Tensor,
                    bottom_right_diagonal: Optional[bool] = None) -> torch.Tensor:
    """Per-sequence offset of the diagonal, ``[b]`` (see the module docstring)."""
    if not is_bottom_right(attn_mask_type, bottom_right_diagonal):
        return torch.zeros_like(seqlens_q)
    return seqlens_kv - seqlens_q


def keep_mask(attn_mask_type: str, window_size: Tuple[int, int], seqlens_q: torch.Tensor,
              seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int,
              attention_mask: Optional[torch.Tensor] = None,
              bottom_right_diagonal: Optional[bool] = None) -> torch.Tensor:
    """Boolean ``[b, 1, sq, skv]`` (or broadcast with the arbitrary mask), True = attend.

    seqlens_q / seqlens_kv: ``[b]`` actual lengths (the full lengths where there is no padding).
    """
    device = seqlens_q.device
    i = torch.arange(max_seqlen_q, device=device).view(1, 1, -1, 1)
    j = torch.arange(max_seqlen_kv, device=device).view(1, 1, 1, -1)
    lq = seqlens_q.view(-1, 1, 1, 1)
    lk = seqlens_kv.view(-1, 1, 1, 1)
    diag = i + diagonal_offset(attn_mask_type, seqlens_q, seqlens_kv,
                               bottom_right_diagonal).view(-1, 1, 1, 1)
    keep = (i < lq) & (j < lk)
    left, right = window_size
    if "causal" in attn_mask_type:
        right = 0
    if left >= 0:
        keep = keep & (j >= diag - left)
    if right >= 0:
        keep = keep & (j <= diag + right)
    if attention_mask is not None:
        keep = keep & ~attention_mask
    return keep


def default_alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's geometric slopes, float32 ``[h]`` (used when none are given)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (k + 1) for k in range(closest)]
    if closest < num_heads:
        extra = 2.0 ** (-4.0 / closest)
        slopes += [extra ** (2 * k + 1) for k in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(alibi_slopes: torch.Tensor, attn_mask_type: str, seqlens_q: torch.Tensor,
               seqlens_kv: torch.Tensor, max_seqlen_q: int, max_seqlen_kv: int,
               bottom_right_diagonal: Optional[bool] = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[b|1, h, sq, skv]`` in ``dtype``: ``-slope * |i + off - j|``.

    The slopes are float32 (TE's); the bias is built in ``dtype`` (float64 for a float64
    reference), so it never limits the precision of the scores it is added to.
    """
    device = seqlens_q.device
    i = torch.arange(max_seqlen_q, device=device).view(1, 1, -1, 1)
    j = torch.arange(max_seqlen_kv, device=device).view(1, 1, 1, -1)
    off = diagonal_offset(attn_mask_type, seqlens_q, seqlens_kv,
                          bottom_right_diagonal).view(-1, 1, 1, 1)
    distance = (i + off - j).abs().to(dtype)
    slopes = alibi_slopes.to(device=device, dtype=dtype)
    slopes = slopes.view(1, -1, 1, 1) if slopes.dim() == 1 else slopes.view(*slopes.shape, 1, 1)
    return -slopes * distance
