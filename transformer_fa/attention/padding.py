"""Sequence lengths: from padding masks and cu_seqlens, and between packed (thd) and padded."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..utils import host_reads_allowed


def seqlens_from_cu(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return cu_seqlens[1:] - cu_seqlens[:-1]


def cu_from_seqlens(seqlens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))


def seqlens_from_padding_mask(mask: torch.Tensor, name: str, batch: int, seqlen: int
                              ) -> torch.Tensor:
    """Lengths ``[b]`` (int32) of a right-padded bool mask ``[b, 1, 1, s]`` (True = padding).

    A mask that is not right-padded (a kept position after a padded one) is rejected:
    every backend reads the first ``length`` tokens of each sequence.
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor [b, 1, 1, s] (True = masked out), "
                        f"got {type(mask).__name__ if not isinstance(mask, torch.Tensor) else mask.dtype}")
    if mask.shape != (batch, 1, 1, seqlen):
        raise ValueError(f"{name} must have shape [b, 1, 1, s] = {[batch, 1, 1, seqlen]}, "
                         f"got {list(mask.shape)}")
    flat = mask.view(batch, seqlen)
    lengths = (~flat).sum(-1, dtype=torch.int32)
    if host_reads_allowed():
        expected = torch.arange(seqlen, device=mask.device).view(1, -1) >= lengths.view(-1, 1)
        if not torch.equal(expected, flat):
            raise ValueError(f"{name} must be right-padded: True (masked) only after the "
                             f"last kept token of each sequence")
    return lengths


def check_cu_seqlens(cu_seqlens: Optional[torch.Tensor], name: str, batch: Optional[int],
                     total: Optional[int], device: torch.device) -> int:
    """Validates an int32 ``[b + 1]`` cu_seqlens; returns b."""
    if cu_seqlens is None:
        raise ValueError(f"{name} is required for the thd format and padding masks")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with b + 1 >= 2 entries, got shape "
                         f"{list(cu_seqlens.shape)}")
    if batch is not None and cu_seqlens.numel() != batch + 1:
        raise ValueError(f"{name} must have b + 1 = {batch + 1} entries, got {cu_seqlens.numel()}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} is on {cu_seqlens.device}, expected {device}")
    if host_reads_allowed():
        first, last, min_len = torch.stack(
            [cu_seqlens[0], cu_seqlens[-1], seqlens_from_cu(cu_seqlens).min()]).tolist()
        if first != 0 or min_len < 0:
            raise ValueError(f"{name} must start at 0 and never decrease, got {cu_seqlens.tolist()}")
        if total is not None and last > total:
            raise ValueError(f"{name} ends at {last} but the tensor has only {total} tokens")
    return cu_seqlens.numel() - 1


def max_seqlen(cu_seqlens: torch.Tensor) -> int:
    return int(seqlens_from_cu(cu_seqlens).max().item())


def padded_index(cu_seqlens: torch.Tensor, max_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """For a packed tensor: token index ``[b, max_len]`` of each padded slot, and its validity."""
    pos = torch.arange(max_len, device=cu_seqlens.device).view(1, -1)
    valid = pos < seqlens_from_cu(cu_seqlens).view(-1, 1)
    index = (cu_seqlens[:-1].view(-1, 1) + pos) * valid
    return index.long(), valid


def pad_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[t, ...]`` packed -> ``[b, max_len, ...]`` with zeros in the padding."""
    index, valid = padded_index(cu_seqlens, max_len)
    if x.shape[0] == 0:
        return x.new_zeros(*index.shape, *x.shape[1:])
    out = x[index]
    return out * valid.view(*valid.shape, *([1] * (x.dim() - 1))).to(out.dtype)


def unpad_to_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[b, max_len, ...]`` padded -> ``[total, ...]`` packed; tokens past cu[-1] are zero."""
    index, valid = padded_index(cu_seqlens, x.shape[1])
    out = x.new_zeros(total, *x.shape[2:])
    return out.index_put((index[valid],), x[valid])


def padded_thd_index(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor,
                     name: str, total_padded: int) -> torch.Tensor:
    """For thd with padding between sequences (TE's ``cu_seqlens_*_padded``): the row of each
    real token in the padded tensor, int64 ``[cu_seqlens[-1]]`` in sequence order.

    Sequence i has ``cu_seqlens[i+1] - cu_seqlens[i]`` tokens starting at row
    ``cu_seqlens_padded[i]``; its slot is ``cu_seqlens_padded[i+1] - cu_seqlens_padded[i]``.
    """
    if not isinstance(cu_seqlens_padded, torch.Tensor) or cu_seqlens_padded.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor [b + 1]")
    if cu_seqlens_padded.shape != cu_seqlens.shape:
        raise ValueError(f"{name} must have the shape of the unpadded cu_seqlens "
                         f"{list(cu_seqlens.shape)}, got {list(cu_seqlens_padded.shape)}")
    if cu_seqlens_padded.device != cu_seqlens.device:
        raise ValueError(f"{name} is on {cu_seqlens_padded.device}, expected {cu_seqlens.device}")
    lengths = seqlens_from_cu(cu_seqlens)
    slots = seqlens_from_cu(cu_seqlens_padded)
    first, last, short = torch.stack([cu_seqlens_padded[0], cu_seqlens_padded[-1],
                                      (slots - lengths).min()]).tolist()
    if first != 0 or short < 0:
        raise ValueError(f"{name} must start at 0 and give every sequence a slot at least as "
                         f"long as its length, got {cu_seqlens_padded.tolist()} for lengths "
                         f"{lengths.tolist()}")
    if last > total_padded:
        raise ValueError(f"{name} ends at {last} but the tensor has only {total_padded} tokens")
    shift = torch.repeat_interleave((cu_seqlens_padded[:-1] - cu_seqlens[:-1]).long(),
                                    lengths.long())
    return torch.arange(shift.numel(), device=cu_seqlens.device) + shift
