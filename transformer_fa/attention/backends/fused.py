"""FusedAttention: cuDNN's fused SDPA through cudnn-frontend's Python graph API.

pip package ``nvidia-cudnn-frontend`` (``import cudnn``), an optional extra.

How a call runs
- q, k, v go to cuDNN as logical ``(b, h, s, d)`` tensors with their real strides: every
  sbhd/bshd layout, packed ``sb3hd``-style views and GQA split views go in as they are, no
  copies. thd tensors are ragged: cuDNN gets ``(b, h, max_s, d)`` plus a ragged-offset tensor
  built from cu_seqlens (``cu_seqlens * token_stride``) and the padding-mask sequence lengths
  it requires. Padding masks on sbhd/bshd use sequence-length tensors.
- Masks (TE semantics) map to cuDNN's diagonal band: ``left_bound = left + 1``,
  ``right_bound = right`` (causal: 0); top-left alignment for "causal"/"padding_causal",
  bottom-right (per-sequence actual lengths) for every other type. ALiBi becomes a
  post-scale bias ``-slope * |i + off - j|`` less its row maximum, in the input dtype.
- Graphs are cached (LRU) by a key made of the call's scalars and the tensors' shapes and
  strides, so a configuration is built once per process; the build time goes to the debug
  log. Graphs run on torch's current stream, with their workspace from torch's allocator
  (small workspaces are kept per stream and reused).
- ``not_supported_reasons`` asks cuDNN itself (validate + check_support, no plan build) about
  a graph described from the params with the layout's contiguous strides; the answer is
  cached, and a rejection becomes a reason, never an exception.
- The ops are registered with torch.library (``transformer_fa::fused_attn_fwd`` and
  ``transformer_fa::fused_attn_bwd``, with fake and autograd registrations) and torch.compile
  traces through them. In eager mode the same implementations run under a thin
  autograd.Function, which costs less host time than the dispatcher path.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import gc
import logging
import time
from typing import Dict, List, Optional, Tuple

import torch

from .. import masks, padding
from ..params import AttentionInputs, AttentionParams
from .support import aligned, dropout_rng_state, fresh, never_raises, strides_aligned

NAME = "FusedAttention"
logger = logging.getLogger("DotProductAttention")

# What the GPU tests (tests/gpu/test_fused.py) cover, and so what is claimed.
MIN_CUDNN_VERSION = (9, 19, 0)  # the version the GPU tests ran on
SUPPORTED_ARCH_MAJORS = (9,)  # Hopper: the tests ran on an H100; Ampere is not tested yet
SUPPORTED_HEAD_DIMS = {(d, d) for d in (32, 64, 80, 96, 128, 160, 192, 256)} | {(192, 128)}
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
CACHE_SIZE = 256  # graphs kept per direction (forward, backward)
_THD_SEQLEN_BUCKET = 128  # thd max_seqlen is rounded up to this, so varlen batches share graphs

# Set to False to execute through the public ``pygraph.execute`` instead of the backend
# graph's own execute (same plan, more host time); the GPU tests compare the two.
FAST_EXECUTE = True
# Eager backward: dq, dk, dv of one shape from one allocation.
SHARED_GRADS = True

# Tensor uids in the cuDNN graphs.
_Q, _K, _V, _O, _STATS, _BIAS, _SEQ_Q, _SEQ_KV, _SEED, _OFFSET = range(1, 11)
_DO, _DQ, _DK, _DV, _DBIAS = range(11, 16)
_RAGGED_Q_BASE, _RAGGED_KV_BASE = 20, 40  # + index of the token stride (one offset per stride)

# --------------------------------------------------------------------------------------------
# cudnn-frontend: import, versions, handles
# --------------------------------------------------------------------------------------------
_cudnn = None
_import_error: Optional[str] = None


def _get_cudnn():
    """The cudnn module, or None (``_import_error`` says why)."""
    global _cudnn, _import_error
    if _cudnn is None and _import_error is None:
        try:
            import cudnn  # noqa: F401

            _cudnn = cudnn
        except Exception as exc:  # ImportError, or a broken install raising anything
            _import_error = f"{type(exc).__name__}: {exc}"
    return _cudnn


def _backend_version() -> Optional[Tuple[int, int, int]]:
    cudnn = _get_cudnn()
    if cudnn is None:
        return None
    try:
        v = int(cudnn.backend_version())
    except Exception:
        return None
    # cuDNN 9 encodes major * 10000 + minor * 100 + patch.
    return (v // 10000, (v % 10000) // 100, v % 100)


def versions() -> Dict[str, str]:
    """cuDNN backend and frontend versions, for the ``Running with config=...`` log line."""
    cudnn = _get_cudnn()
    if cudnn is None:
        return {}
    out = {"cudnn_frontend_version": str(getattr(cudnn, "__version__", "unknown"))}
    ver = _backend_version()
    if ver is not None:
        out["cudnn_backend_version"] = ".".join(map(str, ver))
    return out


_handles: Dict[int, object] = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device_index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _handle(device_index: int, stream: Optional[int] = None):
    """The cuDNN handle of a device, set to torch's current stream there."""
    handle = _handles.get(device_index)
    if handle is None:
        with torch.cuda.device(device_index):
            handle = _cudnn.create_handle()
        _handles[device_index] = handle
    _cudnn.set_stream(handle, _current_stream(device_index) if stream is None else stream)
    return handle


# Small workspaces are kept per (device, stream) and reused: launches on one stream run in
# order, so a buffer is free again for the next launch there. Large ones come from torch's
# allocator each call (their kernels take long enough for the allocation not to matter).
_WORKSPACE_KEEP_MAX = 8 << 20
_workspaces: Dict[Tuple[int, int], torch.Tensor] = {}


def _workspace(size: int, device_index: int, stream: int) -> torch.Tensor:
    if size > _WORKSPACE_KEEP_MAX or torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", device_index))
    key = (device_index, stream)
    ws = _workspaces.get(key)
    if ws is None or ws.numel() < size:
        ws = torch.empty(max(size, 1 << 16), dtype=torch.uint8,
                         device=torch.device("cuda", device_index))
        _workspaces[key] = ws
    return ws


def _data_type(dtype: torch.dtype):
    return _cudnn.data_type.HALF if dtype == torch.float16 else _cudnn.data_type.BFLOAT16


# --------------------------------------------------------------------------------------------
# Graph descriptions
# --------------------------------------------------------------------------------------------
_SPEC_FIELDS = (
    "dtype", "b", "hq", "hkv", "sq", "skv", "dqk", "dv",
    "q", "k", "v", "o", "stats",            # (b, h, s, d) strides; stats None = inference
    "ragged_q", "ragged_kv", "padding",
    "top_left", "left_bound", "right_bound", "scale", "dropout",
    "bias",                                  # None or (dims, strides)
    "backward", "do", "dq", "dk", "dv_", "dbias", "deterministic")
# Everything a cuDNN graph depends on. Built from tensors in run() on a cache miss, or from
# params (with the layout's contiguous strides) for the support check.
_Spec = collections.namedtuple("_Spec", _SPEC_FIELDS, defaults=(None,) * len(_SPEC_FIELDS))


def _bhsd_strides(fmt: str, stride: Tuple[int, ...], max_s: int) -> Tuple[int, int, int, int]:
    """Strides of a tensor in ``fmt`` as cuDNN's logical (b, h, s, d)."""
    if fmt == "sbhd":
        return (stride[1], stride[2], stride[0], stride[3])
    if fmt == "bshd":
        return (stride[0], stride[2], stride[1], stride[3])
    # thd: [t, h, d]; batches start at ragged offsets, the b stride is nominal.
    return (max_s * stride[0], stride[1], stride[0], stride[2])


def _contiguous_stride(shape) -> Tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _format_shape(fmt: str, b: int, s: int, h: int, d: int, t: Optional[int] = None):
    if fmt == "sbhd":
        return (s, b, h, d)
    if fmt == "bshd":
        return (b, s, h, d)
    return (t if t is not None else b * s, h, d)


def _mask_band(mask_type: str, window: Tuple[int, int], same_lengths: bool):
    """(top_left, left_bound, right_bound) for cuDNN's diagonal band (TE semantics)."""
    left, right = window
    if "causal" in mask_type:
        right = 0
    left_bound = left + 1 if left >= 0 else None
    right_bound = right if right >= 0 else None
    top_left = mask_type in ("causal", "padding_causal")
    if left_bound is None and right_bound is None:
        top_left = True  # no band: the alignment means nothing
    elif same_lengths:
        top_left = True  # sq == skv in every sequence: both alignments coincide
    return top_left, left_bound, right_bound


def _layout_strides(params: AttentionParams):
    """Contiguous strides of q, k, v for params.qkv_layout, as (b, h, s, d), with the
    token (s) stride. Packed layouts (``sb3hd``, ``bshd_bs2hd``, ...) interleave as TE's."""
    p = params
    b, sq, skv = p.batch_size, p.max_seqlen_q, p.max_seqlen_kv
    parts = p.qkv_layout.split("_")
    dims = {"q": (p.q_format, sq, p.num_heads, p.head_dim_qk),
            "k": (p.kv_format, skv, p.num_gqa_groups, p.head_dim_qk),
            "v": (p.kv_format, skv, p.num_gqa_groups, p.head_dim_v)}

    def packed(names, part):
        # part like "sb3hd", "bsh2d", "t3hd", "th2d": a buffer with an extra dim of len(names)
        n = len(names)
        fmt, s, h, d = dims[names[0]]
        if any(dims[x][2:] != (h, d) for x in names):
            raise ValueError("packed tensors differ in heads or head dim")
        heads_first = f"h{n}d" in part
        shape = list(_format_shape(fmt, b, s, h, d))
        hdim = len(shape) - 2  # index of h
        shape.insert(hdim + 1 if heads_first else hdim, n)
        st = _contiguous_stride(shape)
        k_dim = hdim + 1 if heads_first else hdim
        plain = tuple(x for i, x in enumerate(st) if i != k_dim)
        return {x: _bhsd_strides(fmt, plain, s) for x in names}

    def plain(name):
        fmt, s, h, d = dims[name]
        st = _contiguous_stride(_format_shape(fmt, b, s, h, d))
        return {name: _bhsd_strides(fmt, st, s)}

    out = {}
    try:
        if len(parts) == 1:
            out.update(packed(("q", "k", "v"), parts[0]))
        elif len(parts) == 2:
            out.update(plain("q"))
            out.update(packed(("k", "v"), parts[1]))
        else:
            for x in "qkv":
                out.update(plain(x))
    except Exception:
        out = {}
        for x in "qkv":
            out.update(plain(x))
    return out["q"], out["k"], out["v"]


def _alibi_bias_dims(params: AttentionParams) -> Tuple[int, int, int, int]:
    p = params
    per_batch = (p.alibi_slopes_shape is not None and len(p.alibi_slopes_shape) == 2) or (
        p.is_padding and p.attn_mask_type not in ("causal", "padding_causal"))
    return (p.batch_size if per_batch else 1, p.num_heads, p.max_seqlen_q, p.max_seqlen_kv)


def _bucket(n: int) -> int:
    return -(-n // _THD_SEQLEN_BUCKET) * _THD_SEQLEN_BUCKET


def _spec_from_params(params: AttentionParams, backward: bool) -> _Spec:
    """The graph a call described by params would build, with the layout's contiguous strides."""
    p = params
    b, hq, hkv = p.batch_size, p.num_heads, p.num_gqa_groups
    ragged_q, ragged_kv = p.q_format == "thd", p.kv_format == "thd"
    sq = _bucket(p.max_seqlen_q) if ragged_q else p.max_seqlen_q
    skv = _bucket(p.max_seqlen_kv) if ragged_kv else p.max_seqlen_kv
    q, k, v = _layout_strides(dataclasses.replace(p, max_seqlen_q=sq, max_seqlen_kv=skv))
    o = _bhsd_strides(p.q_format, _contiguous_stride(_format_shape(p.q_format, b, sq, hq,
                                                                   p.head_dim_v)), sq)
    stats = _stats_strides(ragged_q, b, hq, sq)
    top_left, lb, rb = _mask_band(p.attn_mask_type, p.window_size,
                                  sq == skv and not p.is_varlen)
    bias = None
    if p.core_attention_bias_type == "post_scale_bias":
        bias = _bias_dims(p.core_attention_bias_shape, b, hq, sq, skv)
    elif p.core_attention_bias_type == "alibi":
        bias = _alibi_bias_dims(p)
    if bias is not None:
        bias = (bias, _contiguous_stride(bias))
    spec = _Spec(dtype=p.dtype, b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, dqk=p.head_dim_qk,
                 dv=p.head_dim_v, q=q, k=k, v=v, o=o, stats=stats, ragged_q=ragged_q,
                 ragged_kv=ragged_kv, padding=p.is_varlen, top_left=top_left, left_bound=lb,
                 right_bound=rb, scale=float(p.softmax_scale),
                 dropout=float(p.attention_dropout), bias=bias, backward=False)
    if not backward:
        return spec
    dq = _bhsd_strides(p.q_format, _contiguous_stride(
        _format_shape(p.q_format, b, sq, hq, p.head_dim_qk)), sq)
    dk = _bhsd_strides(p.kv_format, _contiguous_stride(
        _format_shape(p.kv_format, b, skv, hkv, p.head_dim_qk)), skv)
    dv = _bhsd_strides(p.kv_format, _contiguous_stride(
        _format_shape(p.kv_format, b, skv, hkv, p.head_dim_v)), skv)
    return spec._replace(backward=True, do=o, dq=dq, dk=dk, dv_=dv,
                        dbias=bool(bias is not None and p.core_attention_bias_requires_grad),
                        deterministic=bool(p.deterministic))


def _bias_dims(shape_code: Optional[str], b, h, sq, skv):
    code = shape_code or "1hss"
    return (b if code[0] == "b" else 1, h if code[1] == "h" else 1, sq, skv)


def _stats_strides(ragged: bool, b: int, h: int, sq: int):
    # Ragged: token-major [t, h] float32; else [b, h, sq, 1].
    return (sq * h, 1, h, 1) if ragged else (h * sq, sq, 1, 1)


# --------------------------------------------------------------------------------------------
# Graph construction
# --------------------------------------------------------------------------------------------
def _ragged_strides(spec: _Spec):
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


def _make_graph(spec: _Spec, handle):
    """A cudnn pygraph for spec, validated and with execution plans (not built)."""
    cudnn = _cudnn
    dt = _data_type(spec.dtype)
    f32, i32, i64 = cudnn.data_type.FLOAT, cudnn.data_type.INT32, cudnn.data_type.INT64
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=f32, compute_data_type=f32,
                      handle=handle)
    b, hq, hkv, sq, skv = spec.b, spec.hq, spec.hkv, spec.sq, spec.skv

    def t(uid, dims, strides, dtype=dt):
        return g.tensor(dim=list(dims), stride=list(strides), data_type=dtype, uid=uid,
                        name=f"t{uid}")

    q = t(_Q, (b, hq, sq, spec.dqk), spec.q)
    k = t(_K, (b, hkv, skv, spec.dqk), spec.k)
    v = t(_V, (b, hkv, skv, spec.dv), spec.v)
    q_strides, kv_strides = _ragged_strides(spec)
    q_off = {s: t(_RAGGED_Q_BASE + i, (b + 1, 1, 1, 1), (1, 1, 1, 1), i64)
             for i, s in enumerate(q_strides)}
    kv_off = {s: t(_RAGGED_KV_BASE + i, (b + 1, 1, 1, 1), (1, 1, 1, 1), i64)
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
        kw["seq_len_q"] = t(_SEQ_Q, (b, 1, 1, 1), (1, 1, 1, 1), i32)
        kw["seq_len_kv"] = t(_SEQ_KV, (b, 1, 1, 1), (1, 1, 1, 1), i32)
    if spec.left_bound is not None or spec.right_bound is not None:
        kw["diagonal_alignment"] = (cudnn.diagonal_alignment.TOP_LEFT if spec.top_left
                                    else cudnn.diagonal_alignment.BOTTOM_RIGHT)
        if spec.left_bound is not None:
            kw["diagonal_band_left_bound"] = spec.left_bound
        if spec.right_bound is not None:
            kw["diagonal_band_right_bound"] = spec.right_bound
    if spec.bias is not None:
        kw["bias"] = t(_BIAS, spec.bias[0], spec.bias[1])
    if spec.dropout > 0.0:
        seed = t(_SEED, (1, 1, 1, 1), (1, 1, 1, 1), i64)
        offset = t(_OFFSET, (1, 1, 1, 1), (1, 1, 1, 1), i64)
        kw["dropout"] = (spec.dropout, seed, offset)

    if not spec.backward:
        stats_needed = spec.stats is not None
        o, stats = g.sdpa(q, k, v, generate_stats=stats_needed, name="sdpa", **kw)
        o.set_uid(_O).set_output(True).set_dim([b, hq, sq, spec.dv]).set_stride(list(spec.o))
        ragged(o, spec.o, q_off)
        if stats_needed:
            stats.set_uid(_STATS).set_output(True).set_data_type(f32)
            stats.set_dim([b, hq, sq, 1]).set_stride(list(spec.stats))
            ragged(stats, spec.stats, q_off)
    else:
        o = t(_O, (b, hq, sq, spec.dv), spec.o)
        do = t(_DO, (b, hq, sq, spec.dv), spec.do)
        stats = t(_STATS, (b, hq, sq, 1), spec.stats, f32)
        for x, st in ((o, spec.o), (do, spec.do), (stats, spec.stats)):
            ragged(x, st, q_off)
        if spec.dbias:
            kw["dBias"] = t(_DBIAS, spec.bias[0], spec.bias[1])
        kw["use_deterministic_algorithm"] = bool(spec.deterministic)
        dq, dk, dv = g.sdpa_backward(q, k, v, o, do, stats, name="sdpa_backward", **kw)
        for x, uid, dims, st, offs in (
                (dq, _DQ, (b, hq, sq, spec.dqk), spec.dq, q_off),
                (dk, _DK, (b, hkv, skv, spec.dqk), spec.dk, kv_off),
                (dv, _DV, (b, hkv, skv, spec.dv), spec.dv_, kv_off)):
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


# --------------------------------------------------------------------------------------------
# Support detection
# --------------------------------------------------------------------------------------------
_support_cache: "collections.OrderedDict[tuple, Optional[str]]" = collections.OrderedDict()
# Graphs the support check validated, kept for run() to build (same spec: same graph).
_validated: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()


def _cudnn_rejection(spec: _Spec, device_index: int) -> Optional[str]:
    """cuDNN's verdict on a graph description (cached): None, or its message."""
    key = (spec, device_index)
    if key in _support_cache:
        _support_cache.move_to_end(key)
        return _support_cache[key]
    try:
        _validated[key] = _make_graph(spec, _handle(device_index))
        if len(_validated) > 64:
            _validated.popitem(last=False)
        verdict = None
    except Exception as exc:  # cudnnGraphNotSupportedError, ValueError, RuntimeError, ...
        verdict = " ".join(str(exc).split()) or type(exc).__name__
        if len(verdict) > 300:
            verdict = verdict[:300] + "..."
    _support_cache[key] = verdict
    if len(_support_cache) > 4 * CACHE_SIZE:
        _support_cache.popitem(last=False)
    return verdict


def _reasons(p: AttentionParams) -> List[str]:
    if p.device_type != "cuda":
        return [f"as it requires CUDA tensors (got device type {p.device_type})"]
    if _get_cudnn() is None:
        return [f"as cudnn-frontend is not installed or failed to import ({_import_error})"]
    if not torch.cuda.is_available():
        return ["as no CUDA GPU is available"]
    ver = _backend_version()
    if ver is None:
        return ["as the cuDNN library could not be loaded by cudnn-frontend"]
    if ver < MIN_CUDNN_VERSION:
        return ["as cuDNN %s is too old (needs %s or newer)" % (
            ".".join(map(str, ver)), ".".join(map(str, MIN_CUDNN_VERSION)))]
    cc = p.compute_capability
    if cc is None or cc[0] not in SUPPORTED_ARCH_MAJORS:
        return [f"as it does not support compute capability {cc}"
                " (tested and supported: sm90)"]

    reasons = []
    if p.dtype not in SUPPORTED_DTYPES:
        reasons.append(f"as it does not support dtype {p.dtype} (fp16 and bf16 only)")
    if (p.head_dim_qk, p.head_dim_v) not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"as it does not support head_dim_qk = {p.head_dim_qk}, head_dim_v = "
                       f"{p.head_dim_v}")
    if p.attn_mask_type == "arbitrary":
        reasons.append("as it does not support attn_mask_type = arbitrary")
    if p.core_attention_bias_type == "pre_scale_bias":
        reasons.append("as it does not support core_attention_bias_type = pre_scale_bias")
    thd = "thd" in (p.q_format, p.kv_format)
    if thd and p.core_attention_bias_type in ("post_scale_bias", "alibi"):
        reasons.append(f"as it does not support core_attention_bias_type = "
                       f"{p.core_attention_bias_type} with the thd format")
    if reasons:
        return reasons

    device_index = torch.cuda.current_device()
    training = p.requires_grad or p.core_attention_bias_requires_grad
    fwd = _spec_from_params(p, backward=False)
    msg = _cudnn_rejection(fwd._replace(stats=fwd.stats if training else None), device_index)
    if msg is None and training:
        msg = _cudnn_rejection(_spec_from_params(p, backward=True), device_index)
        if msg is not None:
            return [f"as cuDNN does not support the backward of this configuration ({msg})"]
    if msg is not None:
        return [f"as cuDNN does not support this configuration ({msg})"]
    return []

# Why this backend cannot serve params (each reads after "Disabling <NAME> ").
not_supported_reasons = never_raises(_reasons)


# --------------------------------------------------------------------------------------------
# Plans: a built graph and how to feed it
# --------------------------------------------------------------------------------------------
class _Plan:
    __slots__ = ("graph", "exec", "ws", "q_mult", "kv_mult", "zero", "spec", "device")

    def __init__(self, spec: _Spec, device_index: int):
        start = time.perf_counter()
        g = _validated.pop((spec, device_index), None)
        if g is None:
            g = _make_graph(spec, _handle(device_index))
        g.build_plans()
        self.graph = g
        self.spec = spec
        self.device = device_index
        self.ws = int(g.get_workspace_size())
        self.exec = _executor(g)
        q_side, kv_side = _ragged_strides(spec)
        dev = torch.device("cuda", device_index)
        self.q_mult = (torch.tensor(q_side, dtype=torch.int64, device=dev).view(-1, 1)
                       if q_side else None)
        self.kv_mult = (torch.tensor(kv_side, dtype=torch.int64, device=dev).view(-1, 1)
                        if kv_side else None)
        # Rows no query or key reaches (padding) are zero in outputs and gradients.
        self.zero = spec.padding
        logger.debug("FusedAttention: built the cuDNN %s graph in %.1f ms (b=%d, hq=%d, hkv=%d, "
                     "sq=%d, skv=%d, d=%d/%d, %s, workspace %d bytes)",
                     "backward" if spec.backward else "forward",
                     (time.perf_counter() - start) * 1e3, spec.b, spec.hq, spec.hkv, spec.sq,
                     spec.skv, spec.dqk, spec.dv, str(spec.dtype).replace("torch.", ""), self.ws)

    def run(self, pack: Dict[int, int], cu_q, cu_kv, device: torch.device) -> None:
        keep = []  # temporaries that must live until the launch
        if self.spec.padding:
            seq_q = cu_q[1:] - cu_q[:-1]
            seq_kv = seq_q if cu_kv is cu_q else cu_kv[1:] - cu_kv[:-1]
            pack[_SEQ_Q] = seq_q.data_ptr()
            pack[_SEQ_KV] = seq_kv.data_ptr()
            keep += (seq_q, seq_kv)
            if self.q_mult is not None:
                offs = cu_q.unsqueeze(0) * self.q_mult  # int64 [n, b+1], one row per stride
                base, step = offs.data_ptr(), offs.stride(0) * 8
                for i in range(offs.shape[0]):
                    pack[_RAGGED_Q_BASE + i] = base + i * step
                keep.append(offs)
            if self.kv_mult is not None:
                offs = cu_kv.unsqueeze(0) * self.kv_mult
                base, step = offs.data_ptr(), offs.stride(0) * 8
                for i in range(offs.shape[0]):
                    pack[_RAGGED_KV_BASE + i] = base + i * step
                keep.append(offs)
        stream = _current_stream(self.device)
        ws = _workspace(self.ws, self.device, stream) if self.ws else None
        if torch.cuda.current_device() != self.device:
            with torch.cuda.device(self.device):
                self.exec(pack, ws.data_ptr() if ws is not None else 0,
                          _handle(self.device, stream))
        else:
            self.exec(pack, ws.data_ptr() if ws is not None else 0, _handle(self.device, stream))


def _executor(g):
    """How to launch a built graph: straight into the backend graph (lean), else the public
    ``pygraph.execute``."""
    def public(pack, ws, handle):
        g.execute(pack, ws or None, handle=handle)

    if not FAST_EXECUTE:
        return public
    try:
        if g.selected_engine is not None:  # a python engine: only execute() knows it
            return public
        lowered = g._lowered_graph
        cpp_index = g._plans[g._plan_index].cpp_index
        if cpp_index is None:
            run_plan = lowered._execute

            def fast(pack, ws, handle):
                run_plan(pack, ws, handle.backend_handle)
        else:
            run_plan = lowered._execute_plan_at_index

            def fast(pack, ws, handle):
                run_plan(pack, ws, cpp_index, handle.backend_handle)
        return fast
    except Exception:  # another cudnn-frontend version: keep to the public API
        return public


_fwd_cache: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
_bwd_cache: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
_CONTIGUOUS = object()  # cache marker: these strides failed; run on contiguous copies


def _cache_get(cache, key):
    plan = cache.get(key)
    if plan is not None:
        cache.move_to_end(key)
    return plan


def _cache_put(cache, key, plan):
    cache[key] = plan
    if len(cache) > CACHE_SIZE:
        cache.popitem(last=False)


def clear_cache() -> None:
    """Drops every built graph and support verdict (tests use it)."""
    _fwd_cache.clear()
    _bwd_cache.clear()
    _support_cache.clear()
    _validated.clear()
    _workspaces.clear()


@atexit.register
def _release() -> None:
    # Free the cuDNN objects before the interpreter tears cudnn-frontend's bindings down.
    clear_cache()
    _handles.clear()
    gc.collect()


# --------------------------------------------------------------------------------------------
# Forward / backward implementations (shared by the eager path and the torch.library ops)
# --------------------------------------------------------------------------------------------
# cfg: (q_format, kv_format, max_seqlen_q, max_seqlen_kv, mask_type, window_left,
#       window_right, softmax_scale, dropout_p, deterministic, return_stats)


def _fwd_spec(cfg, q, k, v, bias, cu_q) -> _Spec:
    q_format, kv_format, sq, skv, mask, wl, wr, scale, dropout, _, stats = cfg
    ragged_q, ragged_kv = q_format == "thd", kv_format == "thd"
    b = cu_q.shape[0] - 1 if cu_q is not None else (q.shape[1] if q_format == "sbhd"
                                                     else q.shape[0])
    hq, dqk = q.shape[-2], q.shape[-1]
    hkv, dv = v.shape[-2], v.shape[-1]
    o_st = _contiguous_stride(_format_shape(q_format, b, sq, hq, dv))
    padding = "padding" in mask or ragged_q or ragged_kv
    top_left, lb, rb = _mask_band(mask, (wl, wr), sq == skv and not padding)
    return _Spec(dtype=q.dtype, b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, dqk=dqk, dv=dv,
                 q=_bhsd_strides(q_format, q.stride(), sq),
                 k=_bhsd_strides(kv_format, k.stride(), skv),
                 v=_bhsd_strides(kv_format, v.stride(), skv),
                 o=_bhsd_strides(q_format, o_st, sq),
                 stats=_stats_strides(ragged_q, b, hq, sq) if stats else None,
                 ragged_q=ragged_q, ragged_kv=ragged_kv, padding=padding, top_left=top_left,
                 left_bound=lb, right_bound=rb, scale=float(scale), dropout=float(dropout),
                 bias=None if bias is None else (tuple(bias.shape), tuple(bias.stride())),
                 backward=False)


def _prepare_bias(bias: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    if bias is None:
        return None
    if bias.dtype != dtype:
        bias = bias.to(dtype)
    if not aligned(bias):
        bias = fresh(bias)
    return bias


def _fwd_impl(q, k, v, bias, cu_q, cu_kv, rng, cfg):
    """(out [*q.shape[:-1], dv] in q's format, stats float32 or an empty tensor)."""
    return _fwd_core(q, k, v, bias, cu_q, cu_kv, rng, cfg)[:2]


def _fwd_core(q, k, v, bias, cu_q, cu_kv, rng, cfg):
    """(out, stats, key): key identifies q, k, v, bias and cfg, or is None when the call ran
    on copies (misaligned or refused strides)."""
    if bias is not None:
        bias = _prepare_bias(bias, q.dtype)
    # thd shapes leave out t: a graph serves every token count.
    thd_q, thd_kv = cfg[0] == "thd", cfg[1] == "thd"
    key = (cfg, q.shape[1:] if thd_q else q.shape, q.stride(),
           k.shape[1:] if thd_kv else k.shape, k.stride(),
           v.shape[1:] if thd_kv else v.shape, v.stride(), q.dtype, q.device.index,
           None if bias is None else (bias.shape, bias.stride()),
           None if cu_q is None else cu_q.shape[0])
    plan = _cache_get(_fwd_cache, key)
    if plan is None:
        plan = _build_or_mark(_fwd_cache, key, lambda: _fwd_spec(cfg, q, k, v, bias, cu_q),
                              (q, k, v))
    if plan is _CONTIGUOUS or (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        out, stats = _fwd_impl(fresh(q), fresh(k), fresh(v), bias, cu_q, cu_kv, rng, cfg)
        return out, stats, None

    spec = plan.spec
    dev = q.device
    alloc = torch.zeros if plan.zero else torch.empty
    out = alloc((*q.shape[:-1], spec.dv), dtype=q.dtype, device=dev)
    pack = {_Q: q.data_ptr(), _K: k.data_ptr(), _V: v.data_ptr(), _O: out.data_ptr()}
    if spec.stats is not None:
        shape = (q.shape[0], spec.hq, 1) if spec.ragged_q else (spec.b, spec.hq, spec.sq, 1)
        stats = torch.empty(shape, dtype=torch.float32, device=dev)
        pack[_STATS] = stats.data_ptr()
    else:
        stats = out.new_empty((0,), dtype=torch.float32)
    if bias is not None:
        pack[_BIAS] = bias.data_ptr()
    if spec.dropout > 0.0:
        pack[_SEED] = rng.data_ptr()
        pack[_OFFSET] = rng.data_ptr() + 8
    plan.run(pack, cu_q, cu_kv, dev)
    return out, stats, key


def _build_or_mark(cache, key, make_spec, tensors):
    """Build the plan for key; on failure with non-contiguous strides, mark the key so its
    calls run on contiguous copies (the support check was made with contiguous strides)."""
    contiguous = all(t.is_contiguous() for t in tensors)
    if not contiguous and not all(strides_aligned(t) for t in tensors):
        _cache_put(cache, key, _CONTIGUOUS)
        return _CONTIGUOUS
    device_index = tensors[0].device.index
    try:
        with torch.cuda.device(device_index):
            plan = _Plan(make_spec(), device_index)
    except Exception as exc:
        if contiguous:
            raise RuntimeError(f"FusedAttention: cuDNN could not build the graph: {exc}") from exc
        logger.debug("FusedAttention: cuDNN rejected the strided layout (%s); running on "
                     "contiguous copies", exc)
        plan = _CONTIGUOUS
    _cache_put(cache, key, plan)
    return plan


def _grads_like(q, k, v, zero: bool, shared: bool):
    """Gradient buffers for q, k, v, each contiguous in its own format. shared: tensors of
    one shape come from one allocation (fewer allocator calls on the eager hot path)."""
    alloc = torch.zeros if zero else torch.empty
    if shared and k.shape == v.shape:
        if q.shape == k.shape:
            return alloc((3,) + tuple(q.shape), dtype=q.dtype, device=q.device).unbind(0)
        dk, dv = alloc((2,) + tuple(k.shape), dtype=k.dtype, device=k.device).unbind(0)
        return alloc(q.shape, dtype=q.dtype, device=q.device), dk, dv
    return tuple(alloc(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _bwd_impl(dout, q, k, v, out, stats, bias, cu_q, cu_kv, rng, cfg, need_dbias,
              fwd_key=None, shared_grads=False):
    """(dq, dk, dv, dbias or None). fwd_key: the forward's key for these q, k, v, bias.
    shared_grads: dq, dk, dv may be views of one buffer (not for the torch.library op, whose
    outputs must not alias)."""
    dout_stride = dout.stride()
    if (dout_stride != out.stride() and not strides_aligned(dout)) or dout.data_ptr() & 15:
        dout = fresh(dout)
        dout_stride = dout.stride()
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        q, k, v = fresh(q), fresh(k), fresh(v)
        fwd_key = None
    if bias is not None:
        bias = _prepare_bias(bias, q.dtype)
    thd_q, thd_kv = cfg[0] == "thd", cfg[1] == "thd"
    if fwd_key is not None:
        key = (fwd_key, dout_stride, need_dbias)
    else:
        key = (cfg, q.shape[1:] if thd_q else q.shape, q.stride(),
               k.shape[1:] if thd_kv else k.shape, k.stride(),
               v.shape[1:] if thd_kv else v.shape, v.stride(), q.dtype, q.device.index,
               None if bias is None else (bias.shape, bias.stride()),
               None if cu_q is None else cu_q.shape[0])
        key = (key, dout_stride, need_dbias)
    plan = _cache_get(_bwd_cache, key)
    if plan is None:
        def make_spec():
            fmt_q, fmt_kv, sq, skv = cfg[0], cfg[1], cfg[2], cfg[3]
            spec = _fwd_spec(cfg, q, k, v, bias, cu_q)
            return spec._replace(
                backward=True,
                stats=_stats_strides(thd_q, spec.b, spec.hq, sq),
                do=_bhsd_strides(fmt_q, dout.stride(), sq),
                dq=_bhsd_strides(fmt_q, _contiguous_stride(q.shape), sq),
                dk=_bhsd_strides(fmt_kv, _contiguous_stride(k.shape), skv),
                dv_=_bhsd_strides(fmt_kv, _contiguous_stride(v.shape), skv),
                dbias=bool(need_dbias), deterministic=bool(cfg[9]))
        plan = _build_or_mark(_bwd_cache, key, make_spec, (q, k, v, dout))
    if plan is _CONTIGUOUS:
        return _bwd_impl(fresh(dout), fresh(q), fresh(k), fresh(v), out, stats, bias,
                         cu_q, cu_kv, rng, cfg, need_dbias, None, shared_grads)
    spec = plan.spec
    dq, dk, dv = _grads_like(q, k, v, plan.zero, shared_grads)
    pack = {_Q: q.data_ptr(), _K: k.data_ptr(), _V: v.data_ptr(), _O: out.data_ptr(),
            _DO: dout.data_ptr(), _STATS: stats.data_ptr(), _DQ: dq.data_ptr(),
            _DK: dk.data_ptr(), _DV: dv.data_ptr()}
    dbias = None
    if bias is not None:
        pack[_BIAS] = bias.data_ptr()
        if need_dbias:
            dbias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device)
            pack[_DBIAS] = dbias.data_ptr()
    if spec.dropout > 0.0:
        pack[_SEED] = rng.data_ptr()
        pack[_OFFSET] = rng.data_ptr() + 8
    plan.run(pack, cu_q, cu_kv, q.device)
    return dq, dk, dv, dbias


# --------------------------------------------------------------------------------------------
# Autograd: eager (autograd.Function) and torch.library custom ops (torch.compile)
# --------------------------------------------------------------------------------------------
class _FusedAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, cu_q, cu_kv, rng, cfg):
        out, stats, key = _fwd_core(q, k, v, bias, cu_q, cu_kv, rng, cfg)
        ctx.save_for_backward(q, k, v, out, stats, bias, cu_q, cu_kv, rng)
        ctx.cfg = cfg
        ctx.key = key
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, stats, bias, cu_q, cu_kv, rng = ctx.saved_tensors
        need_dbias = bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias = _bwd_impl(dout, q, k, v, out, stats, bias, cu_q, cu_kv, rng,
                                      ctx.cfg, need_dbias, ctx.key, SHARED_GRADS)
        if dbias is not None and dbias.dtype != bias.dtype:
            dbias = dbias.to(bias.dtype)
        return dq, dk, dv, dbias, None, None, None, None


def _stats_shape(q_format: str, q: torch.Tensor):
    if q_format == "thd":
        return (q.shape[0], q.shape[1], 1)
    b, sq = (q.shape[1], q.shape[0]) if q_format == "sbhd" else (q.shape[0], q.shape[1])
    return (b, q.shape[-2], sq, 1)


Tensor = torch.Tensor  # for the op signatures (annotations are strings in this module)


def _register_ops() -> None:
    try:
        torch.ops.transformer_fa.fused_attn_fwd  # noqa: B018  (already registered: a reload)
        return
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("transformer_fa::fused_attn_fwd", mutates_args=(),
                             device_types="cuda")
    def fused_attn_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                       cu_seqlens_q: Optional[Tensor], cu_seqlens_kv: Optional[Tensor],
                       rng_state: Optional[Tensor], q_format: str, kv_format: str,
                       max_seqlen_q: int, max_seqlen_kv: int, attn_mask_type: str,
                       window_left: int, window_right: int, softmax_scale: float,
                       dropout_p: float, deterministic: bool, return_stats: bool
                       ) -> Tuple[Tensor, Tensor]:
        cfg = (q_format, kv_format, max_seqlen_q, max_seqlen_kv, attn_mask_type, window_left,
               window_right, softmax_scale, dropout_p, deterministic, return_stats)
        return _fwd_impl(q, k, v, bias, cu_seqlens_q, cu_seqlens_kv, rng_state, cfg)

    @fused_attn_fwd.register_fake
    def _(q, k, v, bias, cu_seqlens_q, cu_seqlens_kv, rng_state, q_format, kv_format,
          max_seqlen_q, max_seqlen_kv, attn_mask_type, window_left, window_right,
          softmax_scale, dropout_p, deterministic, return_stats):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        shape = _stats_shape(q_format, q) if return_stats else (0,)
        return out, q.new_empty(shape, dtype=torch.float32)

    @torch.library.custom_op("transformer_fa::fused_attn_bwd", mutates_args=(),
                             device_types="cuda")
    def fused_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                       stats: Tensor, bias: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                       cu_seqlens_kv: Optional[Tensor], rng_state: Optional[Tensor],
                       q_format: str, kv_format: str, max_seqlen_q: int, max_seqlen_kv: int,
                       attn_mask_type: str, window_left: int, window_right: int,
                       softmax_scale: float, dropout_p: float, deterministic: bool,
                       need_dbias: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        cfg = (q_format, kv_format, max_seqlen_q, max_seqlen_kv, attn_mask_type, window_left,
               window_right, softmax_scale, dropout_p, deterministic, True)
        dq, dk, dv, dbias = _bwd_impl(dout, q, k, v, out, stats, bias, cu_seqlens_q,
                                      cu_seqlens_kv, rng_state, cfg, need_dbias)
        if dbias is None:
            dbias = q.new_empty((0,))
        elif dbias.dtype != bias.dtype:
            dbias = dbias.to(bias.dtype)
        return dq, dk, dv, dbias

    @fused_attn_bwd.register_fake
    def _(dout, q, k, v, out, stats, bias, cu_seqlens_q, cu_seqlens_kv, rng_state, q_format,
          kv_format, max_seqlen_q, max_seqlen_kv, attn_mask_type, window_left, window_right,
          softmax_scale, dropout_p, deterministic, need_dbias):
        dbias = bias.new_empty(bias.shape) if need_dbias else q.new_empty((0,))
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias

    def setup_context(ctx, inputs, output):
        q, k, v, bias, cu_q, cu_kv, rng = inputs[:7]
        out, stats = output
        ctx.save_for_backward(q, k, v, out, stats, bias, cu_q, cu_kv, rng)
        ctx.cfg = tuple(inputs[7:])

    def backward(ctx, dout, dstats):
        q, k, v, out, stats, bias, cu_q, cu_kv, rng = ctx.saved_tensors
        need_dbias = bias is not None and ctx.needs_input_grad[3]
        # cfg minus return_stats (the backward op always has stats)
        dq, dk, dv, dbias = torch.ops.transformer_fa.fused_attn_bwd(
            dout, q, k, v, out, stats, bias, cu_q, cu_kv, rng, *ctx.cfg[:-1], need_dbias)
        return (dq, dk, dv, dbias if need_dbias else None) + (None,) * (3 + len(ctx.cfg))

    torch.library.register_autograd("transformer_fa::fused_attn_fwd", backward,
                                    setup_context=setup_context)


_register_ops()


# --------------------------------------------------------------------------------------------
# The backend entry point
# --------------------------------------------------------------------------------------------
def _alibi_bias(slopes: torch.Tensor, params: AttentionParams, cu_q, cu_kv) -> torch.Tensor:
    """The ALiBi bias (masks.alibi_bias) less each row's maximum, as a post-scale bias
    ``[b|1, h, sq, skv]`` in q's dtype."""
    p = params
    if p.is_padding:
        lens_q, lens_kv = padding.seqlens_from_cu(cu_q), padding.seqlens_from_cu(cu_kv)
    else:
        lens_q = torch.full((1,), p.max_seqlen_q, device=slopes.device)
        lens_kv = torch.full((1,), p.max_seqlen_kv, device=slopes.device)
    bias = masks.alibi_bias(slopes, p.attn_mask_type, lens_q, lens_kv, p.max_seqlen_q,
                            p.max_seqlen_kv)
    # Relative to each row's maximum (a per-row constant leaves the softmax unchanged): the
    # keys that carry the weight get small values, which fp16/bf16 hold exactly or nearly.
    # As absolute values, rows far from the diagonal (sq > skv) rounded by up to 2^-9 of a
    # bias in the thousands.
    bias = bias - bias.amax(dim=-1, keepdim=True)
    return bias.to(p.dtype).contiguous()


def run(inputs: AttentionInputs, params: AttentionParams) -> torch.Tensor:
    p = params
    q, k, v = inputs.q, inputs.k, inputs.v
    cu_q, cu_kv = inputs.cu_seqlens_q, inputs.cu_seqlens_kv
    if not p.is_varlen:
        cu_q = cu_kv = None
    bias = None
    if p.core_attention_bias_type == "post_scale_bias":
        bias = inputs.core_attention_bias
    elif p.core_attention_bias_type == "alibi":
        bias = _alibi_bias(inputs.alibi_slopes, p, cu_q, cu_kv)
    rng = None
    if p.attention_dropout > 0.0:
        # Philox seed and offset for cuDNN's dropout; saved for the backward.
        rng = dropout_rng_state(q.device)
    need_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or (bias is not None and bias.requires_grad))
    sq = _bucket(p.max_seqlen_q) if p.q_format == "thd" else p.max_seqlen_q
    skv = _bucket(p.max_seqlen_kv) if p.kv_format == "thd" else p.max_seqlen_kv
    wl, wr = p.window_size
    cfg = (p.q_format, p.kv_format, sq, skv, p.attn_mask_type, wl, wr, float(p.softmax_scale),
           float(p.attention_dropout), bool(p.deterministic), need_grad)
    if p.is_compiling or torch.compiler.is_compiling():
        out = torch.ops.transformer_fa.fused_attn_fwd(q, k, v, bias, cu_q, cu_kv, rng, *cfg)[0]
    elif need_grad:
        out = _FusedAttnFunction.apply(q, k, v, bias, cu_q, cu_kv, rng, cfg)
    else:
        out = _fwd_impl(q, k, v, bias, cu_q, cu_kv, rng, cfg)[0]
    return out.view(*out.shape[:-2], out.shape[-2] * out.shape[-1])
