"""The FP8 casts of the FP8 GEMMs (transformer_fa/fp8.py) in Triton.

One kernel reads a 2D tensor once, tile by tile, and writes ``fp8(clamp(x * scale))`` in the
orientations the GEMMs ask for: row-major and/or transposed (``torch._scaled_mm`` wants its
first operand row-major and its second column-major, so the backward's GEMMs need the
transposes). It can fold ``max|x|`` into a float32 amax slot on the way (delayed scaling);
with no output asked it is the amax pass of current scaling. The scale is read on the device:
no host sync, so the casts can be captured in CUDA graphs.

The results are the PyTorch path's (fp8.py's ``_quantize``) bit for bit: the same float32
product and clamp, and a round-to-nearest-even conversion (the GPU's ``cvt.rn``); NaNs stay
NaN. The amax is taken on the float bits: for non-negative floats the integer order is the
float order, with NaN above inf, so a NaN propagates into the amax as in ``torch.amax``, and
the integer atomic max is exact.
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def _cast_kernel(X, OUT, OUT_T, SCALE, AMAX_BITS, n_rows, n_cols, stride_r, stride_c,
                 fp8_max, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
                 RECORD_AMAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # 64-bit offsets: rows * cols may pass 2**31
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask,
                other=0.0).to(tl.float32)
    if RECORD_AMAX:
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |x|, masked lanes are 0
        tl.atomic_max(AMAX_BITS, tl.max(tl.max(bits, axis=1), axis=0))
    if ROWWISE or COLUMNWISE:
        scale = tl.load(SCALE)
        scaled = tl.clamp(x * scale, -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)
        q = scaled.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne")
        if ROWWISE:
            tl.store(OUT + rows[:, None] * n_cols + cols[None, :], q, mask=mask)
        if COLUMNWISE:
            tl.store(OUT_T + cols[None, :] * n_rows + rows[:, None], q, mask=mask)


# (BLOCK_R, BLOCK_C, num_warps): square tiles where a transpose is written (each tile's rows
# and columns both make full 128-byte lines of FP8), wide row strips otherwise
_TRANSPOSE_TILE = (128, 128, 8)
_ROW_TILE = (16, 512, 8)


def _check_amax_slot(x: torch.Tensor, amax: torch.Tensor) -> None:
    if amax.dtype != torch.float32 or amax.numel() != 1 or amax.device != x.device:
        raise ValueError(f"amax must be a one-element float32 tensor on {x.device}, got "
                         f"{amax.dtype} {list(amax.shape)} on {amax.device}")


def _launch(x, out, out_t, scale, amax, fp8_max, tile) -> None:
    block_r, block_c, num_warps = tile
    rowwise = out is not None
    n_rows, n_cols = x.shape
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    # pointers a variant does not use get a stand-in (the constexprs keep them unused); OUT
    # is always an FP8 output where there is one, as the kernel converts to OUT's dtype
    out = out_t if out is None else out
    _cast_kernel[grid](
        x, x if out is None else out, x if out_t is None else out_t,
        x if scale is None else scale, x if amax is None else amax.view(torch.int32),
        n_rows, n_cols, x.stride(0), x.stride(1), fp8_max,
        ROWWISE=rowwise, COLUMNWISE=out_t is not None,
        RECORD_AMAX=amax is not None,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps)


def cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float,
         rowwise: bool = True, columnwise: bool = False,
         amax: Optional[torch.Tensor] = None
         ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(row-major [M, N] or None, transposed [N, M] or None): ``fp8(clamp(x * scale))`` of the
    2D ``x``, in one read. ``scale``: a float32 device scalar. ``amax``: a one-element float32
    slot (e.g. ``history[0, i:i + 1]``) that gets ``max(amax, max|x|)`` in place."""
    if not (rowwise or columnwise):
        raise ValueError("cast: ask for rowwise and/or columnwise output (fold_amax gives "
                         "the amax alone)")
    if amax is not None:
        _check_amax_slot(x, amax)
    n_rows, n_cols = x.shape
    out = out_t = None
    if rowwise:
        out = torch.empty((n_rows, n_cols), dtype=fp8_dtype, device=x.device)
    if columnwise:
        out_t = torch.empty((n_cols, n_rows), dtype=fp8_dtype, device=x.device)
    if x.dtype == torch.float32 and rowwise and columnwise:
        # Both stores in one kernel gave wrong bytes from float32 inputs (Triton 3.6, sm90;
        # bfloat16 and float16 inputs are right): two passes for float32.
        _launch(x, out, None, scale, amax, fp8_max, _ROW_TILE)
        _launch(x, None, out_t, scale, None, fp8_max, _TRANSPOSE_TILE)
    else:
        _launch(x, out, out_t, scale, amax, fp8_max,
                _TRANSPOSE_TILE if columnwise else _ROW_TILE)
    return out, out_t


def fold_amax(x: torch.Tensor, amax: torch.Tensor) -> None:
    """``amax = max(amax, max|x|)`` in place, for the 2D ``x`` and a one-element float32
    ``amax``: the one read pass of current scaling (and of calibration)."""
    _check_amax_slot(x, amax)
    _launch(x, None, None, None, amax, 0.0, _ROW_TILE)
