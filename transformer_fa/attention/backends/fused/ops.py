"""Forward and backward on tensors (shared by the eager path and the torch.library ops), the
eager autograd.Function, and the ops ``transformer_fa::fused_attn_fwd`` / ``fused_attn_bwd``
(fake and autograd registrations) that torch.compile traces."""
from __future__ import annotations

from typing import Optional

import torch

from ..support import aligned, fresh, grads_like, op_schema, packed_extent, strides_aligned
from . import graph
from .plans import CACHE, CONTIGUOUS
from .spec import FusedCall, bwd_spec, fwd_spec

# Eager backward: dq, dk, dv of a packed q, k, v as views of one buffer.
SHARED_GRADS = True


def _prepare_bias(bias: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    if bias is None:
        return None
    if bias.dtype != dtype:
        bias = bias.to(dtype)
    if not aligned(bias):
        bias = fresh(bias)
    return bias


def _tensors_key(call: FusedCall, q, k, v, bias, cu_q) -> tuple:
    """What a graph depends on besides call: shapes and strides (thd shapes leave out t, so a
    graph serves every token count), dtype, device, the bias's layout, the batch size."""
    thd_q, thd_kv = call.q_format == "thd", call.kv_format == "thd"
    return (call, q.shape[1:] if thd_q else q.shape, q.stride(),
            k.shape[1:] if thd_kv else k.shape, k.stride(),
            v.shape[1:] if thd_kv else v.shape, v.stride(), q.dtype, q.device.index,
            None if bias is None else (bias.shape, bias.stride()),
            None if cu_q is None else cu_q.shape[0])


def fwd_impl(q, k, v, bias, cu_q, cu_kv, rng, call: FusedCall):
    """(out [*q.shape[:-1], dv] in q's format, stats float32 or an empty tensor)."""
    out, stats, _ = fwd_core(q, k, v, bias, cu_q, cu_kv, rng, call)
    return out, stats if stats is not None else out.new_empty((0,), dtype=torch.float32)


def fwd_core(q, k, v, bias, cu_q, cu_kv, rng, call: FusedCall):
    """(out, stats or None where call.return_stats is not set, key): key identifies q, k, v,
    bias and call, or is None when the call ran on copies (misaligned or refused strides)."""
    if bias is not None:
        bias = _prepare_bias(bias, q.dtype)
    key = _tensors_key(call, q, k, v, bias, cu_q)
    plan = CACHE.plan(CACHE.forward, key, lambda: fwd_spec(call, q, k, v, bias, cu_q), (q, k, v))
    if plan is CONTIGUOUS or (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        out, stats, _ = fwd_core(fresh(q), fresh(k), fresh(v), bias, cu_q, cu_kv, rng, call)
        return out, stats, None

    spec = plan.spec
    dev = q.device
    alloc = torch.zeros if plan.zero else torch.empty
    out = alloc((*q.shape[:-1], spec.dv), dtype=q.dtype, device=dev)
    pack = {graph.Q: q.data_ptr(), graph.K: k.data_ptr(), graph.V: v.data_ptr(),
            graph.O: out.data_ptr()}
    stats = None
    if spec.stats is not None:
        shape = (q.shape[0], spec.hq, 1) if spec.ragged_q else (spec.b, spec.hq, spec.sq, 1)
        stats = torch.empty(shape, dtype=torch.float32, device=dev)
        pack[graph.STATS] = stats.data_ptr()
    if bias is not None:
        pack[graph.BIAS] = bias.data_ptr()
    if spec.dropout > 0.0:
        pack[graph.SEED] = rng.data_ptr()
        pack[graph.OFFSET] = rng.data_ptr() + 8
    plan.run(pack, cu_q, cu_kv, dev)
    return out, stats, key


def bwd_impl(dout, q, k, v, out, stats, bias, cu_q, cu_kv, rng, call: FusedCall,
             need_dbias: bool, fwd_key=None, shared_grads=False):
    """(dq, dk, dv, dbias or None). fwd_key: the forward's key for these q, k, v, bias.
    shared_grads: dq, dk, dv may be views of one buffer (not for the torch.library op, whose
    outputs must not alias): laid out as q, k, v are where those tile one buffer (a packed
    layout), so that the split before the attention takes them without a copy."""
    dout_stride = dout.stride()
    if (dout_stride != out.stride() and not strides_aligned(dout)) or dout.data_ptr() & 15:
        dout = fresh(dout)
        dout_stride = dout.stride()
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        q, k, v = fresh(q), fresh(k), fresh(v)
        fwd_key = None
    if bias is not None:
        bias = _prepare_bias(bias, q.dtype)
    if fwd_key is None:
        fwd_key = _tensors_key(call, q, k, v, bias, cu_q)
    extent = packed_extent((q, k, v)) if shared_grads else None
    packed = extent is not None
    plan = CACHE.plan(CACHE.backward, (fwd_key, dout_stride, need_dbias, packed),
                      lambda: bwd_spec(call, q, k, v, bias, cu_q, dout, need_dbias, packed),
                      (q, k, v, dout))
    if plan is CONTIGUOUS:
        return bwd_impl(fresh(dout), fresh(q), fresh(k), fresh(v), out, stats, bias,
                        cu_q, cu_kv, rng, call, need_dbias, None, shared_grads)
    spec = plan.spec
    dq, dk, dv = grads_like((q, k, v), torch.zeros if plan.zero else torch.empty, extent)
    pack = {graph.Q: q.data_ptr(), graph.K: k.data_ptr(), graph.V: v.data_ptr(),
            graph.O: out.data_ptr(), graph.DO: dout.data_ptr(), graph.STATS: stats.data_ptr(),
            graph.DQ: dq.data_ptr(), graph.DK: dk.data_ptr(), graph.DV: dv.data_ptr()}
    dbias = None
    if bias is not None:
        pack[graph.BIAS] = bias.data_ptr()
        if need_dbias:
            dbias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device)
            pack[graph.DBIAS] = dbias.data_ptr()
    if spec.dropout > 0.0:
        pack[graph.SEED] = rng.data_ptr()
        pack[graph.OFFSET] = rng.data_ptr() + 8
    plan.run(pack, cu_q, cu_kv, q.device)
    return dq, dk, dv, dbias


# --------------------------------------------------------------------------------------------
# Autograd: eager (autograd.Function) and torch.library custom ops (torch.compile)
# --------------------------------------------------------------------------------------------
# Both save (q, k, v, out, stats, bias, cu_q, cu_kv, rng) and the FusedCall.
class FusedAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, cu_q, cu_kv, rng, call):
        out, stats, key = fwd_core(q, k, v, bias, cu_q, cu_kv, rng, call)
        ctx.save_for_backward(q, k, v, out, stats, bias, cu_q, cu_kv, rng)
        ctx.call = call
        ctx.key = key
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, stats, bias, cu_q, cu_kv, rng = ctx.saved_tensors
        need_dbias = bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias = bwd_impl(dout, q, k, v, out, stats, bias, cu_q, cu_kv, rng,
                                     ctx.call, need_dbias, ctx.key, SHARED_GRADS)
        if dbias is not None and dbias.dtype != bias.dtype:
            dbias = dbias.to(bias.dtype)
        return dq, dk, dv, dbias, None, None, None, None


def _stats_shape(q_format: str, q: torch.Tensor):
    if q_format == "thd":
        return (q.shape[0], q.shape[1], 1)
    b, sq = (q.shape[1], q.shape[0]) if q_format == "sbhd" else (q.shape[0], q.shape[1])
    return (b, q.shape[-2], sq, 1)


_OPTIONAL_TENSORS = "Tensor? bias, Tensor? cu_seqlens_q, Tensor? cu_seqlens_kv, Tensor? rng_state"
FWD_SCHEMA = op_schema(FusedCall, f"Tensor q, Tensor k, Tensor v, {_OPTIONAL_TENSORS}",
                       "(Tensor, Tensor)")
BWD_SCHEMA = op_schema(FusedCall, "Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                       f"Tensor stats, {_OPTIONAL_TENSORS}", "(Tensor, Tensor, Tensor, Tensor)",
                       extra="bool need_dbias")
_FWD_TENSORS = 7  # the fwd op's tensor arguments, before the FusedCall's fields


def register_ops() -> None:
    try:
        torch.ops.transformer_fa.fused_attn_fwd  # noqa: B018  (already registered: a reload)
        return
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("transformer_fa::fused_attn_fwd", mutates_args=(),
                             device_types="cuda", schema=FWD_SCHEMA)
    def fused_attn_fwd(q, k, v, bias, cu_q, cu_kv, rng, *call):
        return fwd_impl(q, k, v, bias, cu_q, cu_kv, rng, FusedCall._make(call))

    @fused_attn_fwd.register_fake
    def _(q, k, v, bias, cu_q, cu_kv, rng, *call):
        call = FusedCall._make(call)
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        shape = _stats_shape(call.q_format, q) if call.return_stats else (0,)
        return out, q.new_empty(shape, dtype=torch.float32)

    @torch.library.custom_op("transformer_fa::fused_attn_bwd", mutates_args=(),
                             device_types="cuda", schema=BWD_SCHEMA)
    def fused_attn_bwd(dout, q, k, v, out, stats, bias, cu_q, cu_kv, rng, *call_and_need_dbias):
        *call, need_dbias = call_and_need_dbias
        dq, dk, dv, dbias = bwd_impl(dout, q, k, v, out, stats, bias, cu_q, cu_kv, rng,
                                     FusedCall._make(call), need_dbias)
        if dbias is None:
            dbias = q.new_empty((0,))
        elif dbias.dtype != bias.dtype:
            dbias = dbias.to(bias.dtype)
        return dq, dk, dv, dbias

    @fused_attn_bwd.register_fake
    def _(dout, q, k, v, out, stats, bias, cu_q, cu_kv, rng, *call_and_need_dbias):
        need_dbias = call_and_need_dbias[-1]
        dbias = bias.new_empty(bias.shape) if need_dbias else q.new_empty((0,))
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias

    def setup_context(ctx, inputs, output):
        q, k, v, bias, cu_q, cu_kv, rng = inputs[:_FWD_TENSORS]
        out, stats = output
        ctx.save_for_backward(q, k, v, out, stats, bias, cu_q, cu_kv, rng)
        ctx.call = FusedCall._make(inputs[_FWD_TENSORS:])

    def backward(ctx, dout, dstats):
        q, k, v, out, stats, bias, cu_q, cu_kv, rng = ctx.saved_tensors
        need_dbias = bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias = torch.ops.transformer_fa.fused_attn_bwd(
            dout, q, k, v, out, stats, bias, cu_q, cu_kv, rng, *ctx.call, need_dbias)
        return ((dq, dk, dv, dbias if need_dbias else None)
                + (None,) * (_FWD_TENSORS - 4 + len(ctx.call)))

    torch.library.register_autograd("transformer_fa::fused_attn_fwd", backward,
                                    setup_context=setup_context)
