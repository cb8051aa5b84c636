"""QKV formats and layouts: detect, validate, normalize. Pure functions.

A *format* names the dimension order of one tensor: ``sbhd`` ([s, b, h, d]), ``bshd``
([b, s, h, d]) or ``thd`` ([t, h, d], sequences packed back to back, delimited by
cu_seqlens). A call's ``qkv_format`` is one of these, or a mixed one such as ``sbhd_2bshd``
(q in sbhd, k and v in bshd).

A *layout* (TE's strings) also says how q, k and v sit in memory:
``sb3hd`` one buffer [s, b, 3, h, d]; ``sbh3d`` one buffer [s, b, h, 3, d]; ``sbhd_sb2hd``
q alone and one k/v buffer [s, b, 2, h, d]; ``sbhd_sbh2d`` q alone and [s, b, h, 2, d];
``sbhd_sbhd_sbhd`` three tensors, each contiguous; likewise ``bs*`` and ``t*``; and
``sbhd_bshd_bshd``-style ones for the mixed formats.

Detection is exact: a layout is reported only if every tensor is precisely the view of the
layout's dense buffer that it claims to be (same storage, offsets and strides). Anything
else (for example a fused GQA projection ``[s, b, hq + 2*hkv, d]`` split into q, k, v
along the head dimension) is made contiguous and detected again.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

BASE_FORMATS = ("sbhd", "bshd", "thd")
QKV_FORMATS = ("sbhd", "bshd", "thd", "sbhd_2bshd", "bshd_2sbhd", "thd_2bshd", "thd_2sbhd")

# Per base format: the prefix of its layout strings.
_PREFIX = {"sbhd": "sb", "bshd": "bs", "thd": "t"}


def split_qkv_format(qkv_format: str) -> Tuple[str, str]:
    """``"sbhd"`` -> ("sbhd", "sbhd"); ``"thd_2bshd"`` -> ("thd", "bshd")."""
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
    if "_2" in qkv_format:
        q_format, kv_format = qkv_format.split("_2")
        return q_format, kv_format
    return qkv_format, qkv_format


def candidate_layouts(q_format: str, kv_format: str) -> List[str]:
    """The layouts that exist for a format pair, most packed first."""
    if q_format != kv_format:
        return [f"{q_format}_{kv_format}_{kv_format}"]
    p, f = _PREFIX[q_format], q_format
    return [f"{p}3hd", f"{p}h3d", f"{f}_{p}2hd", f"{f}_{p}h2d", f"{f}_{f}_{f}"]


def _shares_storage(tensors: Sequence[torch.Tensor]) -> bool:
    ptr = tensors[0].untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() == ptr for t in tensors[1:])


def _strides_match(t: torch.Tensor, expected: Sequence[int]) -> bool:
    # A dim of size 1 is never stepped over, so its stride says nothing about the layout.
    return all(size == 1 or s == e for size, s, e in zip(t.shape, t.stride(), expected))


def _contiguous_strides(shape: Sequence[int]) -> List[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _is_packed(tensors: Sequence[torch.Tensor], heads_first: bool) -> bool:
    """Are ``tensors`` (known to share one storage) the n slices of one dense buffer packed
    along a new dim?

    heads_first=False: buffer [outer..., n, h, d] (the ``3hd`` / ``2hd`` layouts);
    heads_first=True: buffer [outer..., h, n, d] (the ``h3d`` / ``h2d`` layouts).
    """
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype for t in tensors[1:]):
        return False
    n = len(tensors)
    outer, (h, d) = list(first.shape[:-2]), first.shape[-2:]
    inner = [h, n, d] if heads_first else [n, h, d]
    strides = _contiguous_strides(outer + inner)
    pack_dim = len(outer) + (1 if heads_first else 0)
    pack_stride = strides[pack_dim]
    expected = strides[:pack_dim] + strides[pack_dim + 1 :]
    base = first.storage_offset()
    return all(
        _strides_match(t, expected) and t.storage_offset() == base + i * pack_stride
        for i, t in enumerate(tensors)
    )


def _matches(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if layout.endswith("3hd") or layout.endswith("h3d"):
        return _is_packed([q, k, v], heads_first=layout.endswith("h3d"))
    parts = layout.split("_")
    if not q.is_contiguous():
        return False
    if len(parts) == 2:  # q alone, k and v packed together
        return _is_packed([k, v], heads_first=parts[1].endswith("h2d"))
    return k.is_contiguous() and v.is_contiguous()


def detect_qkv_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      qkv_format: str = "sbhd") -> Optional[str]:
    """The layout q, k, v are exactly in, or None if they match none of them."""
    q_format, kv_format = split_qkv_format(qkv_format)
    if q.is_contiguous() and k.is_contiguous() and v.is_contiguous():
        # Each tensor is dense on its own. (A packed view is contiguous only when its outer
        # dims are all 1, and then both readings address the same memory.)
        return candidate_layouts(q_format, kv_format)[-1]
    # Storage identity cannot be inspected while tracing: only the separate-tensor layout is
    # proven there (packed views get copied, which is correct, not fast).
    kv_packable = not torch.compiler.is_compiling() and _shares_storage([k, v])
    qkv_packable = kv_packable and _shares_storage([q, k])
    for layout in candidate_layouts(q_format, kv_format):
        n_packed = 3 if "3" in layout else (2 if "2" in layout.split("_", 1)[-1] else 0)
        if (n_packed == 3 and not qkv_packable) or (n_packed == 2 and not kv_packable):
            continue
        if _matches(layout, q, k, v):
            return layout
    return None


def get_qkv_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   qkv_format: str = "sbhd") -> Tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TE's ``get_qkv_layout``: the layout string and the tensors in it.

    Tensors that match no layout are made contiguous (each on its own) and detected again,
    which always yields the separate-tensor layout.
    """
    layout = detect_qkv_layout(q, k, v, qkv_format)
    if layout is None:
        q, k, v = (x.contiguous() for x in (q, k, v))
        layout = detect_qkv_layout(q, k, v, qkv_format)
        assert layout is not None, "contiguous tensors always form the separate layout"
    return layout, q, k, v


# ---------------------------------------------------------------------------------------
# Validation. Each check names the argument and what was expected.

def _dims(fmt: str) -> int:
    return 3 if fmt == "thd" else 4


def seq_batch_of(t: torch.Tensor, fmt: str) -> Tuple[Optional[int], Optional[int]]:
    """(seqlen, batch) of a tensor in a base format; None where the format has no such dim."""
    if fmt == "sbhd":
        return t.shape[0], t.shape[1]
    if fmt == "bshd":
        return t.shape[1], t.shape[0]
    return None, None


def kv_seq_batch(k: torch.Tensor, kv_format: str,
                 page_table: Optional[torch.Tensor] = None) -> Tuple[Optional[int], Optional[int]]:
    """(seqlen, batch) of the keys: ``seq_batch_of(k)``, or for page pools ``[total_pages,
    page_size, h, d]`` read through ``page_table`` ``[b, pages_per_seq]`` (a paged KV cache,
    bshd): (pages_per_seq * page_size, b)."""
    if page_table is None:
        return seq_batch_of(k, kv_format)
    if kv_format != "bshd":
        raise ValueError(f"page pools are bshd (the KV cache's format), got kv_format {kv_format!r}")
    if not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32:
        raise TypeError("page_table must be an int32 tensor [b, pages_per_seq]")
    if page_table.dim() != 2 or page_table.device != k.device or (
            page_table.shape[1] > 1 and page_table.stride(1) != 1):
        raise ValueError(f"page_table must be [b, pages_per_seq] with stride 1 in its last dim, "
                         f"on the pools' device {k.device}; got shape {list(page_table.shape)}, "
                         f"strides {page_table.stride()} on {page_table.device}")
    return page_table.shape[1] * k.shape[1], page_table.shape[0]


def validate_qkv(q, k, v, q_format: str, kv_format: str, num_heads: int,
                 num_gqa_groups: int, head_dim_qk: int, head_dim_v: int,
                 page_table: Optional[torch.Tensor] = None) -> None:
    """Checks that q, k, v can be read in the given formats by a module with these sizes.
    With ``page_table``, k and v are page pools (see ``kv_seq_batch``)."""
    names = ("query_layer", "key_layer", "value_layer")
    tensors = (q, k, v)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t, fmt in zip(names, tensors, (q_format, kv_format, kv_format)):
        if t.dim() != _dims(fmt):
            raise ValueError(
                f"{name} must have {_dims(fmt)} dims in format {fmt} "
                f"({'[t, h, d]' if fmt == 'thd' else '[' + ', '.join(fmt) + ']'}), "
                f"got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating point tensor, got {t.dtype}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have stride 1 in its last (head) dimension, got strides {t.stride()}")
    for name, t in zip(names[1:], tensors[1:]):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from query_layer dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but query_layer is on {q.device}")
    if q.shape[-2] != num_heads:
        raise ValueError(
            f"query_layer has {q.shape[-2]} heads but the module was built with "
            f"num_attention_heads={num_heads}")
    for name, t in zip(names[1:], tensors[1:]):
        if t.shape[-2] != num_gqa_groups:
            raise ValueError(
                f"{name} has {t.shape[-2]} heads but the module was built with "
                f"num_gqa_groups={num_gqa_groups}")
    if q.shape[-1] != head_dim_qk or k.shape[-1] != head_dim_qk:
        raise ValueError(
            f"query_layer and key_layer head dims must equal kv_channels={head_dim_qk}, "
            f"got {q.shape[-1]} and {k.shape[-1]}")
    if v.shape[-1] != head_dim_v:
        raise ValueError(
            f"value_layer head dim must be {head_dim_v} (v channels), got {v.shape[-1]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"key_layer and value_layer must agree in all but the head dim, got "
            f"{tuple(k.shape)} and {tuple(v.shape)}")
    _, bq = seq_batch_of(q, q_format)
    _, bk = kv_seq_batch(k, kv_format, page_table)
    if bq is not None and bk is not None and bq != bk:
        kv_side = "key_layer" if page_table is None else "page_table's rows:"
        raise ValueError(f"query_layer batch {bq} differs from {kv_side} batch {bk}")
