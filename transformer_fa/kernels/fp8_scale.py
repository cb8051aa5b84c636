"""The delayed-scaling update of transformer_fa/fp8.py (``update_amax_history``) in one launch.

For each column of an amax history [history_len, n] and its scale [n]: the amax from the
history ("max", NaN propagating as ``torch.max``, or "most_recent": row 0), the new scale
``(fp8_max / amax) / 2**margin`` (IEEE divisions, as the PyTorch path's), the old scale where
the amax is not positive and finite, float32's max where the quotient overflows; then the
history rolled up by one row (``torch.roll(history, -1, 0)``: row 0 goes last) with row 0
cleared for the next step's amaxes. Strided views (a column of a history, a slice of the
scales) are updated in place.
"""
import torch
import triton
import triton.language as tl

from .fp8_scale_math import NO_FLUSH_TO_ZERO, scale_from_amax


@triton.jit
def _update_kernel(HISTORY, SCALE, n_rows, n_cols, stride_r, stride_c, stride_s, fp8_max,
                   margin_divisor, MOST_RECENT: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
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


# elements a program holds per block of rows; a history of TE's default length (1024) and a
# module's few columns take one block
_BLOCK_ELEMENTS = 4096
_MAX_BLOCK_COLS = 16


def update_delayed_scaling(history: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                           margin: int, most_recent: bool) -> None:
    """In place: ``scale`` [n] from the float32 amax ``history`` [history_len, n], the
    history rolled with row 0 cleared (fp8.update_amax_history's built-in algorithms)."""
    if (history.dim() != 2 or scale.shape != history.shape[1:]
            or history.dtype != torch.float32 or scale.dtype != torch.float32
            or scale.device != history.device):
        raise ValueError(f"update_delayed_scaling: history must be a float32 [history_len, n] "
                         f"tensor and scale a float32 [n] tensor on its device, got "
                         f"{history.dtype} {list(history.shape)} on {history.device} and "
                         f"{scale.dtype} {list(scale.shape)} on {scale.device}")
    n_rows, n_cols = history.shape
    if n_rows == 0 or n_cols == 0:
        return
    block_c = min(triton.next_power_of_2(n_cols), _MAX_BLOCK_COLS)
    block_r = min(triton.next_power_of_2(n_rows), _BLOCK_ELEMENTS // block_c)
    _update_kernel[(triton.cdiv(n_cols, block_c),)](
        history, scale, n_rows, n_cols, history.stride(0), history.stride(1), scale.stride(0),
        fp8_max, 2.0 ** margin, MOST_RECENT=most_recent, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=4, **NO_FLUSH_TO_ZERO)
