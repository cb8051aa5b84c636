"""The delayed-scaling update of transformer_fa/fp8.py (``update_amax_history``) in one launch.

For each column of an amax history [history_len, n] and its scale [n]: the amax from the
history ("max", NaN propagating as ``torch.max``, or "most_recent": row 0), the new scale
``(fp8_max / amax) / 2**margin`` (IEEE divisions, as the PyTorch path's), the old scale where
the amax is not positive and finite, float32's max where the quotient overflows; then the
history rolled up by one row (``torch.roll(history, -1, 0)``: row 0 goes last) with row 0
cleared for the next step's amaxes. Strided views (a column of a history, a slice of the
scales) are updated in place.
"""
import functools
import weakref
from typing import Dict, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .fp8_scale_math import NO_FLUSH_TO_ZERO, scale_from_amax


@triton.jit
def _update_columns(HISTORY, SCALE, col_block, n_rows, n_cols, stride_r, stride_c, stride_s,
                    fp8_max, margin_divisor, MOST_RECENT: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """The update of one block of BLOCK_C columns of one history and its scales."""
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    columns = HISTORY + cols * stride_c
    newest = tl.load(columns, mask=col_mask, other=0.0)  # row 0: goes to the last row
    if MOST_RECENT:
        amax = newest
    else:
        amax = tl.full([BLOCK_C], float("-inf"), tl.float32)
        nans = tl.zeros([BLOCK_C], tl.int32)
        for start in range(0, n_rows, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            mask = (rows < n_rows)[:, None] & col_mask[None, :]
            h = tl.load(columns[None, :] + rows[:, None] * stride_r, mask=mask,
                        other=float("-inf"))
            amax = tl.maximum(amax, tl.max(h, axis=0))
            nans += tl.sum((h != h).to(tl.int32), axis=0)
        amax = tl.where(nans > 0, float("nan"), amax)
    old = tl.load(SCALE + cols * stride_s, mask=col_mask, other=1.0)
    new = scale_from_amax(amax, old, fp8_max, margin_divisor)
    tl.store(SCALE + cols * stride_s, new, mask=col_mask)
    # Roll: row r takes row r + 1. A block's rows are read by other warps than write them,
    # so each block's reads finish (barrier) before its writes; the next block reads only
    # rows below this one's writes.
    for start in range(0, n_rows, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        below = (rows + 1 < n_rows)[:, None] & col_mask[None, :]
        h = tl.load(columns[None, :] + (rows + 1)[:, None] * stride_r, mask=below, other=0.0)
        tl.debug_barrier()
        h = tl.where((rows == n_rows - 1)[:, None], newest[None, :], h)
        h = tl.where((rows == 0)[:, None], 0.0, h)
        tl.store(columns[None, :] + rows[:, None] * stride_r, h,
                 mask=(rows < n_rows)[:, None] & col_mask[None, :])


@triton.jit
def _update_kernel(HISTORY, SCALE, n_rows, n_cols, stride_r, stride_c, stride_s, fp8_max,
                   margin_divisor, MOST_RECENT: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    _update_columns(HISTORY, SCALE, tl.program_id(0), n_rows, n_cols, stride_r, stride_c,
                    stride_s, fp8_max, margin_divisor, MOST_RECENT, BLOCK_R, BLOCK_C)


# A group's table: one int64 row per (history, scale) pair, these columns
_HISTORY, _SCALE, _N_COLS, _STRIDE_R, _STRIDE_C, _STRIDE_S, _TABLE_WIDTH = (
    tl.constexpr(i) for i in range(7))


@triton.jit
def _update_group_kernel(TABLE, n_rows, fp8_max, margin_divisor, MOST_RECENT: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (c, p): column block c of pair p (a block past the pair's width does nothing)."""
    entry = TABLE + tl.program_id(1) * _TABLE_WIDTH
    n_cols = tl.load(entry + _N_COLS)
    if tl.program_id(0) * BLOCK_C < n_cols:
        history = tl.load(entry + _HISTORY).to(tl.pointer_type(tl.float32))
        scale = tl.load(entry + _SCALE).to(tl.pointer_type(tl.float32))
        _update_columns(history, scale, tl.program_id(0), n_rows, n_cols,
                        tl.load(entry + _STRIDE_R), tl.load(entry + _STRIDE_C),
                        tl.load(entry + _STRIDE_S), fp8_max, margin_divisor, MOST_RECENT,
                        BLOCK_R, BLOCK_C)


# elements a program holds per block of rows; a history of TE's default length (1024) and a
# module's few columns take one block
_BLOCK_ELEMENTS = 4096
_MAX_BLOCK_COLS = 16


def _check(history: torch.Tensor, scale: torch.Tensor, caller: str) -> None:
    if (history.dim() != 2 or scale.shape != history.shape[1:]
            or history.dtype != torch.float32 or scale.dtype != torch.float32
            or scale.device != history.device):
        raise ValueError(f"{caller}: history must be a float32 [history_len, n] "
                         f"tensor and scale a float32 [n] tensor on its device, got "
                         f"{history.dtype} {list(history.shape)} on {history.device} and "
                         f"{scale.dtype} {list(scale.shape)} on {scale.device}")


def _blocks(n_rows: int, n_cols: int) -> Tuple[int, int]:
    """(BLOCK_R, BLOCK_C) for histories of n_rows rows and up to n_cols columns."""
    block_c = min(triton.next_power_of_2(n_cols), _MAX_BLOCK_COLS)
    return min(triton.next_power_of_2(n_rows), _BLOCK_ELEMENTS // block_c), block_c


def update_delayed_scaling(history: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                           margin: int, most_recent: bool) -> None:
    """In place: ``scale`` [n] from the float32 amax ``history`` [history_len, n], the
    history rolled with row 0 cleared (fp8.update_amax_history's built-in algorithms)."""
    _check(history, scale, "update_delayed_scaling")
    n_rows, n_cols = history.shape
    if n_rows == 0 or n_cols == 0:
        return
    block_r, block_c = _blocks(n_rows, n_cols)
    _update_kernel[(triton.cdiv(n_cols, block_c),)](
        history, scale, n_rows, n_cols, history.stride(0), history.stride(1), scale.stride(0),
        fp8_max, 2.0 ** margin, MOST_RECENT=most_recent, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=4, **NO_FLUSH_TO_ZERO)


class _Table:
    """A group's device table and the widest history's width. It lives while all its tensors
    do (weak references drop it from the cache when one dies: their ids, the cache key, stay
    unique while it lives); a CUDA graph that captured a launch reads it on every replay."""

    def __init__(self, key, pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        rows = []
        for history, scale in pairs:
            rows += [history.data_ptr(), scale.data_ptr(), history.shape[1], history.stride(0),
                     history.stride(1), scale.stride(0)]
        device = pairs[0][0].device
        # a non-blocking copy from pinned memory: no sync (the host allocator keeps the pinned
        # block until the copy is done)
        host = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.table = host.to(device, non_blocking=True)
        self.max_cols = max(history.shape[1] for history, _ in pairs)
        forget = functools.partial(_forget, key)
        self._refs = [weakref.ref(t, forget) for pair in pairs for t in pair]


_TABLES: Dict[tuple, _Table] = {}


def _forget(key, _ref) -> None:
    _TABLES.pop(key, None)


def _cached_table(pairs) -> Optional[_Table]:
    """The pairs' table, built once (the same modules' state every step); None while a CUDA
    graph is being captured and the table was not built before (no host copies there)."""
    key = tuple(id(t) for pair in pairs for t in pair)
    table = _TABLES.get(key)
    if table is None:
        for history, scale in pairs:
            _check(history, scale, "update_delayed_scalings")
        if len({history.shape[0] for history, _ in pairs}) != 1 or len(
                {history.device for history, _ in pairs}) != 1:
            raise ValueError("update_delayed_scalings: the histories must have one length and "
                             "one device, got " + ", ".join(
                                 f"{list(h.shape)} on {h.device}" for h, _ in pairs))
        if pairs[0][0].is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        table = _TABLES[key] = _Table(key, pairs)
    return table


def update_delayed_scalings(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], fp8_max: float,
                            margin: int, most_recent: bool) -> None:
    """update_delayed_scaling for each (history, scale) of ``pairs`` (histories of one length,
    on one device), in one launch: program (c, p) updates column block c of pair p."""
    table = _cached_table(pairs) if len(pairs) > 1 else None
    if table is None:  # one pair, or capturing: launches that need no table
        for history, scale in pairs:
            update_delayed_scaling(history, scale, fp8_max, margin, most_recent)
        return
    n_rows = pairs[0][0].shape[0]
    if n_rows == 0 or table.max_cols == 0:
        return
    block_r, block_c = _blocks(n_rows, table.max_cols)
    _update_group_kernel[(triton.cdiv(table.max_cols, block_c), len(pairs))](
        table.table, n_rows, fp8_max, 2.0 ** margin, MOST_RECENT=most_recent, BLOCK_R=block_r,
        BLOCK_C=block_c, num_warps=4, **NO_FLUSH_TO_ZERO)
