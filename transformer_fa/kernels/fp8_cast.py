"""The FP8 casts of the FP8 GEMMs (transformer_fa/fp8.py) in Triton, and where the flash
extension has them for the GPU, on CUDA kernels (csrc/fp8/): ``cast`` hands a 16-bit cast
with a transposed output to the CUDA cast-transpose kernel and ``fold_amax`` a 16-bit amax
pass to its amax kernel (rows a multiple of 16, columns of 8; the same results, tested
against each other in tests/gpu/test_fp8_gpu.py); the rest below is the Triton kernel's.
``TRANSFORMER_FA_FP8_CAST=triton`` keeps everything on Triton.

One kernel reads a 2D tensor once, tile by tile, and writes ``fp8(clamp(x * scale))`` in the
orientations the GEMMs ask for: row-major and/or transposed (``torch._scaled_mm`` wants its
first operand row-major and its second column-major, so the backward's GEMMs need the
transposes). It can fold ``max|x|`` into a float32 amax slot on the way (delayed scaling);
with no output asked it is the amax pass of current scaling. The scale is read on the device
(current scaling: computed from the amax pass's result in each program), and program (0, 0)
writes the inverse scale torch._scaled_mm takes: no host sync and no scalar ops around the
cast, so the casts can be captured in CUDA graphs.

The results are the PyTorch path's (fp8.py's ``_quantize``) bit for bit: the same float32
product and clamp, and a round-to-nearest-even conversion (the GPU's ``cvt.rn``); NaNs stay
NaN; the scale from an amax and the inverse scale with correctly rounded divisions. The amax
is taken on the float bits: for non-negative floats the integer order is the float order,
with NaN above inf, so a NaN propagates into the amax as in ``torch.amax``, and the integer
atomic max is exact.

It can also give the column sums of x (``dbias``: a Linear's bias gradient from its output
gradient, which the backward casts anyway), as TE's cast+transpose+dbias does, without atomics
so that the sums are deterministic: each row block writes its float32 column sums into a
workspace, and a small second kernel adds the row blocks (in a fixed order) and rounds once to
x's dtype. With dbias alone (no FP8 output) the kernel still records the amax and writes the
inverse scale.

With ``gelu`` the kernel applies tanh GELU (in float32, kernels/bias_grad.py's form) to the
loaded values first, as TE's activation casts do: the FP8 GEMM after an MLP's GELU reads the GELU's input h
and writes ``fp8(gelu(h))`` (its amax, for delayed scaling; the amax pass of current scaling
takes the same option), so ``gelu(h)`` in 16 bits is never written. The FP8 values are those
of the float32 GELU: torch's unfused path rounds gelu(h) to x's dtype before the cast, which
can move an FP8 value by one step where that rounding crosses an FP8 rounding boundary.
With a ``dgelu_input`` h (the backward of that GELU) it casts ``dgelu(x, h) = x * gelu'(h)``
instead (tanh GELU's derivative in float32, kernels/bias_grad.py's form), and sums those
float32 values into the column sums: the gradient cast of the GEMM before the GELU reads the
GELU's output gradient and input, and dh in 16 bits is never written (TE's dgelu cast).
"""
import functools
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from . import KERNEL_DTYPES
from .bias_grad import gelu_tanh, gelu_tanh_grad
from .fp8_scale_math import NO_FLUSH_TO_ZERO, div_rn, scale_from_amax


@triton.jit
def _cast_kernel(X, H, OUT, OUT_T, SCALE, SCALE_INV, AMAX_BITS, COL_SUMS, n_rows, n_cols,
                 stride_r, stride_c, stride_hr, stride_hc, fp8_max, ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr,
                 SCALE_FROM_AMAX: tl.constexpr, WRITE_SCALE_INV: tl.constexpr,
                 RECORD_AMAX: tl.constexpr, DBIAS: tl.constexpr, GELU: tl.constexpr,
                 DGELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # 64-bit offsets: rows * cols may pass 2**31
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask,
                other=0.0).to(tl.float32)
    if GELU:
        x = gelu_tanh(x)  # gelu(0) = 0 in the masked lanes
    if DGELU:
        h = tl.load(H + rows[:, None] * stride_hr + cols[None, :] * stride_hc, mask=mask,
                    other=0.0).to(tl.float32)
        x = gelu_tanh_grad(x, h)  # 0 in the masked lanes (x = 0 there)
    if RECORD_AMAX:
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |x|, masked lanes are 0
        tl.atomic_max(AMAX_BITS, tl.max(tl.max(bits, axis=1), axis=0))
    if DBIAS:
        # this row block's float32 column sums of x (masked lanes are 0): row program_id(0)
        # of the [row blocks, n_cols] workspace
        tl.store(COL_SUMS + tl.program_id(0).to(tl.int64) * n_cols + cols, tl.sum(x, axis=0),
                 mask=cols < n_cols)
    if ROWWISE or COLUMNWISE or WRITE_SCALE_INV:
        # the scalars as one-element blocks (the division helper takes blocks)
        one = tl.arange(0, 1)
        scale = tl.load(SCALE + one)
        if SCALE_FROM_AMAX:
            # SCALE holds x's amax: every program computes the same scale from it
            # (compute_scale(amax, 1, fp8_max), no margin)
            scale = scale_from_amax(scale, 1.0, fp8_max, 1.0)
        if WRITE_SCALE_INV:
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.store(SCALE_INV + one, div_rn(tl.full([1], 1.0, tl.float32), scale))
        if ROWWISE or COLUMNWISE:
            scaled = tl.clamp(x * scale[:, None], -fp8_max, fp8_max,
                              propagate_nan=tl.PropagateNan.ALL)
            q = scaled.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne")
            if ROWWISE:
                tl.store(OUT + rows[:, None] * n_cols + cols[None, :], q, mask=mask)
            if COLUMNWISE:
                tl.store(OUT_T + cols[None, :] * n_rows + rows[:, None], q, mask=mask)


@triton.jit
def _sum_row_blocks_kernel(COL_SUMS, OUT, n_blocks, n_cols, BLOCK_B: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    """OUT = the workspace's column sums over its rows in float32, rounded once to OUT's
    dtype. BLOCK_B rows per step, so that many loads are in flight (one row per step waits
    out a load latency per row block)."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_range = cols < n_cols
    total = tl.zeros([BLOCK_C], tl.float32)
    for start in range(0, n_blocks, BLOCK_B):
        blocks = (start + tl.arange(0, BLOCK_B)).to(tl.int64)
        mask = (blocks < n_blocks)[:, None] & in_range[None, :]
        step = tl.load(COL_SUMS + blocks[:, None] * n_cols + cols[None, :], mask=mask,
                       other=0.0)
        total += tl.sum(step, axis=0)
    tl.store(OUT + cols, total.to(OUT.dtype.element_ty), mask=in_range)


# Tiles: (BLOCK_R, BLOCK_C, num_warps). Row-major output alone: wide row strips. Where a
# transpose is written, or the column sums, the tile depends on the kind of call: ptxas lands
# each kernel variant on its own register count, and the time follows that count more than
# the tile (53-71 registers ran fast, 37-40 and ~95 slow). The choices below are the best
# summed over one FP8 layer step's calls of each kind (benchmarks/bench_fp8_cast.py, H200,
# 2026-11-28, us per layer; re-measure when the kernel's math changes):
# - plain casts, both orientations: 32 x 128 (delayed 182, current 125) against the former
#   128 x 64 (197, 143);
# - gradient casts with the column sums: delayed scaling 64 x 64 (166 against 180 at
#   128 x 64), current scaling 64 x 64 with 2 warps (130 against 165);
# - GELU / dgelu casts: 64 x 64 (fewer float32 values per thread alive through the math),
#   the dgelu's row-major pass too (delayed 105 against 108 on the row strips, current 113
#   against 139).
# Inside the layer step (benchmarks/profile_layer.py, two runs each, the casts' kernel time
# per 8-layer step) these tiles against the former ones: current scaling 7.25 -> 6.98 ms,
# delayed scaling 5.20 -> 5.22 (no change: there the inputs often come hot from L2).
_ROW_TILE = (16, 512, 8)
_TRANSPOSE_TILE = (32, 128, 4)
_ACTIVATION_TILE = (64, 64, 4)
_COLUMN_SUMS_TILE = {False: (64, 64, 4), True: (64, 64, 2)}  # by scale_from_amax
_CUDA_TILE_ROWS = 64  # the CUDA kernel's kCastTileRows (checked: tests/test_kernel_build.py)


def _tile(columnwise: bool, dbias: bool, activation: bool, from_amax: bool):
    """The tile of one cast launch (see above)."""
    if activation:
        return _ACTIVATION_TILE
    if dbias:
        return _COLUMN_SUMS_TILE[from_amax]
    return _TRANSPOSE_TILE if columnwise else _ROW_TILE


# the second pass: (BLOCK_B, BLOCK_C, num_warps); one step covers 64 row blocks (8192 rows)
_SUM_TILE = (64, 64, 4)


def _check_scalar(x: torch.Tensor, scalar: torch.Tensor, name: str) -> None:
    if scalar.dtype != torch.float32 or scalar.numel() != 1 or scalar.device != x.device:
        raise ValueError(f"{name} must be a one-element float32 tensor on {x.device}, got "
                         f"{scalar.dtype} {list(scalar.shape)} on {scalar.device}")


def _launch(x, out, out_t, scale, scale_from_amax, scale_inv, amax, fp8_max, tile,
            dbias: bool = False, gelu: bool = False,
            dgelu_input: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """One cast kernel (of gelu(x) with ``gelu``, of dgelu(x, h) with a ``dgelu_input`` h);
    with ``dbias`` it returns its workspace of column sums, float32 [row blocks, n_cols]."""
    block_r, block_c, num_warps = tile
    rowwise = out is not None
    n_rows, n_cols = x.shape
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(n_cols, block_c))
    col_sums = (torch.empty((grid[0], n_cols), dtype=torch.float32, device=x.device)
                if dbias else None)
    # pointers a variant does not use get a stand-in (the constexprs keep them unused); OUT
    # is always an FP8 output where there is one, as the kernel converts to OUT's dtype
    out = out_t if out is None else out
    h = x if dgelu_input is None else dgelu_input
    _cast_kernel[grid](
        x, h, x if out is None else out, x if out_t is None else out_t,
        x if scale is None else scale, x if scale_inv is None else scale_inv,
        x if amax is None else amax.view(torch.int32), x if col_sums is None else col_sums,
        n_rows, n_cols, x.stride(0), x.stride(1), h.stride(0), h.stride(1), fp8_max,
        ROWWISE=rowwise, COLUMNWISE=out_t is not None, SCALE_FROM_AMAX=scale_from_amax,
        WRITE_SCALE_INV=scale_inv is not None, RECORD_AMAX=amax is not None, DBIAS=dbias,
        GELU=gelu, DGELU=dgelu_input is not None, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps, **NO_FLUSH_TO_ZERO)
    return col_sums


def _sum_row_blocks(col_sums: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The workspace's column sums over its row blocks, in ``dtype``."""
    n_blocks, n_cols = col_sums.shape
    block_b, block_c, num_warps = _SUM_TILE
    out = torch.empty(n_cols, dtype=dtype, device=col_sums.device)
    _sum_row_blocks_kernel[(triton.cdiv(n_cols, block_c),)](
        col_sums, out, n_blocks, n_cols, BLOCK_B=block_b, BLOCK_C=block_c,
        num_warps=num_warps)
    return out


_CUDA_DTYPES = (torch.bfloat16, torch.float16)


def _cuda_cast_transpose(x: torch.Tensor, h: Optional[torch.Tensor], columnwise: bool,
                         fp8_dtype: torch.dtype, fp8_max: float):
    """The CUDA cast-transpose kernel (csrc/fp8/cast_transpose.cu, in the flash extension)
    where it serves the call, else None (the Triton kernel does): a cast into the transposed
    orientation (with or without the row-major one) with the FP8 format's own largest value,
    of an input _cuda_fp8_kernel takes. Triton converts the transposed tile as FP8 bytes
    through shared memory; the CUDA kernel packs eight rows' bytes of a column into one
    8-byte word first."""
    if not columnwise or fp8_max != torch.finfo(fp8_dtype).max:
        return None
    return _cuda_fp8_kernel("fp8_cast_transpose", x, h)


def _cuda_fp8_kernel(name: str, x: torch.Tensor, h: Optional[torch.Tensor]):
    """The extension's FP8 kernel ``name`` (fp8_cast_transpose, fp8_amax) for this input, or
    None: it serves 16-bit x (and dgelu's h) with rows a multiple of 16 and columns of 8, unit
    column strides and 16-byte aligned rows, on the GPUs it was built for.
    TRANSFORMER_FA_FP8_CAST=triton keeps every cast and amax pass on the Triton kernel (A/B
    runs, tests)."""
    if os.environ.get("TRANSFORMER_FA_FP8_CAST", "") == "triton":
        return None
    if x.dtype not in _CUDA_DTYPES or not x.is_cuda:
        return None
    rows, cols = x.shape
    if rows % 16 or cols % 8 or cols // 128 >= 65535:
        return None
    for t in (x,) if h is None else (x, h):
        if t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
            return None
    return _cuda_fp8_kernels(x.device.index).get(name)


@functools.lru_cache(maxsize=None)
def _cuda_fp8_kernels(device_index: int) -> dict:
    """{name: function} of the extension's FP8 kernels if it was built for this GPU, else {}
    (once per device: the casts are on the eager FP8 step's host path)."""
    from ..attention.backends import flash  # the extension's loader (lazy: no import cycle)
    ext = flash._extension() if flash.is_built() else None
    if ext is None or not hasattr(ext, "fp8_cast_transpose"):
        return {}
    major, minor = torch.cuda.get_device_capability(device_index)
    if 10 * major + minor not in ext.FP8_CAST_ARCHS:
        return {}
    return {"fp8_cast_transpose": ext.fp8_cast_transpose, "fp8_amax": ext.fp8_amax}


def cast(x: torch.Tensor, scale: Optional[torch.Tensor], fp8_dtype: torch.dtype,
         fp8_max: float, rowwise: bool = True, columnwise: bool = False,
         amax: Optional[torch.Tensor] = None, scale_from_amax: Optional[torch.Tensor] = None,
         dbias: bool = False, gelu: bool = False, dgelu_input: Optional[torch.Tensor] = None
         ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor,
                    Optional[torch.Tensor]]:
    """(row-major [M, N] or None, transposed [N, M] or None, inverse scale, column sums [N] or
    None): ``fp8(clamp(x * scale))`` of the 2D ``x``, in one read, ``1 / scale`` as a 0-dim
    float32 tensor, and with ``dbias`` ``x.sum(0)`` in x's dtype (summed in float32, in a
    fixed order: the same bits on every run).
    ``scale``: a float32 device scalar; or None and ``scale_from_amax``, x's amax (current
    scaling; fold_amax's): the kernel casts with ``fp8.compute_scale(amax, 1, fp8_max)``.
    ``amax``: a one-element float32 slot (e.g. ``history[0, i:i + 1]``) that gets
    ``max(amax, max|x|)`` in place.
    ``gelu``: all of the above of ``gelu(x)`` (tanh GELU in float32) instead of x, except the
    column sums (a gradient's; its cast takes no activation).
    ``dgelu_input``: GELU's input h (x's shape) where x is the gradient of gelu(h): all of the
    above of ``dgelu(x, h) = x * gelu'(h)`` in float32, the column sums too (summed before
    any rounding, rounded once to x's dtype)."""
    if gelu and dbias:
        raise ValueError("cast: gelu=True casts an activation, dbias=True sums a gradient; "
                         "not both")
    _check_dgelu_input(x, gelu, dgelu_input)
    if not (rowwise or columnwise or dbias):
        raise ValueError("cast: ask for rowwise and/or columnwise output, or dbias "
                         "(fold_amax gives the amax alone)")
    if (scale is None) == (scale_from_amax is None):
        raise ValueError("cast: give either scale or scale_from_amax (the amax of x), "
                         "not both or neither")
    source = scale if scale_from_amax is None else scale_from_amax
    _check_scalar(x, source, "scale" if scale_from_amax is None else "scale_from_amax")
    if amax is not None:
        _check_scalar(x, amax, "amax")
    from_amax = scale_from_amax is not None
    n_rows, n_cols = x.shape
    out = out_t = None
    if rowwise:
        out = torch.empty((n_rows, n_cols), dtype=fp8_dtype, device=x.device)
    if columnwise:
        out_t = torch.empty((n_cols, n_rows), dtype=fp8_dtype, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    activation = gelu or dgelu_input is not None
    kernel = _cuda_cast_transpose(x, dgelu_input, columnwise, fp8_dtype, fp8_max)
    if kernel is not None:
        col_sums = (torch.empty((triton.cdiv(n_rows, _CUDA_TILE_ROWS), n_cols),
                                dtype=torch.float32, device=x.device) if dbias else None)
        kernel(x, dgelu_input, out, out_t, source, from_amax, fp8_max, scale_inv, amax,
               col_sums, gelu)
    elif rowwise and columnwise and (x.dtype == torch.float32 or dgelu_input is not None):
        # Both stores in one kernel gave wrong transposed bytes (NaNs among them) from float32
        # inputs and from the dgelu cast of 16-bit ones (Triton 3.6, sm90; the other 16-bit
        # casts are right): two passes there, the column sums in the second.
        _launch(x, out, None, source, from_amax, scale_inv, amax, fp8_max,
                _tile(False, False, activation, from_amax), gelu=gelu, dgelu_input=dgelu_input)
        col_sums = _launch(x, None, out_t, source, from_amax, None, None, fp8_max,
                           _tile(True, dbias, activation, from_amax), dbias=dbias, gelu=gelu,
                           dgelu_input=dgelu_input)
    else:
        col_sums = _launch(x, out, out_t, source, from_amax, scale_inv, amax, fp8_max,
                           _tile(columnwise, dbias, activation, from_amax), dbias=dbias,
                           gelu=gelu, dgelu_input=dgelu_input)
    return out, out_t, scale_inv, _sum_row_blocks(col_sums, x.dtype) if dbias else None


def _check_dgelu_input(x: torch.Tensor, gelu: bool, h: Optional[torch.Tensor]) -> None:
    if h is None:
        return
    if gelu:
        raise ValueError("cast: gelu=True casts GELU's output, dgelu_input its gradient; "
                         "not both")
    if h.shape != x.shape or h.device != x.device or h.dtype not in KERNEL_DTYPES:
        raise ValueError(f"dgelu_input must be a float32, bfloat16 or float16 tensor of x's "
                         f"shape {list(x.shape)} on {x.device}, got {h.dtype} "
                         f"{list(h.shape)} on {h.device}")


def fold_amax(x: torch.Tensor, amax: torch.Tensor, gelu: bool = False,
              dgelu_input: Optional[torch.Tensor] = None) -> None:
    """``amax = max(amax, max|x|)`` (with ``gelu``: ``max|gelu(x)|``; with a ``dgelu_input``
    h: ``max|dgelu(x, h)|``) in place, for the 2D ``x`` and a one-element float32 ``amax``:
    the one read pass of current scaling (and of calibration)."""
    _check_scalar(x, amax, "amax")
    _check_dgelu_input(x, gelu, dgelu_input)
    kernel = _cuda_fp8_kernel("fp8_amax", x, dgelu_input)
    if kernel is not None:  # the CUDA kernel where it serves the input (as the casts')
        kernel(x, dgelu_input, amax, gelu)
        return
    _launch(x, None, None, None, False, None, amax, 0.0, _ROW_TILE, gelu=gelu,
            dgelu_input=dgelu_input)
