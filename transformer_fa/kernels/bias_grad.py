"""Bias gradients in Triton: column sums of a 2D gradient, and GELU's backward fused with the
bias gradient of the GEMM before it.

A linear layer's bias gradient is its output gradient summed over the tokens: ``g.sum(0)`` of
the ``[tokens, features]`` gradient. A program sums ``BLOCK_C`` columns over a chunk of rows,
``BLOCK_R`` rows at a time, into a float32 ``[BLOCK_R, BLOCK_C]`` accumulator (reduced over
its rows once, at the end), and writes one float32 row of partial sums; a second kernel adds
the partial rows up in order and rounds once to the output dtype (a single chunk writes the
result directly). No atomics: the result depends only on the shape and the GPU's SM count,
which sets the chunks.

``dgelu_column_sum`` reads dy and GELU's input h in the same pass, writes dh = dy * gelu'(h)
(torch's tanh-approximation formula in float32, rewritten without 1 + tanh's cancellation:
_exp_minus_2y) in h's dtype and sums the
float32 dh values, before their rounding, into the bias gradient (as TE's dgelu + dbias
kernel): one read of dy and h instead of gelu_backward's, then the sum's second read of dh.

``gelu`` is the forward of that GELU (the MLP's FC1 output h -> gelu(h), h kept for the
backward): one streaming pass with the same float32 formula.
"""
import functools
import math
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import KERNEL_DTYPES

# torch's constants of the tanh GELU (ActivationGeluKernel): y = beta (x + kappa x^3)
_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5
_KAPPA = 0.044715
# exp(-2 y) = 2^(x (c + c kappa x^2)) with c = -2 beta log2(e)
_EXP2_C = tl.constexpr(-2.0 * _BETA / math.log(2.0))
_EXP2_CK = tl.constexpr(-2.0 * _BETA * _KAPPA / math.log(2.0))
# gelu'(x) = s + x s (1 - s) (2 beta + 6 beta kappa x^2)
_TWO_BETA = tl.constexpr(2.0 * _BETA)
_SIX_BETA_KAPPA = tl.constexpr(6.0 * _BETA * _KAPPA)


@triton.jit
def _exp_minus_2y(x):
    """exp(-2 y) for GELU's y = beta (x + kappa x^3), as one exp2. With it
    s = (1 + tanh(y)) / 2 = 1 / (1 + exp(-2 y)) and 1 - s = exp(-2 y) s: torch's formula
    computes 1 + tanh(y) and 1 - tanh(y)^2, which cancel (for negative and for large x); this
    form does not, so it is as accurate as torch's float32 GELU or more (tests: within the
    FP8 casts' GELU slack of torch's, as accurate as torch's against float64). About half the
    instructions of tanh from exp(-2|y|): the GELU casts are partly bound by instruction issue
    (8192 x 8192 bf16 gelu cast, both orientations: 1360 SASS instructions a thread for 32
    elements with that tanh, 1104 with this; the plain cast 656)."""
    return tl.exp2(x * (x * x * _EXP2_CK + _EXP2_C))


@triton.jit
def gelu_tanh(x):
    """gelu(x) = x/2 (1 + tanh(beta (x + kappa x^3))) = x / (1 + exp(-2 y)) in float32 (torch's
    tanh GELU; the FP8 cast applies it to its input, kernels/fp8_cast.py)."""
    return x / (1.0 + _exp_minus_2y(x))


@triton.jit
def gelu_tanh_grad(dy, x):
    """dy * gelu'(x) for gelu(x) = x s, s = (1 + tanh(y)) / 2: gelu'(x) = s + x s (1 - s)
    2 beta (1 + 3 kappa x^2) (torch's left and right derivatives, 1 - tanh^2 = 4 s (1 - s))."""
    e = _exp_minus_2y(x)
    s = 1.0 / (1.0 + e)
    # 1 - s = e s, without the cancellation of 1 - s near s = 1; where e overflows, s = 0
    one_minus_s = tl.where(e < float("inf"), e * s, 1.0)
    inner_derivative = x * x * _SIX_BETA_KAPPA + _TWO_BETA
    return dy * (s + x * s * one_minus_s * inner_derivative)


@triton.jit
def _gelu_kernel(X, Y, n, BLOCK: tl.constexpr):
    """Y = gelu(X) over n contiguous elements, in float32, rounded once to Y's dtype."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offsets, gelu_tanh(x).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _partial_column_sums_kernel(G, H, DH, PARTIAL, n_rows, n_cols, stride_g, stride_h,
                                rows_per_program, DGELU: tl.constexpr,
                                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                                STAGES: tl.constexpr):
    """PARTIAL[chunk, cols] = the sum over the chunk's rows of G (DGELU: of dgelu(G, H),
    also written to DH). STAGES > 1: the next row blocks' loads are in flight (cp.async)
    while one is summed."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    chunk = tl.program_id(1).to(tl.int64)  # 64-bit offsets: rows * cols may pass 2**31
    first = chunk * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in tl.range(first, end, BLOCK_R, num_stages=STAGES):
        rows = start + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & col_mask[None, :]
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        if DGELU:
            h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            g = gelu_tanh_grad(g, h)  # 0 where masked (dy = 0)
            tl.store(DH + rows[:, None] * n_cols + cols[None, :], g.to(DH.dtype.element_ty),
                     mask=mask)
        acc += g
    tl.store(PARTIAL + chunk * n_cols + cols, tl.sum(acc, axis=0).to(PARTIAL.dtype.element_ty),
             mask=col_mask)


@triton.jit
def _sum_partials_kernel(PARTIAL, OUT, n_partials, n_cols, BLOCK_P: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    """OUT[cols] = the float32 sum of PARTIAL's rows, in a fixed order, rounded once."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)


class ColumnSumTiles(NamedTuple):
    """Launch settings of _partial_column_sums_kernel: rows a block by the input's element
    size (2: bf16/fp16, 4: float32), columns a program, warps, pipeline stages of its row
    loop (2-byte inputs; float32 ones load plainly, as the norm backward's: their buffers
    could pass the shared memory of sm86/sm89 GPUs), and programs per SM (the row chunks
    follow from it)."""
    block_r: dict
    block_c: int
    num_warps: int
    stages: int
    programs_per_sm: int


# Blocks of 16 KiB of 2-byte input (64 rows x 128 columns), the same bytes of float32, 4
# warps, the row loop pipelined 3 deep (the next two blocks' loads in flight), 2 programs per
# SM; the partial-sum pass reads at most 32 partial rows a step. From the sweep of
# benchmarks/bench_column_sums.py (rows 32/64, 4/8 warps, 1-3 stages, 2/4/8 programs per SM;
# bf16, 8192 rows, L2 flushed, H200, 2026-12-01: NVIDIA-H200-2026-12-01-column-sums): against
# the former 64 x 128 blocks, 8 warps, no pipelining, 4 programs per SM, column sums of
# 8192 x 6144 54.2 -> 39.0 us (torch's sum 45.2), of 8192 x 2048 24.6 -> 20.4 us, dgelu with
# the sums of 8192 x 8192 146.8 -> 111.5 us (2.7 -> 3.6 TB/s; torch's gelu_backward and sum
# 152.0). The best setting of dgelu alone (32 rows) was 106.7 us; one setting serves both.
TILES = ColumnSumTiles(block_r={2: 64, 4: 32}, block_c=128, num_warps=4, stages=3,
                       programs_per_sm=2)
_FINAL_BLOCK_C = 128
_FINAL_BLOCK_P = 32


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _target_programs(device: torch.device, programs_per_sm: int) -> int:
    if device.type == "cuda":
        return programs_per_sm * _sm_count(device.index if device.index is not None
                                           else torch.cuda.current_device())
    return 8  # the Triton interpreter on CPU (tests): a few chunks, several rows each


def _row_chunks(n_rows: int, n_cols: int, block_r: int, device: torch.device,
                tiles: ColumnSumTiles) -> Tuple[int, int, int]:
    """(column tiles, rows per chunk (a multiple of block_r), chunks): about
    _target_programs programs in all, each over whole row blocks."""
    col_tiles = triton.cdiv(n_cols, tiles.block_c)
    chunks = max(1, min(_target_programs(device, tiles.programs_per_sm) // col_tiles,
                        triton.cdiv(n_rows, block_r)))
    rows_per_chunk = triton.cdiv(triton.cdiv(n_rows, chunks), block_r) * block_r
    return col_tiles, rows_per_chunk, triton.cdiv(n_rows, rows_per_chunk)


def _column_sums(g: torch.Tensor, h: Optional[torch.Tensor], out_dtype: torch.dtype,
                 tiles: Optional[ColumnSumTiles] = None
                 ) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(dgelu(g, h) or None, the column sums of g or of dgelu(g, h)) of 2D g (and h);
    tiles: the launch settings (default TILES)."""
    tiles = TILES if tiles is None else tiles
    n_rows, n_cols = g.shape
    dh = None if h is None else torch.empty((n_rows, n_cols), dtype=h.dtype, device=g.device)
    if n_rows == 0 or n_cols == 0:
        return dh, torch.zeros(n_cols, dtype=out_dtype, device=g.device)
    element_size = max(g.element_size(), 1 if h is None else h.element_size())
    block_r = tiles.block_r[element_size]
    col_tiles, rows_per_chunk, chunks = _row_chunks(n_rows, n_cols, block_r, g.device, tiles)
    out = torch.empty(n_cols, dtype=out_dtype, device=g.device)
    partial = out if chunks == 1 else torch.empty(chunks, n_cols, dtype=torch.float32,
                                                  device=g.device)
    _partial_column_sums_kernel[(col_tiles, chunks)](
        g, g if h is None else h, g if dh is None else dh, partial, n_rows, n_cols,
        g.stride(0), 0 if h is None else h.stride(0), rows_per_chunk,
        DGELU=h is not None, BLOCK_R=block_r, BLOCK_C=tiles.block_c,
        STAGES=tiles.stages if element_size <= 2 else 1, num_warps=tiles.num_warps)
    if chunks > 1:
        sum_partial_rows(partial, out)
    return dh, out


def sum_partial_rows(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = the sums of the contiguous float32 [rows, cols] ``partial``'s rows, added in
    float32 in a fixed order and rounded once to out's dtype (the second pass of the column
    sums here and of the norm backward's dgamma / dbeta)."""
    n_partials, n_cols = partial.shape
    _sum_partials_kernel[(triton.cdiv(n_cols, _FINAL_BLOCK_C),)](
        partial, out, n_partials, n_cols,
        BLOCK_P=min(_FINAL_BLOCK_P, triton.next_power_of_2(n_partials)),
        BLOCK_C=_FINAL_BLOCK_C, num_warps=4)
    return out


# 8192 elements a program with 8 warps: 32 a thread, 16 KiB of 2-byte input in flight per
# program. 8192 x 8192 bf16 on the H200 (2026-11-28): 70.6 us against torch's gelu's 79.1 us
# (3.8 against 3.4 TB/s); in the layer benchmark's bf16 step 0.57 ms against 0.69.
_GELU_BLOCK = 8192
_GELU_WARPS = 8


def gelu(x: torch.Tensor) -> torch.Tensor:
    """``F.gelu(x, approximate="tanh")`` of a float32, bfloat16 or float16 tensor, in its
    dtype and shape (a copy first where x is not contiguous): float32 inside, the tanh within
    a few ulps of torch's (gelu_tanh)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        _gelu_kernel[(triton.cdiv(x.numel(), _GELU_BLOCK),)](
            x, y, x.numel(), BLOCK=_GELU_BLOCK, num_warps=_GELU_WARPS)
    return y


def _check_2d(t, name: str) -> torch.Tensor:
    """t as a 2D tensor of a kernel dtype whose rows are read with unit column stride."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2D [rows, cols], got shape {tuple(t.shape)}")
    if t.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    return t if t.stride(1) == 1 else t.contiguous()


def column_sum(g2d: torch.Tensor) -> torch.Tensor:
    """``g2d.sum(0)`` in g2d's dtype, summed in float32 and rounded once; deterministic."""
    g2d = _check_2d(g2d, "g2d")
    return _column_sums(g2d, None, g2d.dtype)[1]


def dgelu_column_sum(dy: torch.Tensor, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dh, db) for y = gelu(h) (the tanh approximation): dh = dy * gelu'(h) computed in
    float32 by the tanh GELU's derivative without torch's cancellation (_exp_minus_2y), in h's
    dtype (contiguous); db = the column sums of the float32 dh values (before dh's rounding),
    rounded once to h's dtype."""
    dy, h = _check_2d(dy, "dy"), _check_2d(h, "h")
    if dy.shape != h.shape or dy.device != h.device:
        raise ValueError(f"dy and h must have one shape and device, got {tuple(dy.shape)} on "
                         f"{dy.device} and {tuple(h.shape)} on {h.device}")
    return _column_sums(dy, h, h.dtype)
