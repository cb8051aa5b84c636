"""Rotary position embedding (RoPE, https://arxiv.org/abs/2104.09864) with TE's API.

``RotaryPositionEmbedding(dim)(max_seq_len)`` returns TE's frequency table: float32
``[max_seq_len, 1, 1, dim]``, each frequency written twice, either as two halves
``[f0..f(d/2-1), f0..f(d/2-1)]`` or, with ``interleaved=True``, as pairs ``[f0, f0, f1, f1, ...]``.
``apply_rotary_pos_emb`` rotates the first ``dim`` channels of q or k by those angles and passes
the rest through; in ``thd`` the positions restart at 0 at every sequence start in ``cu_seqlens``.
"""
from typing import Optional

import torch

from .. import kernels
from ..utils import host_reads_allowed
from .constants import TENSOR_FORMATS as _TENSOR_FORMATS

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb"]


class RotaryPositionEmbedding(torch.nn.Module):
    """Builds RoPE frequency tables.

    dim: channels to rotate (the head dim, or fewer for partial rotary).
    rotary_percent: rotate only ``int(dim * rotary_percent)`` channels.
    seq_len_interpolation_factor: divide positions by this factor (position interpolation,
        https://arxiv.org/abs/2306.15595). With ``pretrained_max_position_embeddings`` also set,
        sequences longer than ``pretrained * factor`` are scaled dynamically to fit, as in TE.
    rotary_base: the base of the geometric frequency ladder.
    interleaved: pair channels (0, 1), (2, 3), ... instead of (i, i + dim/2).
    """

    def __init__(
        self,
        dim: int,
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[float] = None,
        pretrained_max_position_embeddings: Optional[int] = None,
        rotary_base: float = 10000.0,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent}")
        if seq_len_interpolation_factor is not None and seq_len_interpolation_factor <= 0:
            raise ValueError(
                f"seq_len_interpolation_factor must be positive, got {seq_len_interpolation_factor}"
            )
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        self.dim = dim
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base = rotary_base
        self.interleaved = interleaved
        # TE puts the table on the current CUDA device; fall back to CPU without one.
        device = "cpu"
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        self.register_buffer("inv_freq", 1.0 / (rotary_base**exponents))

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        """``[max_seq_len, 1, 1, dim]`` table for positions ``offset ..``, in inv_freq's dtype
        (float32; float64 after ``.double()``)."""
        inv_freq = self.inv_freq
        seq = torch.arange(max_seq_len, device=inv_freq.device, dtype=inv_freq.dtype) + offset
        factor = self.seq_len_interpolation_factor
        if factor is not None:
            pretrained = self.pretrained_max_position_embeddings
            if pretrained is not None and max_seq_len > pretrained * factor:
                factor = max_seq_len / pretrained  # dynamic scaling beyond what was trained
            seq = seq / factor
        freqs = torch.outer(seq, inv_freq)
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(emb.size(0), 1, 1, emb.size(1))


def _swap_pairs(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The partner of each channel: [x2, x1] of the halves (or of each interleaved pair)."""
    if not interleaved:
        return x.roll(x.shape[-1] // 2, -1)
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def _negate_first(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x with the first channel of each pair negated (where RoPE subtracts): a sine that
    multiplies ``_swap_pairs(t)`` gives RoPE's rotate-half term [-x2, x1] * sin, exactly."""
    x = x.clone()
    first = x[..., 0::2] if interleaved else x[..., :x.shape[-1] // 2]
    first.neg_()
    return x


def _cp_positions(local_len, cp_size: int, cp_rank: int, local_pos: torch.Tensor) -> torch.Tensor:
    """Global positions of a rank's tokens under context parallelism (TE's load balancing: the
    first half of the rank's part of a sequence is chunk ``cp_rank`` of ``2 * cp_size``, the
    second half chunk ``2 * cp_size - 1 - cp_rank``). ``local_len``: an int or per token."""
    half = local_len // 2
    first = cp_rank * half + local_pos
    second = (2 * cp_size - 1 - cp_rank) * half + local_pos - half
    return torch.where(local_pos < half, first, second)


def _token_positions(
    cu_seqlens: torch.Tensor, total: int, start_positions: Optional[torch.Tensor],
    cp_size: int = 1, cp_rank: int = 0,
) -> torch.Tensor:
    """Position of every thd token inside its own sequence (tokens past cu_seqlens[-1] get 0).
    With cp_size > 1, ``cu_seqlens`` are this rank's and the positions global ones."""
    cu = cu_seqlens.to(torch.int64)
    token = torch.arange(total, device=cu.device)
    # which sequence each token belongs to: number of sequence ends at or before it
    seq_id = torch.searchsorted(cu[1:], token, right=True)
    inside = seq_id < cu.numel() - 1
    seq_id = seq_id.clamp(max=cu.numel() - 2)
    pos = token - cu[seq_id]
    if cp_size > 1:
        pos = _cp_positions(cu[seq_id + 1] - cu[seq_id], cp_size, cp_rank, pos)
    if start_positions is not None:
        pos = pos + start_positions.to(device=cu.device, dtype=torch.int64)[seq_id]
    return torch.where(inside, pos, torch.zeros_like(pos))


def _check_positions(pos: torch.Tensor, max_len: int, what: str) -> None:
    """Every position must fall inside the table. The check reads the positions on the host,
    so it runs in eager only; under torch.compile the table lookup's own bounds check (an
    IndexError, or a device assert) catches the same error without a sync in the graph."""
    if not host_reads_allowed() or pos.numel() == 0:
        return
    if int(pos.max()) >= max_len:
        raise ValueError(f"{what} the {max_len} positions freqs covers")


def _check_cp_lengths(cu_seqlens: torch.Tensor, cp_size: int) -> None:
    """Context parallelism cuts every sequence into 2 * cp_size chunks (eager-only check)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if host_reads_allowed() and bool((lengths % (2 * cp_size) != 0).any()):
        raise ValueError(f"cu_seqlens: sequence lengths {lengths.tolist()} must be divisible "
                         f"by 2 * cp_size = {2 * cp_size} under context parallelism (pass "
                         f"the padded cu_seqlens, as TE)")


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: Optional[torch.Tensor] = None,
    interleaved: bool = False,
    fused: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> torch.Tensor:
    """Apply RoPE to ``t``: ``[s, b, h, d]`` (sbhd), ``[b, s, h, d]`` (bshd) or ``[t, h, d]`` (thd).

    freqs: ``[s2, 1, 1, d2]`` from ``RotaryPositionEmbedding`` with ``s2 >= s`` and ``d2 <= d``;
        channels past ``d2`` pass through unchanged.
    start_positions: optional ``[b]`` offsets added to each sequence's positions.
    cu_seqlens: int32 ``[b + 1]`` sequence starts, required for thd (with cp_size > 1 those
        of the whole, padded sequences, as TE: this rank holds ``cu_seqlens // cp_size``).
    cp_size, cp_rank: context parallelism (TE's): ``t`` is this rank's load-balanced part of
        each sequence (chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``)
        and gets the angles of those global positions.
    fused: TE's switch (default False, as TE): on CUDA with triton installed, one Triton
        kernel does the forward and one the backward (angles in float32, no gradient for
        freqs); elsewhere (CPU, float64, freqs that need a gradient) this function's
        PyTorch code runs, which gives the same result.
    """
    if tensor_format not in _TENSOR_FORMATS:
        raise ValueError(f"tensor_format must be one of {_TENSOR_FORMATS}, got {tensor_format!r}")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, cp_size={cp_size}), got {cp_rank!r}")
    check_freqs(t, freqs)
    table = _table(freqs, t)
    max_len = table.shape[0]

    positions = None  # None: token s of every sequence sits at position s
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("cu_seqlens is required when tensor_format is 'thd'")
        if t.dim() != 3:
            raise ValueError(f"t must be [t, h, d] for thd, got {tuple(t.shape)}")
        if cp_size > 1:
            _check_cp_lengths(cu_seqlens, cp_size)
            cu_seqlens = cu_seqlens // cp_size
        positions = _token_positions(cu_seqlens, t.shape[0], start_positions, cp_size, cp_rank)
        _check_positions(positions, max_len, "a sequence is longer than")
    else:
        if t.dim() != 4:
            raise ValueError(f"t must be 4-D for {tensor_format}, got {tuple(t.shape)}")
        seqlen = t.shape[0 if tensor_format == "sbhd" else 1]
        if start_positions is None and cp_size == 1:
            if seqlen > max_len:
                raise ValueError(
                    f"sequence length {seqlen} exceeds the {max_len} positions in freqs"
                )
        else:
            pos = torch.arange(seqlen, device=table.device)
            if cp_size > 1:
                if seqlen % 2:
                    raise ValueError(f"t has {seqlen} tokens on this rank: context parallelism "
                                     f"needs an even number (2 of 2 * cp_size chunks)")
                pos = _cp_positions(seqlen, cp_size, cp_rank, pos)
            if start_positions is None:
                pos = pos.unsqueeze(0)  # [1, s]
            else:
                pos = _started(start_positions, pos, table.device)  # [b, s]
            _check_positions(pos, max_len, "start_positions + sequence length exceed")
            positions = pos
    return _rotate(t, freqs, table, positions, tensor_format, interleaved, fused)


def check_freqs(t: torch.Tensor, freqs: torch.Tensor) -> None:
    """freqs must be a ``[s, 1, 1, d2]`` table of an even number of channels, d2 <= t's."""
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"freqs must have shape [s, 1, 1, d], got {tuple(freqs.shape)}")
    rot_dim = freqs.shape[-1]
    if rot_dim > t.shape[-1]:
        raise ValueError(f"freqs has {rot_dim} channels but t has only {t.shape[-1]}")
    if rot_dim % 2:
        raise ValueError(f"freqs must have an even number of channels (pairs), got {rot_dim}")


def _table(freqs: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """freqs as ``[s, d2]`` in float32 at least (as TE), float64 for float64 t or freqs."""
    compute_dtype = torch.promote_types(torch.promote_types(freqs.dtype, t.dtype), torch.float32)
    return freqs.reshape(freqs.shape[0], freqs.shape[-1]).to(compute_dtype)


def _started(start_positions: torch.Tensor, pos: torch.Tensor, device) -> torch.Tensor:
    """``[b, s]``: each sequence's positions ``pos`` ``[s]`` shifted by its start."""
    return start_positions.to(device=device, dtype=torch.int64)[:, None] + pos


def step_positions(tensor_format: str, t: torch.Tensor, cu_seqlens: torch.Tensor,
                   start_positions: torch.Tensor) -> torch.Tensor:
    """The positions of t's tokens when sequence i starts at ``start_positions[i]`` (a KV
    cache step): int64 ``[b, s]`` for sbhd / bshd, ``[t]`` for thd (rows past
    ``cu_seqlens[-1]`` at 0). Not checked against a table: the caller knows the lengths."""
    if tensor_format == "thd":
        return _token_positions(cu_seqlens, t.shape[0], start_positions)
    seqlen = t.shape[0 if tensor_format == "sbhd" else 1]
    return _started(start_positions, torch.arange(seqlen, device=t.device), t.device)


def apply_rotary_pos_emb_at(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor,
                            tensor_format: str, interleaved: bool = False, fused: bool = False,
                            memo: Optional[dict] = None) -> torch.Tensor:
    """``apply_rotary_pos_emb`` at the given ``positions`` (``step_positions``'), which must
    lie inside freqs (checked by the caller, with ``check_freqs``). ``memo``: a dict that
    keeps the table and angles of (freqs, t's dtype, positions) for the next call with the
    same ones (q and k, the layers of one decode step), so that they are computed once."""
    key = ("rope", id(freqs), t.dtype, id(positions), tensor_format)
    hit = memo.get(key) if memo is not None else None
    if hit is None or hit[0] is not freqs or hit[1] is not positions:
        hit = (freqs, positions, _table(freqs, t), {})
        if memo is not None:
            memo[key] = hit
    table, angles = hit[2], hit[3]
    return _rotate(t, freqs, table, positions, tensor_format, interleaved, fused, angles)


def _rotate(t, freqs, table, positions, tensor_format, interleaved, fused, memo=None):
    """RoPE of t by ``table`` ``[max_len, d2]`` at ``positions`` (None: the index along s):
    the fused kernel where it applies, else in PyTorch (cos and sin kept in ``memo``, a
    dict, for the next call with the same table and positions)."""
    if fused and kernels.use_fused_rope(t, freqs):
        from ..kernels.rope import fused_rope

        return fused_rope(t, table, positions, tensor_format, interleaved)
    memo_key = ("cos, signed sin", interleaved)  # the sine's signs follow the pairing
    cos_sin = memo.get(memo_key) if memo is not None else None
    if cos_sin is None:
        angles = _angles(table, positions, tensor_format, t.shape)
        cos_sin = (torch.cos(angles).to(t.dtype),
                   _negate_first(torch.sin(angles).to(t.dtype), interleaved))
        if memo is not None:
            memo[memo_key] = cos_sin
    cos, sin = cos_sin
    rot_dim = table.shape[-1]
    if rot_dim == t.shape[-1]:  # every channel rotates (no slices to make)
        return t * cos + _swap_pairs(t, interleaved) * sin
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t_rot = t_rot * cos + _swap_pairs(t_rot, interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1)


def _angles(table: torch.Tensor, positions: Optional[torch.Tensor], tensor_format: str,
            shape) -> torch.Tensor:
    """The angles of every token, shaped to broadcast against t: [t, 1, d2] (thd),
    [s, b|1, 1, d2] (sbhd), [b|1, s, 1, d2] (bshd)."""
    if tensor_format == "thd":
        return table[positions].unsqueeze(1)
    if positions is None:
        seqlen = shape[0 if tensor_format == "sbhd" else 1]
        angles = table[:seqlen, None, None, :]  # [s, 1, 1, d2]
        return angles.transpose(0, 1) if tensor_format == "bshd" else angles
    angles = table[positions].unsqueeze(2)  # [b|1, s, 1, d2]
    return angles.transpose(0, 1) if tensor_format == "sbhd" else angles
