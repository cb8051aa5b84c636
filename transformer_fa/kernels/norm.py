"""Fused LayerNorm and RMSNorm (forward and backward) in Triton.

One program normalizes one row in float32 and saves the row's mean (LayerNorm) and rstd for
the backward, which then needs no second pass over the statistics. The backward's programs
each take rows ``pid, pid + G, ...``, write dx per row and keep their share of dgamma/dbeta in
registers; the G partial sums are added up at the end (no atomics, so the result does not
depend on scheduling).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _norm_fwd_kernel(X, Y, W, B, Mean, Rstd, n_cols, eps,
                     IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / n_cols
        tl.store(Mean + row, mean)
        xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    tl.store(Rstd + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    y = xc * rstd * w
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(X, DY, DX, W, Mean, Rstd, DW_partial, DB_partial, n_rows, n_cols,
                     IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets: rows * cols may pass 2**31
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, tl.cdiv(n_rows - pid, n_programs)):
        row = pid + i * n_programs
        offset = row * n_cols
        x = tl.load(X + offset + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offset + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(Mean + row)) * rstd, 0.0)
        wdy = w * dy
        # d/dx of (x - mean) * rstd: remove the components along xhat (and the mean)
        c1 = tl.sum(xhat * wdy, axis=0) / n_cols
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / n_cols
            dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(DX + offset + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(DW_partial + pid * n_cols + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB_partial + pid * n_cols + cols, db, mask=mask)


def _launch_config(n_cols: int):
    block = triton.next_power_of_2(n_cols)
    return block, min(16, max(1, block // 512))


def _backward_programs(n_rows: int, device: torch.device) -> int:
    """Enough programs to fill the GPU a few times over; each then sums many rows."""
    if device.type == "cuda":
        return min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(n_rows, 4)  # the Triton interpreter on CPU (tests)


class FusedNorm(torch.autograd.Function):
    """y = norm(x) * gamma (+ beta) over the last dim; gamma -> 1 + gamma if zero_centered."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms, zero_centered):
        n_cols = x.shape[-1]
        x2d = x.reshape(-1, n_cols).contiguous()
        n_rows = x2d.shape[0]
        y = torch.empty_like(x2d)
        stats = dict(dtype=torch.float32, device=x.device)
        rstd = torch.empty(n_rows, **stats)
        mean = rstd if is_rms else torch.empty(n_rows, **stats)  # unused for RMSNorm
        block, num_warps = _launch_config(n_cols)
        _norm_fwd_kernel[(n_rows,)](
            x2d, y, weight, bias if bias is not None else weight, mean, rstd, n_cols, eps,
            IS_RMS=is_rms, HAS_BIAS=bias is not None, ZERO_CENTERED=zero_centered,
            BLOCK=block, num_warps=num_warps)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.has_bias, ctx.is_rms, ctx.zero_centered = bias is not None, is_rms, zero_centered
        ctx.x_shape, ctx.bias_dtype = x.shape, None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        n_rows, n_cols = x2d.shape
        dy2d = dy.reshape(n_rows, n_cols).contiguous()
        dx = torch.empty_like(x2d)
        programs = _backward_programs(n_rows, x2d.device)
        dw_partial = torch.empty(programs, n_cols, dtype=torch.float32, device=x2d.device)
        db_partial = torch.empty_like(dw_partial) if ctx.has_bias else dw_partial
        block, num_warps = _launch_config(n_cols)
        _norm_bwd_kernel[(programs,)](
            x2d, dy2d, dx, weight, mean, rstd, dw_partial, db_partial, n_rows, n_cols,
            IS_RMS=ctx.is_rms, HAS_BIAS=ctx.has_bias, ZERO_CENTERED=ctx.zero_centered,
            BLOCK=block, num_warps=num_warps)
        dw = dw_partial.sum(0).to(weight.dtype)
        db = db_partial.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.view(ctx.x_shape), dw, db, None, None, None


def fused_norm(x, normalization, weight, bias, eps, zero_centered_gamma):
    """The Triton path of ``module.layernorm.apply_norm`` (same arguments and result)."""
    return FusedNorm.apply(x, weight, bias, float(eps), normalization == "RMSNorm",
                           bool(zero_centered_gamma))
