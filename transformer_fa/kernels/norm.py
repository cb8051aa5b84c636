"""Fused LayerNorm and RMSNorm (forward and backward) in Triton.

Both kernels work on tiles of ``BLOCK_M`` whole rows (``[BLOCK_M, BLOCK_N]``, ``BLOCK_N`` the
row width rounded up to a power of two), in float32. The forward's programs take one tile
each, normalize its rows and save each row's mean (LayerNorm) and rstd for the backward,
which then needs no second pass over the statistics. The backward's programs each take a
contiguous chunk of rows, a tile at a time, write dx and keep their share of dgamma/dbeta in
float32 registers; each program writes its partial sums to its own row of a buffer that is
summed at the end in a fixed order by bias_grad's second pass (no atomics: the same bits
every run for a given shape and GPU).
"""
import functools

import torch
import triton
import triton.language as tl

from .bias_grad import sum_partial_rows


@triton.jit
def _tile(row_start, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row indices (int64: rows * cols may pass 2**31), column indices, the element offsets
    of the tile's rows and the masks of rows, columns and elements (the last tile ragged)."""
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    offsets = rows[:, None] * n_cols + cols[None, :]
    return rows, cols, offsets, row_mask, col_mask, row_mask[:, None] & col_mask[None, :]


@triton.jit
def _gamma(W, cols, col_mask, ZERO_CENTERED: tl.constexpr):
    """gamma as float32, 1 + gamma if zero-centered (the masked columns are not stored)."""
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    return w


@triton.jit
def _norm_fwd_kernel(X, R, H, Y, W, B, Mean, Rstd, n_rows, n_cols, eps,
                     IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ZERO_CENTERED: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Y = norm(X); with HAS_RESIDUAL, H = X + R (rounded to H's dtype, as a separate add
    rounds it) and Y = norm(H)."""
    row_start = tl.program_id(0).to(tl.int64) * BLOCK_M
    rows, cols, offsets, row_mask, col_mask, mask = _tile(row_start, n_rows, n_cols,
                                                          BLOCK_M, BLOCK_N)
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = (x + tl.load(R + offsets, mask=mask, other=0.0).to(tl.float32)).to(
            H.dtype.element_ty)
        tl.store(H + offsets, h, mask=mask)
        x = h.to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / n_cols
        tl.store(Mean + rows, mean, mask=row_mask)
        xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    tl.store(Rstd + rows, rstd, mask=row_mask)
    y = xc * rstd[:, None] * _gamma(W, cols, col_mask, ZERO_CENTERED)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(X, DY, DH, DX, W, Mean, Rstd, PARTIAL, n_rows, n_cols, rows_per_program,
                     IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ZERO_CENTERED: tl.constexpr, HAS_DH: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    """dx of rows [pid * rows_per_program, + rows_per_program) (plus DH's rows with HAS_DH:
    the gradient the norm's input gets from its other uses, added before dx's rounding);
    PARTIAL[pid] = that chunk's sums of dy * xhat (dgamma) and, with a bias,
    PARTIAL[pid, n_cols:] its sums of dy."""
    pid = tl.program_id(0).to(tl.int64)
    first = pid * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    w = _gamma(W, cols, cols < n_cols, ZERO_CENTERED)[None, :]
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    # STAGES 3: the next two tiles' x and dy are on their way (cp.async, to shared memory)
    # while this one is reduced, rather than one dependent load after another
    for row_start in tl.range(first, end, BLOCK_M, num_stages=STAGES):
        rows, cols, offsets, row_mask, col_mask, mask = _tile(row_start, end, n_cols,
                                                              BLOCK_M, BLOCK_N)
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32)
        # masked elements have dy = 0 (masked rows also rstd = 0): they add nothing below
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)[:, None]
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = (x - tl.load(Mean + rows, mask=row_mask, other=0.0)[:, None]) * rstd
        wdy = w * dy
        # d/dx of (x - mean) * rstd: remove the components along xhat (and the mean)
        c1 = tl.sum(xhat * wdy, axis=1)[:, None] / n_cols
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=1)[:, None] / n_cols
            dx = (wdy - (xhat * c1 + c2)) * rstd
        if HAS_DH:
            dx += tl.load(DH + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    col_mask = cols < n_cols
    partial = PARTIAL + pid * (2 if HAS_BIAS else 1) * n_cols
    tl.store(partial + cols, dw, mask=col_mask)
    if HAS_BIAS:
        tl.store(partial + n_cols + cols, db, mask=col_mask)


# The backward's register cap: 16 warps' worth of the SM's 64K registers at 128 each, so that
# 16 // num_warps programs share an SM (at 8 warps ptxas took up to 167 unconstrained: one
# program per SM). Compiled for sm_90, 2048 columns: bf16 LayerNorm does not spill, RMSNorm
# spills 6-8 registers.
_BWD_MAX_REGISTERS = 128


def _tile_config(n_cols: int):
    """(BLOCK_M, BLOCK_N, num_warps) of both kernels: one warp per 256 columns (a warp's
    16-byte loads of bf16 cover 256) up to 16 warps; 4 rows a tile up to 4096 columns.

    The kernels are memory-bound, so the tile is sized for bytes in flight within the
    registers: rows of 256 to 4096 columns give 32 float32 values of each tile-sized tensor
    per thread (4 rows x 2048: 16 KiB of bf16 per tensor and program; the backward holds x
    and dy, ~128 registers), and each thread keeps all of its columns' rows, so the
    backward's column sums of a tile need no cross-warp traffic. Wider rows take one row a
    tile (16 or 32 values a thread at 16 warps; the backward of 16384 spills, as before), and
    so do widths that are not a multiple of 16: their loads are not vectorized, each element
    has its own 64-bit address, and 4 rows would spill. Not yet measured on a GPU: reasoned
    from the above for H100/H200 and bf16 (and checked to compile for sm_90)."""
    block_n = triton.next_power_of_2(n_cols)
    block_m = 4 if block_n <= 4096 and n_cols % 16 == 0 else 1
    return block_m, block_n, min(16, max(1, block_n // 256))


def _backward_stages(*inputs: torch.Tensor) -> int:
    """Pipeline stages of the backward's loop over the tiles of ``inputs`` (x, dy and, with a
    residual, dh): 3 (two tiles of x and dy in shared memory, at most 128 KiB per SM of 2-byte
    inputs at any width) for bf16/fp16 x and dy; 2 with dh's tiles too (the same bytes);
    1 (plain loads) with a float32 input, whose buffers would not fit beside each other in
    an SM. (Not yet measured with dh.)"""
    if any(t.element_size() > 2 for t in inputs):
        return 1
    return 3 if len(inputs) == 2 else 2


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _backward_rows_per_program(n_rows: int, block_m: int, num_warps: int,
                               device: torch.device) -> int:
    """Rows per backward program, a multiple of block_m: as many programs as the SMs hold at
    once (16 // num_warps each, _BWD_MAX_REGISTERS), one wave, so each program sums many rows
    and the partial sums (4 or 8 bytes per column and program, written and read back) stay
    small beside the 6 bytes per element (bf16) of x, dy and dx."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        programs = max(1, 16 // num_warps) * _sm_count(index)
    else:
        programs = 3  # the Triton interpreter on CPU (tests): several tiles per program
    return triton.cdiv(triton.cdiv(n_rows, programs), block_m) * block_m


def _forward(ctx, x, residual, weight, bias, eps, is_rms, zero_centered):
    """(y, the sum x + residual or None) as [rows, cols], ctx set up for _backward."""
    n_cols = x.shape[-1]
    x2d = x.reshape(-1, n_cols).contiguous()
    n_rows = x2d.shape[0]
    y = torch.empty_like(x2d)
    h = None if residual is None else torch.empty_like(x2d)
    stats = dict(dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, **stats)
    mean = rstd if is_rms else torch.empty(n_rows, **stats)  # unused for RMSNorm
    block_m, block_n, num_warps = _tile_config(n_cols)
    _norm_fwd_kernel[(triton.cdiv(n_rows, block_m),)](
        x2d, x2d if h is None else residual.reshape(n_rows, n_cols).contiguous(),
        y if h is None else h, y, weight, bias if bias is not None else weight, mean, rstd,
        n_rows, n_cols, eps, IS_RMS=is_rms, HAS_BIAS=bias is not None,
        ZERO_CENTERED=zero_centered, HAS_RESIDUAL=h is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, num_warps=num_warps)
    ctx.save_for_backward(x2d if h is None else h, weight, mean, rstd)
    ctx.has_bias, ctx.is_rms, ctx.zero_centered = bias is not None, is_rms, zero_centered
    ctx.x_shape, ctx.bias_dtype = x.shape, None if bias is None else bias.dtype
    return y, h


def _backward(ctx, dy, dh):
    """(dx, dgamma, dbeta or None): dx of the norm's input, plus dh (the gradient of the
    residual sum from its other uses) where given."""
    x2d, weight, mean, rstd = ctx.saved_tensors
    n_rows, n_cols = x2d.shape
    dy2d = dy.reshape(n_rows, n_cols).contiguous()
    dh2d = None if dh is None else dh.reshape(n_rows, n_cols).contiguous()
    dx = torch.empty_like(x2d)
    block_m, block_n, num_warps = _tile_config(n_cols)
    rows_per_program = _backward_rows_per_program(n_rows, block_m, num_warps, x2d.device)
    programs = triton.cdiv(n_rows, rows_per_program)
    # dgamma's (and dbeta's) partial sums side by side: one fixed-order sum adds both up
    partial = torch.empty(programs, (2 if ctx.has_bias else 1) * n_cols,
                          dtype=torch.float32, device=x2d.device)
    _norm_bwd_kernel[(programs,)](
        x2d, dy2d, dy2d if dh2d is None else dh2d, dx, weight, mean, rstd, partial, n_rows,
        n_cols, rows_per_program, IS_RMS=ctx.is_rms, HAS_BIAS=ctx.has_bias,
        ZERO_CENTERED=ctx.zero_centered, HAS_DH=dh2d is not None, BLOCK_M=block_m,
        BLOCK_N=block_n,
        STAGES=_backward_stages(x2d, dy2d, *(() if dh2d is None else (dh2d,))),
        num_warps=num_warps, maxnreg=_BWD_MAX_REGISTERS)
    # one fixed-order pass adds the programs' partial sums up and rounds once to the
    # parameters' dtype (float32 first where gamma's and beta's dtypes differ)
    same = ctx.bias_dtype in (None, weight.dtype)
    sums = sum_partial_rows(partial, torch.empty(partial.shape[1], device=x2d.device,
                                                 dtype=weight.dtype if same else torch.float32))
    dw = sums[:n_cols].to(weight.dtype)
    db = sums[n_cols:].to(ctx.bias_dtype) if ctx.has_bias else None
    return dx.view(ctx.x_shape), dw, db


class FusedNorm(torch.autograd.Function):
    """y = norm(x) * gamma (+ beta) over the last dim; gamma -> 1 + gamma if zero_centered."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms, zero_centered):
        y, _ = _forward(ctx, x, None, weight, bias, eps, is_rms, zero_centered)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        return *_backward(ctx, dy, None), None, None, None


class FusedNormPassingInput(torch.autograd.Function):
    """(norm(x) * gamma (+ beta), x): the norm with its input handed back out, for a caller
    that uses x again (a layer's residual stream). The gradient of that second output is
    added into the norm's input gradient inside the backward kernel, instead of autograd
    adding the two gradients of x in a separate pass."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms, zero_centered):
        ctx.set_materialize_grads(False)
        y, _ = _forward(ctx, x, None, weight, bias, eps, is_rms, zero_centered)
        passed = x.view(x.shape)
        if not x.requires_grad:  # (the parameters' grads make every output require grad)
            ctx.mark_non_differentiable(passed)
        return y.view(x.shape), passed

    @staticmethod
    def backward(ctx, dy, dx_other):
        if dy is None:  # only the passed input was used
            return dx_other, None, None, None, None, None
        return *_backward(ctx, dy, dx_other), None, None, None


class FusedAddNorm(torch.autograd.Function):
    """(norm(x + residual), x + residual): a residual add and the norm after it in one pass
    over the rows (the sum rounded to x's dtype first, as the separate add rounds it). The
    backward adds the sum's gradient from its other uses into the norm's input gradient (no
    separate accumulation), and both addends get that one tensor."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, is_rms, zero_centered):
        ctx.set_materialize_grads(False)
        y, h = _forward(ctx, x, residual, weight, bias, eps, is_rms, zero_centered)
        return y.view(x.shape), h.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dh):
        if dy is None:  # only the sum was used
            return dh, dh, None, None, None, None, None
        dx, dw, db = _backward(ctx, dy, dh)
        return dx, dx, dw, db, None, None, None


def fused_norm(x, normalization, weight, bias, eps, zero_centered_gamma, pass_input=False):
    """The Triton path of ``module.layernorm.apply_norm`` (same arguments and result)."""
    function = FusedNormPassingInput if pass_input else FusedNorm
    return function.apply(x, weight, bias, float(eps), normalization == "RMSNorm",
                          bool(zero_centered_gamma))


def fused_add_norm(x, residual, normalization, weight, bias, eps, zero_centered_gamma):
    """The Triton path of ``module.layernorm.apply_add_norm`` (same arguments and result)."""
    return FusedAddNorm.apply(x, residual, weight, bias, float(eps),
                              normalization == "RMSNorm", bool(zero_centered_gamma))
