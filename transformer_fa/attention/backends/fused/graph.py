"""The cuDNN SDPA graphs (forward and backward) for a Spec."""
from __future__ import annotations

from . import cudnn_lib
from .spec import Spec

# Tensor uids in the graphs.
Q, K, V, O, STATS, BIAS, SEQ_Q, SEQ_KV, SEED, OFFSET = range(1, 11)
DO, DQ, DK, DV, DBIAS = range(11, 16)
RAGGED_Q_BASE, RAGGED_KV_BASE = 20, 40  # + index of the token stride (one offset per stride)


def ragged_strides(spec: Spec):
    """Unique token strides needing a ragged offset, per side: (q side, kv side)."""
    q_side, kv_side = [], []
    if spec.ragged_q:
        for t in (spec.q, spec.o, spec.stats) + ((spec.do, spec.dq) if spec.backward else ()):
            if t is not None and t[2] not in q_side:  # stats None: inference
                q_side.append(t[2])
    if spec.ragged_kv:
        for t in (spec.k, spec.v) + ((spec.dk, spec.dv_) if spec.backward else ()):
            if t[2] not in kv_side:
                kv_side.append(t[2])
    return tuple(q_side), tuple(kv_side)


def make_graph(spec: Spec, handle):
    """A cudnn pygraph for spec, validated and with execution plans (not built)."""
    cudnn = cudnn_lib.get()
    dt = cudnn_lib.data_type(spec.dtype)
    f32, i32, i64 = cudnn.data_type.FLOAT, cudnn.data_type.INT32, cudnn.data_type.INT64
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=f32, compute_data_type=f32,
                      handle=handle)
    b, hq, hkv, sq, skv = spec.b, spec.hq, spec.hkv, spec.sq, spec.skv

    def t(uid, dims, strides, dtype=dt):
        return g.tensor(dim=list(dims), stride=list(strides), data_type=dtype, uid=uid,
                        name=f"t{uid}")

    q = t(Q, (b, hq, sq, spec.dqk), spec.q)
    k = t(K, (b, hkv, skv, spec.dqk), spec.k)
    v = t(V, (b, hkv, skv, spec.dv), spec.v)
    q_strides, kv_strides = ragged_strides(spec)
    q_off = {s: t(RAGGED_Q_BASE + i, (b + 1, 1, 1, 1), (1, 1, 1, 1), i64)
             for i, s in enumerate(q_strides)}
    kv_off = {s: t(RAGGED_KV_BASE + i, (b + 1, 1, 1, 1), (1, 1, 1, 1), i64)
              for i, s in enumerate(kv_strides)}

    def ragged(tensor, strides, offsets):
        if offsets:
            tensor.set_ragged_offset(offsets[strides[2]])

    ragged(q, spec.q, q_off)
    ragged(k, spec.k, kv_off)
    ragged(v, spec.v, kv_off)

    kw = {"attn_scale": spec.scale}
    if spec.padding:
        kw["use_padding_mask"] = True
        kw["seq_len_q"] = t(SEQ_Q, (b, 1, 1, 1), (1, 1, 1, 1), i32)
        kw["seq_len_kv"] = t(SEQ_KV, (b, 1, 1, 1), (1, 1, 1, 1), i32)
    if spec.left_bound is not None or spec.right_bound is not None:
        kw["diagonal_alignment"] = (cudnn.diagonal_alignment.TOP_LEFT if spec.top_left
                                    else cudnn.diagonal_alignment.BOTTOM_RIGHT)
        if spec.left_bound is not None:
            kw["diagonal_band_left_bound"] = spec.left_bound
        if spec.right_bound is not None:
            kw["diagonal_band_right_bound"] = spec.right_bound
    if spec.bias is not None:
        kw["bias"] = t(BIAS, spec.bias[0], spec.bias[1])
    if spec.dropout > 0.0:
        seed = t(SEED, (1, 1, 1, 1), (1, 1, 1, 1), i64)
        offset = t(OFFSET, (1, 1, 1, 1), (1, 1, 1, 1), i64)
        kw["dropout"] = (spec.dropout, seed, offset)

    if not spec.backward:
        stats_needed = spec.stats is not None
        o, stats = g.sdpa(q, k, v, generate_stats=stats_needed, name="sdpa", **kw)
        o.set_uid(O).set_output(True).set_dim([b, hq, sq, spec.dv]).set_stride(list(spec.o))
        ragged(o, spec.o, q_off)
        if stats_needed:
            stats.set_uid(STATS).set_output(True).set_data_type(f32)
            stats.set_dim([b, hq, sq, 1]).set_stride(list(spec.stats))
            ragged(stats, spec.stats, q_off)
    else:
        o = t(O, (b, hq, sq, spec.dv), spec.o)
        do = t(DO, (b, hq, sq, spec.dv), spec.do)
        stats = t(STATS, (b, hq, sq, 1), spec.stats, f32)
        for x, st in ((o, spec.o), (do, spec.do), (stats, spec.stats)):
            ragged(x, st, q_off)
        if spec.dbias:
            kw["dBias"] = t(DBIAS, spec.bias[0], spec.bias[1])
        kw["use_deterministic_algorithm"] = bool(spec.deterministic)
        dq, dk, dv = g.sdpa_backward(q, k, v, o, do, stats, name="sdpa_backward", **kw)
        for x, uid, dims, st, offs in (
                (dq, DQ, (b, hq, sq, spec.dqk), spec.dq, q_off),
                (dk, DK, (b, hkv, skv, spec.dqk), spec.dk, kv_off),
                (dv, DV, (b, hkv, skv, spec.dv), spec.dv_, kv_off)):
            x.set_uid(uid).set_output(True).set_dim(list(dims)).set_stride(list(st))
            ragged(x, st, offs)

    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    # cuDNN's own engines only, not cudnn-frontend's JIT-compiled python engines (FROST),
    # which it may rank first where their optional dependencies are installed.
    python_engines = ("sdpa_fwd_", "sdpa_bwd_")
    g.deselect_engines(list(python_engines))
    for index in range(g.get_execution_plan_count()):
        if not g.get_plan_name_at_index(index).startswith(python_engines):
            if index:
                g.select_plan(index)
            break
    else:
        raise RuntimeError("cuDNN offered no engine of its own for this graph")
    g.check_support()
    return g

