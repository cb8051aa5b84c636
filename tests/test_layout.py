"""Layout detection: exact on real views, copies (never misreads) anything else."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transformer_fa.attention.layout import detect_qkv_layout, get_qkv_layout

S, B, H, D = 5, 3, 4, 8


def outer(fmt):
    return {"sbhd": [S, B], "bshd": [B, S], "thd": [S * B]}[fmt]


def packed(fmt, n, heads_first, h=H, d=D):
    """n views of one dense buffer [outer, n, h, d] (or [outer, h, n, d] if heads_first)."""
    shape = outer(fmt) + ([h, n, d] if heads_first else [n, h, d])
    buf = torch.randn(shape)
    dim = len(outer(fmt)) + (1 if heads_first else 0)
    return [buf.select(dim, i) for i in range(n)]


def separate(fmt, h=H):
    return torch.randn(outer(fmt) + [h, D])


EXPECTED = []
for fmt, p in (("sbhd", "sb"), ("bshd", "bs"), ("thd", "t")):
    EXPECTED += [
        (fmt, f"{p}3hd", lambda f=fmt: packed(f, 3, False)),
        (fmt, f"{p}h3d", lambda f=fmt: packed(f, 3, True)),
        (fmt, f"{fmt}_{p}2hd", lambda f=fmt: [separate(f)] + packed(f, 2, False)),
        (fmt, f"{fmt}_{p}h2d", lambda f=fmt: [separate(f)] + packed(f, 2, True)),
        (fmt, f"{fmt}_{fmt}_{fmt}", lambda f=fmt: [separate(f) for _ in range(3)]),
    ]
for q_fmt, kv_fmt in (("sbhd", "bshd"), ("bshd", "sbhd"), ("thd", "bshd"), ("thd", "sbhd")):
    EXPECTED.append((f"{q_fmt}_2{kv_fmt}", f"{q_fmt}_{kv_fmt}_{kv_fmt}",
                     lambda a=q_fmt, b=kv_fmt: [separate(a), separate(b), separate(b)]))


def reads_back(layout, fmt, q, k, v):
    """Reads q, k, v from memory the way a backend trusting ``layout`` would."""
    parts = layout.split("_")
    groups = [[q, k, v]] if len(parts) == 1 else ([[q], [k, v]] if len(parts) == 2 else [[q], [k], [v]])
    out = []
    for group in groups:
        t = group[0]
        n = len(group)
        code = parts[0] if n == 3 else parts[-1]
        heads_first = f"h{n}d" in code
        lead = list(t.shape[:-2])
        h, d = t.shape[-2:]
        shape = lead + ([h, n, d] if heads_first else [n, h, d]) if n > 1 else lead + [h, d]
        strides = torch.empty(shape).stride()
        base = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), shape, strides)
        dim = len(lead) + (1 if heads_first else 0)
        out += [base.select(dim, i) for i in range(n)] if n > 1 else [base]
    return out


@pytest.mark.parametrize("fmt,layout,make", EXPECTED, ids=[e[1] for e in EXPECTED])
def test_real_views_are_detected_without_copy(fmt, layout, make):
    q, k, v = make()
    got, q2, k2, v2 = get_qkv_layout(q, k, v, fmt)
    assert got == layout
    assert all(a is b for a, b in zip((q, k, v), (q2, k2, v2))), "a detected layout is never copied"
    for read, t in zip(reads_back(layout, fmt, q, k, v), (q, k, v)):
        assert torch.equal(read, t)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 1), (6, 3)])
def test_fused_gqa_projection_split_is_copied_not_misread(hq, hkv):
    # The classic trap: [s, b, hq + 2*hkv, d] split along heads into q, k, v.
    fused = torch.randn(S, B, hq + 2 * hkv, D)
    q, k, v = fused.split([hq, hkv, hkv], dim=2)
    assert detect_qkv_layout(q, k, v, "sbhd") is None
    layout, q2, k2, v2 = get_qkv_layout(q, k, v, "sbhd")
    assert layout == "sbhd_sbhd_sbhd"
    for a, b in zip((q, k, v), (q2, k2, v2)):
        assert b.is_contiguous() and torch.equal(a, b)


def test_equal_head_split_is_exactly_3hd():
    # With hq == hkv the same split *is* the [s, b, 3, h, d] buffer: memory-exact answer.
    q, k, v = torch.randn(S, B, 3 * H, D).split(H, dim=2)
    assert detect_qkv_layout(q, k, v, "sbhd") == "sb3hd"


def test_same_shape_tensors_in_other_storages_are_not_packed():
    a, b, c = packed("sbhd", 3, False)
    other = b.clone()
    assert detect_qkv_layout(a, other, c, "sbhd") is None  # k from another buffer
    assert get_qkv_layout(a, other, c, "sbhd")[0] == "sbhd_sbhd_sbhd"


def test_swapped_order_is_not_packed():
    q, k, v = packed("bshd", 3, False)
    assert detect_qkv_layout(k, q, v, "bshd") is None


@settings(max_examples=200, deadline=None)
@given(
    fmt=st.sampled_from(["sbhd", "bshd"]),
    s=st.integers(1, 4), b=st.integers(1, 3), h=st.integers(1, 3), d=st.integers(1, 4),
    extra_heads=st.integers(0, 3), extra_d=st.integers(0, 2), swap_outer=st.booleans(),
    offsets=st.lists(st.integers(0, 3), min_size=3, max_size=3),
    pack=st.sampled_from(["none", "heads", "new_before", "new_after"]),
)
def test_strided_views_are_detected_right_or_copied(fmt, s, b, h, d, extra_heads, extra_d,
                                                     swap_outer, offsets, pack):
    """Views cut from random buffers: whatever layout is reported must read back exactly."""
    if pack == "heads":  # q, k, v as head slices of one buffer
        buf = torch.randn(s, b, 3 * h + extra_heads, d + extra_d)
        starts = sorted(offsets)
        starts = [starts[0], starts[0] + h + starts[1] - starts[0], 0]
        starts[2] = starts[1] + h + (offsets[2] % 2)
        if starts[2] + h > buf.shape[2]:
            buf = torch.randn(s, b, starts[2] + h, d + extra_d)
        views = [buf[:, :, st_: st_ + h, :d] for st_ in starts]
    elif pack in ("new_before", "new_after"):
        shape = [s, b, 3 + extra_heads % 2, h, d + extra_d] if pack == "new_before" else \
            [s, b, h, 3 + extra_heads % 2, d + extra_d]
        buf = torch.randn(shape)
        views = [buf.select(2 if pack == "new_before" else 3, i)[..., :d] for i in range(3)]
    else:
        views = [torch.randn(s, b, h + extra_heads, d + extra_d)[:, :, :h, :d] for _ in range(3)]
    if swap_outer:
        views = [x.transpose(0, 1) for x in views]
    q, k, v = views
    layout, q2, k2, v2 = get_qkv_layout(q, k, v, fmt)
    for a, c in zip((q, k, v), (q2, k2, v2)):
        assert torch.equal(a, c)
    for read, t in zip(reads_back(layout, fmt, q2, k2, v2), (q2, k2, v2)):
        assert torch.equal(read, t), layout
