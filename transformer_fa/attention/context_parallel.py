"""Context parallelism (CP) for DotProductAttention over torch.distributed, with TE's API.

Each rank of ``cp_group`` holds a part of every sequence, load-balanced for causal masks as in
TE: the sequence is cut into ``2 * cp_size`` chunks and rank r holds chunks r and
``2 * cp_size - 1 - r`` (in that order). Three ways to attend over the whole sequence:

- ``"p2p"``: K/V blocks travel around the ring (batched isend/irecv, posted before the
  current block is computed so that the transfer overlaps it); the partial outputs are merged
  by their log-sum-exp. The backward recomputes each block from the saved LSE and passes dK/dV
  around the ring with their K/V block, so only the local q, k, v, output and LSE are kept.
- ``"all_gather"``: K/V are gathered and the local query chunks attend with their offsets.
- ``"a2a"``: heads and sequence are exchanged with all-to-all (Ulysses): each rank attends
  over the whole sequence for ``h / cp_size`` heads, then the output goes back.

All three run one piece of math, ``attend`` (softmax attention with an LSE and a causal
offset), each block on the backend DotProductAttention's own selection picks for a call of
its shape (the preference per GPU, the NVTE_* switches, the support checks): cuDNN
(FusedAttention) or this repo's flash kernels (forward with the LSE, and the backward from
the merged output and LSE), else the unfused backend's math in PyTorch; sliding windows and
explicit masks, which cuDNN's calls here do not take, go to the flash kernels or the math;
``all_gather`` and ``a2a`` differentiate it with autograd (their communication has autograd
functions), ``p2p`` has its own backward.
Supported: sbhd/bshd, ``no_mask`` and ``causal``, GQA/MQA, sliding windows with
``all_gather``/``a2a`` (as TE); thd with ``p2p`` and ``all_gather`` in TE's convention (global
``cu_seqlens_*`` and ``cu_seqlens_*_padded``, every padded sequence divisible by
``2 * cp_size``, see ``_ThdSide``), each block masked per sequence and always in the PyTorch
math. Everything else is refused before any communication.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..parallel import gather_along_dim
from . import layout, masks, padding, selection
from .backends import flash, fused, unfused
from .backends.fused import ops as fused_ops
from .params import params_fields

logger = logging.getLogger("DotProductAttention")

COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
_FORMATS = ("sbhd", "bshd")
_MASK_TYPES = ("no_mask", "causal")
_THD_MASK_TYPES = ("no_mask", "causal", "padding", "padding_causal")  # the same in thd
last_block_backend = unfused.NAME  # the backend of the last block ``attend`` ran


# ----------------------------------------------------------------------------- configuration

def check_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type) -> Optional[List[int]]:
    """Validates TE's CP arguments; returns the group's global ranks (None without a group)."""
    if cp_comm_type not in COMM_TYPES:
        raise ValueError(f"cp_comm_type must be one of {COMM_TYPES}, got {cp_comm_type!r}")
    if cp_stream is not None and not isinstance(cp_stream, torch.cuda.Stream):
        raise TypeError(f"cp_stream must be a torch.cuda.Stream or None, got "
                        f"{type(cp_stream).__name__}")
    if cp_group is None:
        return None
    if cp_comm_type == "a2a+p2p" or isinstance(cp_group, (list, tuple)):
        raise ValueError("cp_comm_type='a2a+p2p' (hierarchical CP, cp_group = [a2a_group, "
                         "p2p_group]) is not supported yet; use 'p2p', 'all_gather' or 'a2a' "
                         "with one process group")
    if not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(f"cp_group must be a torch.distributed ProcessGroup or None, got "
                        f"{type(cp_group).__name__}")
    ranks = dist.get_process_group_ranks(cp_group)
    if cp_global_ranks is not None and list(cp_global_ranks) != ranks:
        raise ValueError(f"cp_global_ranks={list(cp_global_ranks)} does not match cp_group, "
                         f"whose global ranks are {ranks}")
    return ranks


def size_and_rank(cp_group) -> Tuple[int, int]:
    """(cp_size, cp_rank): (1, 0) without a group."""
    if cp_group is None:
        return 1, 0
    return dist.get_world_size(cp_group), dist.get_rank(cp_group)


def set_group_on_submodules(module: torch.nn.Module, cp_group, cp_global_ranks, cp_stream,
                            cp_comm_type) -> None:
    """TE's set_context_parallel_group of a composite module: every submodule that has one."""
    for child in module.modules():
        if child is not module and hasattr(child, "set_context_parallel_group"):
            child.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)


# --------------------------------------------------------------------------------- the math

def _keep_mask(sq: int, skv: int, q_offset: int, window, device) -> Optional[torch.Tensor]:
    """Query i (at position q_offset + i) sees key j iff j lies in its window; None = all."""
    if window is None or tuple(window) == (-1, -1):
        return None
    q_pos = torch.arange(sq, device=device).unsqueeze(-1) + q_offset
    k_pos = torch.arange(skv, device=device)
    left, right = window
    keep = torch.ones(sq, skv, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= k_pos >= q_pos - left
    if right >= 0:
        keep &= k_pos <= q_pos + right
    return keep


def _logits(q, k, scale, q_offset, window, keep=None):
    """Masked, scaled scores of q ``[b, h, sq, d]`` against k ``[b, hkv, skv, d]``, grouped as
    GQA ``[b, hkv, g, sq, skv]``: formed in the input dtype, then in the compute dtype (as the
    unfused backend). ``keep`` (bool ``[sq, skv]``), when given, replaces the window."""
    b, h, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    q5 = q.reshape(b, hkv, h // hkv, sq, d)
    logits = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2))
    logits = logits.to(unfused.compute_dtype(q.dtype)) * scale
    if keep is None:
        keep = _keep_mask(sq, skv, q_offset, window, q.device)
    return logits if keep is None else logits.masked_fill(~keep, float("-inf"))


def _kernel_call(q, k, v, scale: float, q_offset: int, window,
                 keep=None) -> Optional[flash.FlashCall]:
    """The flash kernels' call for one ``attend`` block (bhsd tensors), or None where they
    cannot serve it and the PyTorch math runs: not CUDA fp16/bf16, the extension missing, a
    head dim it lacks, an offset that is neither diagonal alignment, or an explicit mask."""
    d = q.shape[-1]
    if not (keep is None and q.is_cuda and q.dtype in flash.SUPPORTED_DTYPES
            and k.dtype == v.dtype == q.dtype and k.shape[-1] == v.shape[-1] == d
            and d % 8 == 0 and d <= flash.MAX_HEAD_DIM and flash._extension() is not None):
        return None
    sq, skv = q.shape[2], k.shape[2]
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if (left, right) != (-1, -1) and q_offset not in (0, skv - sq):
        return None
    # the kernels' mask offset is skv - sq with the bottom-right diagonal, else 0
    return flash.FlashCall("bshd", "bshd", sq, skv, float(scale), left, right, q_offset != 0,
                           0.0, False, True)


def _fused_call(q, k, v, scale: float, q_offset: int, window, keep=None,
                backward: bool = False) -> Optional[fused.FusedCall]:
    """cuDNN's call for one ``attend`` block (bhsd tensors) where DotProductAttention's
    selection picks FusedAttention for a bshd call of the block's shape (on Hopper it is
    faster than the flash kernels: CP at s = 128k on 2 H200s ran its blocks at 0.68 of one
    GPU's cuDNN throughput on the flash kernels, 2026-11-24); None otherwise. Masks: none, or
    causal aligned top-left (offset 0) or bottom-right (offset skv - sq). backward: asked for
    a block's backward (grad mode is off there; cuDNN's support check must cover it)."""
    if keep is not None or not q.is_cuda:
        return None
    b, h, sq, d = q.shape
    skv = k.shape[2]
    if window is None:
        mask = "no_mask"
    elif tuple(window) == (-1, 0) and q_offset in (0, skv - sq):
        mask = "causal" if q_offset == 0 else "causal_bottom_right"
    else:
        return None
    left, right = (-1, -1) if window is None else (-1, 0)
    env = selection.read_env()
    deterministic = selection.deterministic_requested(env)
    fields = params_fields(
        qkv_format="bshd", q_format="bshd", kv_format="bshd", qkv_layout="bshd_bshd_bshd",
        batch_size=b, num_heads=h, num_gqa_groups=k.shape[1], max_seqlen_q=sq,
        max_seqlen_kv=skv, head_dim_qk=d, head_dim_v=v.shape[-1], dtype=q.dtype,
        device_type="cuda", compute_capability=torch.cuda.get_device_capability(q.device),
        attn_mask_type=mask, window_size=(left, right), core_attention_bias_type="no_bias",
        core_attention_bias_shape=None, core_attention_bias_requires_grad=False,
        alibi_slopes_shape=None, attention_dropout=0.0, softmax_scale=float(scale),
        deterministic=deterministic, requires_grad=backward or torch.is_grad_enabled(),
        is_compiling=torch.compiler.is_compiling(), softmax_type="vanilla",
        return_max_logit=False, softcap=0.0, bottom_right_diagonal=True, kv_page_size=0)
    backend, _ = selection.select(fields, env)
    if backend is not fused:
        return None
    return fused.FusedCall("bshd", "bshd", sq, skv, mask, left, right, float(scale), 0.0,
                           deterministic, True)


def blocks_run_on_kernels(dtype, head_dim: int, device) -> bool:
    """Whether CP's (bshd/sbhd) blocks of this dtype and head dim run on the flash kernels on
    ``device`` (memory linear in s), not the PyTorch math (float32 scores of a whole block)."""
    probe = torch.empty(1, 1, 8, head_dim, dtype=dtype, device=device)
    return _kernel_call(probe, probe, probe, 1.0, 0, (-1, 0)) is not None


def _bshd(x):
    return x.transpose(1, 2)


def attend(q, k, v, scale: float, q_offset: int = 0, window=None, keep=None):
    """Attention of q ``[b, h, sq, d]`` over k, v ``[b, hkv, skv, d]`` (GQA by broadcasting)
    where query i sits at key position ``q_offset + i``; ``window`` (left, right) as TE's
    window_size, (-1, 0) = causal, None = no mask. Returns ``(out [b, h, sq, dv], lse
    [b, h, sq])`` in the compute dtype (float32, or float64 for float64); differentiable
    (the LSE is not). ``keep`` (bool ``[sq, skv]``, True = attend) replaces offset and window
    (thd: sequences and positions); it always runs the PyTorch math."""
    global last_block_backend
    fused_call = _fused_call(q, k, v, scale, q_offset, window, keep)
    if fused_call is not None:
        last_block_backend = fused.NAME
        out, stats = torch.ops.transformer_fa.fused_attn_fwd(_bshd(q), _bshd(k), _bshd(v), None,
                                                             None, None, None, *fused_call)
        return _bshd(out).float(), stats.squeeze(-1)
    call = _kernel_call(q, k, v, scale, q_offset, window, keep)
    if call is not None:
        last_block_backend = flash.NAME
        out, lse = torch.ops.transformer_fa.flash_attn_fwd(_bshd(q), _bshd(k), _bshd(v), None,
                                                           None, None, None, *call)
        # the kernels give +inf for a row without keys; the merge wants -inf there
        lse = lse.masked_fill(lse == float("inf"), float("-inf"))
        return _bshd(out).float(), lse
    last_block_backend = unfused.NAME
    b, h, sq, _ = q.shape
    logits = _logits(q, k, scale, q_offset, window, keep)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    # A row with no key has lse -inf: its probabilities are 0 (not NaN).
    probs = torch.exp(logits - lse.masked_fill(torch.isinf(lse), 0.0))
    out = torch.matmul(probs, v.unsqueeze(2).to(probs.dtype))
    return out.reshape(b, h, sq, v.shape[-1]), lse.reshape(b, h, sq)


def attend_backward(q, k, v, dout, lse, delta, scale: float, q_offset: int = 0, window=None,
                    out=None, keep=None):
    """Gradients (dq, dk, dv) of one ``attend`` block, given the final (merged) LSE and
    ``delta = rowsum(dout * out)`` of its rows: flash attention's backward. The kernels take
    the final output instead of delta (``out``: they form delta themselves)."""
    fused_call = _fused_call(q, k, v, scale, q_offset, window, keep, backward=True)
    if fused_call is not None and out is not None:
        # cuDNN's backward graph reads O contiguous in its format (as its forward wrote it)
        out = _bshd(out).to(q.dtype, memory_format=torch.contiguous_format)
        grads = fused_ops.bwd_impl(_bshd(dout).to(q.dtype), _bshd(q), _bshd(k), _bshd(v), out,
                                   lse.float().unsqueeze(-1).contiguous(), None, None, None,
                                   None, fused_call, False)[:3]
        return tuple(_bshd(g) for g in grads)
    call = _kernel_call(q, k, v, scale, q_offset, window, keep)
    if call is not None and out is not None:
        grads = flash._bwd_impl(_bshd(dout).to(q.dtype), _bshd(q), _bshd(k), _bshd(v),
                                _bshd(out).to(q.dtype), lse.float().contiguous(), None, None,
                                None, None, call)
        return tuple(_bshd(g) for g in grads)
    b, h, sq, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    logits = _logits(q, k, scale, q_offset, window, keep)
    dtype = logits.dtype
    # a row without keys (thd padding) has lse -inf and probabilities 0
    finite_lse = lse.masked_fill(torch.isinf(lse), 0.0)
    probs = torch.exp(logits - finite_lse.reshape(b, hkv, g, sq, 1))
    dout5 = dout.reshape(b, hkv, g, sq, -1).to(dtype)
    dv = torch.matmul(probs.transpose(-1, -2), dout5).sum(2)
    dprobs = torch.matmul(dout5, v.unsqueeze(2).to(dtype).transpose(-1, -2))
    dlogits = probs * (dprobs - delta.reshape(b, hkv, g, sq, 1)) * scale
    dq = torch.matmul(dlogits, k.unsqueeze(2).to(dtype)).reshape(b, h, sq, d)
    dk = torch.matmul(dlogits.transpose(-1, -2), q.reshape(b, hkv, g, sq, d).to(dtype)).sum(2)
    return dq, dk, dv


# ----------------------------------------------------------------------------- thd (varlen)

class _ThdSide:
    """One side (q or kv) of a thd call under CP, TE's convention: ``cu_seqlens`` and
    ``cu_seqlens_padded`` are the global ones; each padded sequence length is divisible by
    2 * cp_size, and a rank holds, per sequence, chunks r and 2 * cp_size - 1 - r of its
    padded tokens at the offsets ``cu_seqlens_padded // cp_size``. Tokens past a sequence's
    real length are padding: they neither attend nor are attended to (zeros out, zero grads)."""

    def __init__(self, cu_seqlens, cu_seqlens_padded, cp_size: int, rows: int):
        self.lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        self.starts = (cu_seqlens_padded // cp_size).long()
        self.cp_size, self.rows = cp_size, rows

    def positions(self, rank: int):
        """(sequence id, global position) of each local row of rank ``rank``'s part; rows
        that are padding (or past the last sequence) get sequence id -1."""
        row = torch.arange(self.rows, device=self.starts.device)
        seq = torch.bucketize(row, self.starts[1:], right=True)
        inside = seq < self.lengths.numel()
        seq = seq.clamp(max=self.lengths.numel() - 1)
        offset = row - self.starts[seq]
        half = (self.starts[seq + 1] - self.starts[seq]) // 2
        second = offset >= half
        chunk = torch.where(second, 2 * self.cp_size - 1 - rank, rank)
        position = chunk * half + offset - second * half
        real = inside & (position < self.lengths[seq])
        return torch.where(real, seq, -1), position


def _thd_keep(q_side: _ThdSide, kv_positions, rank: int, window):
    """Bool ``[rows_q, rows_kv]``: query and key of the same sequence, neither padding, the
    key inside the query's window (None = all)."""
    q_seq, q_pos = q_side.positions(rank)
    kv_seq, kv_pos = kv_positions
    keep = (q_seq.unsqueeze(1) == kv_seq) & (q_seq >= 0).unsqueeze(1)
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= kv_pos >= q_pos.unsqueeze(1) - left
        if right >= 0:
            keep &= kv_pos <= q_pos.unsqueeze(1) + right
    return keep


def _thd_ring_plan(q_side: _ThdSide, kv_side: _ThdSide, rank: int, window):
    """The p2p plan of thd: every local row against the whole block, masked by ``keep``."""
    everything = slice(None)

    def plan(src):
        return everything, everything, None, _thd_keep(q_side, kv_side.positions(src), rank,
                                                        window)
    return plan


# ------------------------------------------------------------------------- communication

class _Ring:
    """The CP group as a ring: each shift sends to the next rank and receives from the
    previous one, asynchronously (NCCL runs it on its own stream, beside the compute)."""

    def __init__(self, group, global_ranks: Sequence[int]):
        self.group = group
        self.size, self.rank = size_and_rank(group)
        self.next = global_ranks[(self.rank + 1) % self.size]
        self.prev = global_ranks[(self.rank - 1) % self.size]

    def start_shift(self, tensors):
        """Posts the shift of ``tensors`` (sent as one buffer); ``finish_shift`` waits."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        received = torch.empty_like(flat)
        requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, flat, self.next, self.group),
            dist.P2POp(dist.irecv, received, self.prev, self.group)])
        return requests, received, [t.shape for t in tensors]

    @staticmethod
    def finish_shift(pending):
        requests, received, shapes = pending
        for request in requests:
            request.wait()
        sizes = [s.numel() for s in shapes]
        return tuple(part.view(shape) for part, shape in zip(received.split(sizes), shapes))


def _ring_block(src: int, rank: int, causal: bool, len_q: int, len_kv: int):
    """(query rows, key rows, window, keep=None) that rank ``rank`` computes against the K/V of rank
    ``src``. Causal and load-balanced: its own block is causal; of an earlier rank's K/V only
    the first chunk is in the past, seen by both local chunks; a later rank's K/V is wholly in
    the past of the second local chunk only. The rest is masked and skipped."""
    everything = slice(None)
    if not causal:
        return everything, everything, None, None
    if src == rank:
        return everything, everything, (-1, 0), None
    if src < rank:
        return everything, slice(0, len_kv // 2), None, None
    return slice(len_q // 2, None), everything, None, None


def _merge(out, lse, rows, block_out, block_lse) -> None:
    """Adds a block's partial result to the running (out, lse) of ``rows`` (a slice: views),
    in place, with one temporary of the block's size (the same products and sum as
    ``old * a + block * b``)."""
    old_out, old_lse = out[:, :, rows], lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    finite = new_lse.masked_fill(torch.isinf(new_lse), 0.0)
    old_out.mul_(torch.exp(old_lse - finite).unsqueeze(-1))
    old_out.add_(block_out * torch.exp(block_lse - finite).unsqueeze(-1))
    old_lse.copy_(new_lse)


class _RingAttention(torch.autograd.Function):
    """p2p CP over bhsd tensors; ``plan(src)`` gives the (query rows, key rows, window, keep)
    of the block against the K/V of rank ``src``. The backward does not go through autograd of the forward
    (which would keep every K/V block and its scores): it recomputes each block from the
    saved LSE (``attend_backward``) while K/V and their dK/dV accumulators travel the ring."""

    @staticmethod
    def forward(ctx, q, k, v, scale, plan, ring):
        dtype = unfused.compute_dtype(q.dtype)
        out = q.new_zeros(q.shape[:3] + (v.shape[-1],), dtype=dtype)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=dtype)
        kv = (k, v)
        for step in range(ring.size):
            pending = ring.start_shift(kv) if step + 1 < ring.size else None
            rows, cols, window, keep = plan((ring.rank - step) % ring.size)
            block_out, block_lse = attend(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                          scale, 0, window, keep)
            _merge(out, lse, rows, block_out, block_lse)
            if pending is not None:
                kv = ring.finish_shift(pending)
        # the output in the input dtype is what the backward reads (half the memory of the
        # compute dtype's for fp16/bf16)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.plan, ctx.ring = scale, plan, ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        dtype = lse.dtype  # the compute dtype
        delta = (dout.to(dtype) * out.to(dtype)).sum(-1)
        dq = q.new_zeros(q.shape, dtype=dtype)
        kv = (k, v)
        dkv = (k.new_zeros(k.shape, dtype=dtype), v.new_zeros(v.shape, dtype=dtype))
        for step in range(ring.size):
            pending = ring.start_shift(kv) if step + 1 < ring.size else None
            rows, cols, window, keep = ctx.plan((ring.rank - step) % ring.size)
            block_dq, block_dk, block_dv = attend_backward(
                q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], dout[:, :, rows],
                lse[:, :, rows], delta[:, :, rows], scale, 0, window, out[:, :, rows], keep)
            dq[:, :, rows] += block_dq
            dkv[0][:, :, cols] += block_dk
            dkv[1][:, :, cols] += block_dv
            # The accumulators follow their K/V block; after the last step each has visited
            # every rank and this shift hands it to its owner.
            dkv = ring.finish_shift(ring.start_shift(dkv))
            if pending is not None:
                kv = ring.finish_shift(pending)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


class _AllToAll(torch.autograd.Function):
    """Splits ``x`` along ``scatter_dim`` over the ranks and concatenates what every rank
    sent along ``gather_dim``; the backward is the exchange the other way."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def _all_to_all(x, scatter_dim, gather_dim, group):
    inputs = [part.contiguous() for part in x.chunk(dist.get_world_size(group), scatter_dim)]
    outputs = [torch.empty_like(part) for part in inputs]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, gather_dim)


def _natural_order(cp_size: int, chunk: int, device) -> torch.Tensor:
    """Index that puts a sequence gathered in rank order (rank r: chunks r, 2c-1-r) into
    natural chunk order."""
    gathered_chunk = [2 * j if j < cp_size else 2 * (2 * cp_size - 1 - j) + 1
                      for j in range(2 * cp_size)]
    starts = torch.tensor(gathered_chunk, device=device) * chunk
    return (starts.unsqueeze(1) + torch.arange(chunk, device=device)).reshape(-1)


def _all_gather_attention(q, k, v, scale, window, group):
    """Gather K/V (natural order); each local query chunk attends at its global offset,
    over the keys its window can reach."""
    cp_size, cp_rank = size_and_rank(group)
    kv_chunk = k.shape[2] // 2
    order = _natural_order(cp_size, kv_chunk, k.device)
    kv = gather_along_dim(torch.cat([k, v], dim=-1), 2, group).index_select(2, order)
    k_all, v_all = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    q_chunk = q.shape[2] // 2
    outs = []
    for half, global_chunk in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        offset = global_chunk * q_chunk
        first, last = 0, k_all.shape[2]
        if window is not None and window[0] >= 0:
            first = max(0, offset - window[0])
        if window is not None and window[1] >= 0:
            last = min(last, offset + q_chunk + window[1])
        out, _ = attend(q[:, :, half * q_chunk:(half + 1) * q_chunk], k_all[:, :, first:last],
                        v_all[:, :, first:last], scale, offset - first, window)
        outs.append(out)
    return torch.cat(outs, dim=2)


def _thd_all_gather_attention(q, k, v, scale, window, q_side, kv_side, group):
    """thd all_gather: K/V gathered in rank order, each local query attends over the rows of
    its sequence that its window reaches (one masked block)."""
    cp_size, cp_rank = size_and_rank(group)
    kv = gather_along_dim(torch.cat([k, v], dim=-1), 2, group)
    k_all, v_all = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    gathered = [kv_side.positions(src) for src in range(cp_size)]
    kv_positions = tuple(torch.cat(parts) for parts in zip(*gathered))
    out, _ = attend(q, k_all, v_all, scale, keep=_thd_keep(q_side, kv_positions, cp_rank,
                                                            window))
    return out


def _a2a_attention(q, k, v, scale, window, group):
    """Ulysses: [b, h, s/c, d] -> [b, h/c, s, d] by all-to-all, attention over the whole
    sequence (natural order), and back."""
    cp_size, _ = size_and_rank(group)
    order = _natural_order(cp_size, q.shape[2] // 2, q.device)
    kv_order = _natural_order(cp_size, k.shape[2] // 2, k.device)
    q_all = _AllToAll.apply(q, 1, 2, group).index_select(2, order)
    k_all = _AllToAll.apply(k, 1, 2, group).index_select(2, kv_order)
    v_all = _AllToAll.apply(v, 1, 2, group).index_select(2, kv_order)
    out, _ = attend(q_all, k_all, v_all, scale, 0, window)
    out = out.index_select(2, torch.argsort(order))  # back to the gathered (rank) order
    return _AllToAll.apply(out, 2, 1, group)


# ----------------------------------------------------------------------------- entry point

def _check_common(module, q, k, v, fmt, refused) -> None:
    """The checks of every CP call: refused arguments, module settings, tensor shapes."""
    for name, value in refused.items():  # None = not given (or at its neutral value)
        if value is not None:
            shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
            raise ValueError(f"{name} ({shown}) is not supported with context parallelism")
    if module.softmax_type != "vanilla" or module.return_max_logit:
        raise ValueError(f"softmax_type={module.softmax_type!r} / return_max_logit="
                         f"{module.return_max_logit} are not supported with context "
                         f"parallelism; use softmax_type='vanilla', return_max_logit=False")
    if module.training and module.attention_dropout > 0.0:
        raise ValueError(f"attention_dropout={module.attention_dropout} in training is not "
                         f"supported with context parallelism; use 0.0 (or eval mode)")
    layout.validate_qkv(q, k, v, fmt, fmt, module.num_attention_heads,
                        module.num_gqa_groups, module.head_dim_qk, module.head_dim_v)


def check_thd_call(module, q, k, v, mask_type, window, cp_size, cu_seqlens,
                   refused) -> Tuple[_ThdSide, _ThdSide]:
    """Everything a thd CP call needs (TE's global cu_seqlens and cu_seqlens_*_padded),
    checked on this rank before any communication; returns the (q, kv) sides."""
    comm = module.cp_comm_type
    if comm not in ("p2p", "all_gather"):
        raise ValueError(f"qkv_format='thd' with cp_comm_type={comm!r} is not supported; use "
                         f"'p2p' or 'all_gather'")
    if mask_type not in _THD_MASK_TYPES:
        raise ValueError(f"attn_mask_type={mask_type!r} with context parallelism is not "
                         f"supported; use one of {_THD_MASK_TYPES}")
    _check_common(module, q, k, v, "thd", refused)
    cu_q, cu_kv, padded_q, padded_kv = cu_seqlens
    sides, batch = [], None
    for name, cu, padded, t in (("cu_seqlens_q", cu_q, padded_q, q),
                                ("cu_seqlens_kv", cu_kv, padded_kv, k)):
        batch = padding.check_cu_seqlens(cu, name, batch, None, q.device)
        if padded is None:
            padded = cu  # TE: no padding between sequences
        padding.check_cu_seqlens(padded, f"{name}_padded", batch, None, q.device)
        lengths, padded_lengths = cu.diff(), padded.diff()
        if bool((padded_lengths % (2 * cp_size) != 0).any()):
            raise ValueError(f"{name}_padded (or {name} without it) must give every sequence "
                             f"a length divisible by 2 * cp_size = {2 * cp_size}, got lengths "
                             f"{padded_lengths.tolist()}")
        if bool((lengths > padded_lengths).any()):
            raise ValueError(f"{name} has a sequence longer than its padded length in "
                             f"{name}_padded: {lengths.tolist()} > {padded_lengths.tolist()}")
        local = int(padded[-1]) // cp_size
        if local > t.shape[0]:
            raise ValueError(f"{name}_padded needs {local} tokens on each rank "
                             f"(cu_seqlens_padded[-1] / cp_size), the tensor has {t.shape[0]}")
        sides.append(_ThdSide(cu, padded, cp_size, t.shape[0]))
    if "causal" in mask_type and not (torch.equal(sides[0].lengths, sides[1].lengths)
                                      and torch.equal(sides[0].starts, sides[1].starts)):
        raise ValueError("causal thd attention with context parallelism needs the same "
                         "cu_seqlens (and cu_seqlens_padded) for q and kv")
    if window not in ((-1, -1), (-1, 0)) and comm == "p2p":
        raise ValueError(f"window_size={window} with cp_comm_type='p2p' is not supported (as "
                         f"in TE); use cp_comm_type='all_gather'")
    return sides[0], sides[1]


def check_call(module, q, k, v, qkv_format, mask_type, window, cp_size,
               refused) -> Tuple[str, Tuple[int, int]]:
    """Everything a bshd/sbhd CP call needs, checked on this rank before any communication."""
    comm = module.cp_comm_type
    q_format, kv_format = layout.split_qkv_format(qkv_format)
    if q_format != kv_format or q_format not in _FORMATS:
        raise ValueError(f"qkv_format={qkv_format!r} with context parallelism is not supported "
                         f"yet; use one of {_FORMATS + ('thd',)}")
    if mask_type not in _MASK_TYPES:
        raise ValueError(f"attn_mask_type={mask_type!r} with context parallelism is not "
                         f"supported; use one of {_MASK_TYPES}")
    _check_common(module, q, k, v, q_format, refused)
    len_q, _ = layout.seq_batch_of(q, q_format)
    len_kv, _ = layout.seq_batch_of(k, kv_format)
    for name, length in (("query_layer", len_q), ("key_layer", len_kv)):
        if length % 2:
            raise ValueError(f"{name} has {length} tokens on this rank: context parallelism "
                             f"needs the full sequence ({length} * cp_size) divisible by "
                             f"2 * cp_size = {2 * cp_size}, each rank holding 2 chunks")
    if mask_type == "causal" and len_q != len_kv:
        raise ValueError(f"causal attention with context parallelism needs as many queries "
                         f"as keys per rank, got {len_q} and {len_kv}")
    sliding = window not in ((-1, -1), (-1, 0))
    if sliding and comm == "p2p":
        raise ValueError(f"window_size={window} with cp_comm_type='p2p' is not supported (as "
                         f"in TE); use cp_comm_type='all_gather' or 'a2a'")
    if sliding and len_q != len_kv:
        raise ValueError(f"window_size={window} with context parallelism needs as many "
                         f"queries as keys per rank, got {len_q} and {len_kv}")
    if comm == "a2a":
        for name, heads in (("num_attention_heads", module.num_attention_heads),
                            ("num_gqa_groups", module.num_gqa_groups)):
            if heads % cp_size:
                raise ValueError(f"cp_comm_type='a2a' needs {name}={heads} divisible by "
                                 f"cp_size={cp_size}")
    return comm, window


def attention(module, q, k, v, qkv_format: str, mask_type: str, window, refused: dict,
              cu_seqlens=(None, None, None, None)):
    """DotProductAttention's forward under CP: q, k, v are this rank's load-balanced part of
    the sequences; returns this rank's part of the output (same order), heads merged.
    ``cu_seqlens``: (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    as given (TE's global ones), read by thd only."""
    cp_size, cp_rank = size_and_rank(module.cp_group)
    mask_type = masks.normalize_mask_type(mask_type)
    window = masks.check_set_window_size(mask_type, window)
    comm = module.cp_comm_type
    scale = module.softmax_scale
    if qkv_format == "thd":
        q_side, kv_side = check_thd_call(module, q, k, v, mask_type, window, cp_size,
                                         cu_seqlens, refused)
        logger.debug("Context parallelism: cp_comm_type=%s, cp_size=%d, thd, %s (PyTorch "
                     "math, masked per sequence)", comm, cp_size, mask_type)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, h, t, d]
        no_window = None if window == (-1, -1) else window
        if comm == "p2p":
            ring = _Ring(module.cp_group, module.cp_global_ranks)
            out = _RingAttention.apply(q, k, v, scale,
                                       _thd_ring_plan(q_side, kv_side, cp_rank, no_window), ring)
        else:
            out = _thd_all_gather_attention(q, k, v, scale, no_window, q_side, kv_side,
                                            module.cp_group)
        out = out.to(q.dtype)[0].transpose(0, 1)
        return out.reshape(out.shape[0], -1)
    refused = dict(refused, **dict(zip(("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                                        "cu_seqlens_kv_padded"), cu_seqlens)))
    comm, window = check_call(module, q, k, v, qkv_format, mask_type, window, cp_size, refused)
    logger.debug("Context parallelism: cp_comm_type=%s, cp_size=%d, %s, %s",
                 comm, cp_size, qkv_format, mask_type)
    fmt = qkv_format
    q, k, v = (unfused._to_bhsd(t, fmt, None, 0) for t in (q, k, v))
    no_window = None if window == (-1, -1) else window
    if comm == "p2p":
        ring = _Ring(module.cp_group, module.cp_global_ranks)
        causal = mask_type == "causal"
        len_q, len_kv = q.shape[2], k.shape[2]
        out = _RingAttention.apply(
            q, k, v, scale, lambda src: _ring_block(src, cp_rank, causal, len_q, len_kv), ring)
    elif comm == "all_gather":
        out = _all_gather_attention(q, k, v, scale, no_window, module.cp_group)
    else:
        out = _a2a_attention(q, k, v, scale, no_window, module.cp_group)
    return unfused._from_bhsd(out.to(q.dtype), fmt, None, None)
