"""FlashAttention's Python side on CPU: the autograd.Function, the torch.library ops and
torch.compile, run against a stand-in for the extension (``TorchFlash``: the binding's fwd
and bwd in torch math, raising like the binding on memory the kernels cannot read).

What the stand-in cannot tell (the kernels' numbers) is tests/gpu/test_flash.py's job; here
the arguments, their order, what is saved for the backward and the copies are checked,
against the unfused backend.
"""
import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

from transformer_fa.attention.backends import flash, unfused
from transformer_fa.attention.backends.support import aligned
from transformer_fa.attention.multi_head_attention import split_views
from transformer_fa.attention.params import AttentionInputs, AttentionParams

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import philox  # noqa: E402  (tests/gpu/philox.py: the kernels' dropout mask)


class TorchFlash:
    """transformer_fa_flash's fwd and bwd (same arguments) in float32 torch math. The
    backward is written out (no autograd: it does not record inside a custom op's kernel)."""

    HEAD_DIMS = (64, 128, 192, 256)
    INSTANTIATIONS = [f"{t}_hdim{d}" for t in ("fp16", "bf16") for d in (64, 128, 192, 256)]

    def __init__(self):
        self.calls = []  # (name, dict of the interesting arguments)

    def fwd(self, q, k, v, cu_q, cu_k, q_format, kv_format, max_seqlen_q, max_seqlen_k, scale,
            left, right, bottom_right, return_lse, dropout_p, rng_state, alibi_slopes, family):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not aligned(t):
                raise RuntimeError(f"flash_attn_fwd: {name} is not kernel-ready")
        self.calls.append(("fwd", dict(return_lse=return_lse, rng=_copy(rng_state),
                                       family=family)))
        out, lse, _ = _attend(q, k, v, None, cu_q, cu_k, q_format, kv_format, scale, left,
                              right, bottom_right, dropout_p, rng_state, alibi_slopes)
        return [out.to(q.dtype), lse if return_lse else lse.new_empty((0,))]

    def bwd(self, dout, q, k, v, out, lse, cu_q, cu_k, q_format, kv_format, max_seqlen_q,
            max_seqlen_k, scale, left, right, bottom_right, dropout_p, rng_state, alibi_slopes,
            deterministic, grads=None):
        for name, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out)):
            if not aligned(t):
                raise RuntimeError(f"flash_attn_bwd: {name} is not kernel-ready")
        assert lse.numel() > 0, "the backward got no LSE"
        self.calls.append(("bwd", dict(
            rng=_copy(rng_state), deterministic=deterministic,
            grads_storage=None if grads is None else grads[0].untyped_storage().data_ptr())))
        _, _, computed = _attend(q, k, v, dout, cu_q, cu_k, q_format, kv_format, scale, left,
                                 right, bottom_right, dropout_p, rng_state, alibi_slopes)
        if grads is None:  # the binding's own buffers
            return [g.to(x.dtype) for g, x in zip(computed, (q, k, v))]
        for given, g, x in zip(grads, computed, (q, k, v)):
            assert given.shape == x.shape and given.dtype == x.dtype
            given.copy_(g)
        return grads


def _copy(t):
    return None if t is None else t.clone()


def _sequences(x, fmt: int, cu, b: int):
    """Per-sequence [len, h, d] views of a tensor in format fmt (0 bshd, 1 sbhd, 2 thd)."""
    if fmt == 2:
        return [x[int(cu[i]):int(cu[i + 1])] for i in range(b)]
    xb = x if fmt == 0 else x.transpose(0, 1)
    lens = [xb.shape[1]] * b if cu is None else (cu[1:] - cu[:-1]).tolist()
    return [xb[i, :n] for i, n in enumerate(lens)]


def _attend(q, k, v, dout, cu_q, cu_k, q_format, kv_format, scale, left, right, bottom_right,
            dropout_p, rng_state, slopes):
    """(out, lse, (dq, dk, dv) when dout is given), float32."""
    q, k, v = q.float(), k.float(), v.float()
    b = cu_q.numel() - 1 if cu_q is not None else q.shape[1 if q_format == 1 else 0]
    h, hk = q.shape[-2], k.shape[-2]
    g = h // hk
    out = torch.zeros_like(q)
    grads = tuple(torch.zeros_like(x) for x in (q, k, v))
    qs, ks, vs, os_ = (_sequences(x, f, cu, b) for x, f, cu in (
        (q, q_format, cu_q), (k, kv_format, cu_k), (v, kv_format, cu_k), (out, q_format, cu_q)))
    dos = _sequences(dout.float(), q_format, cu_q, b) if dout is not None else None
    dqs, dks, dvs = (_sequences(x, f, cu, b) for x, f, cu in (
        (grads[0], q_format, cu_q), (grads[1], kv_format, cu_k), (grads[2], kv_format, cu_k)))
    sq = max(x.shape[0] for x in qs)
    lse = (torch.full((h, q.shape[0]), math.inf) if q_format == 2
           else torch.full((b, h, q.shape[1 if q_format == 0 else 0]), math.inf))
    z = (philox.dropout_scale(rng_state, dropout_p, b, h, sq, max(x.shape[0] for x in ks))
         if dropout_p > 0 else None)
    start = 0
    for i in range(b):
        qb = qs[i]
        kb, vb = ks[i].repeat_interleave(g, 1), vs[i].repeat_interleave(g, 1)
        lq, lk = qb.shape[0], kb.shape[0]
        s = torch.einsum("qhd,khd->hqk", qb, kb) * scale
        diag = torch.arange(lq).view(-1, 1) + (lk - lq if bottom_right else 0)
        j = torch.arange(lk).view(1, -1)
        if slopes is not None:
            sl = slopes if slopes.dim() == 1 else slopes[i]
            s = s - sl.view(-1, 1, 1) * (diag - j).abs()
        keep = torch.ones(lq, lk, dtype=torch.bool)
        if left >= 0:
            keep &= j >= diag - left
        if right >= 0:
            keep &= j <= diag + right
        s = s.masked_fill(~keep, -math.inf)
        row_lse = torch.logsumexp(s, -1).nan_to_num(neginf=math.inf)  # no key: +inf
        p = torch.softmax(s, -1).nan_to_num(0.0)
        zb = z[i, :, :lq, :lk] if z is not None else torch.ones(())
        o = torch.einsum("hqk,khd->qhd", p * zb, vb)
        os_[i].copy_(o)
        if q_format == 2:
            lse[:, start:start + lq] = row_lse
            start += lq
        else:
            lse[i, :, :lq] = row_lse
        if dos is not None:
            do = dos[i]
            dv = torch.einsum("hqk,qhd->khd", p * zb, do)
            dp = torch.einsum("qhd,khd->hqk", do, vb) * zb
            ds = p * (dp - (do * o).sum(-1).t().unsqueeze(-1))
            dq = torch.einsum("hqk,khd->qhd", ds, kb) * scale
            dk = torch.einsum("hqk,qhd->khd", ds, qb) * scale
            dqs[i].copy_(dq)
            # GQA: a K/V head's gradient sums over the query heads of its group
            dks[i].copy_(dk.view(lk, hk, g, dk.shape[-1]).sum(2))
            dvs[i].copy_(dv.view(lk, hk, g, dv.shape[-1]).sum(2))
    return out, lse, grads


@pytest.fixture
def ext(monkeypatch):
    stand_in = TorchFlash()
    monkeypatch.setattr(flash, "_ext", stand_in)
    return stand_in


@pytest.fixture
def cpu_ops(ext):
    """CPU kernels for the two ops (registered for CUDA only), so torch.compile and opcheck
    can run them here; they call the same implementations as the CUDA ones. Registered for
    the test only."""
    def fwd(q, k, v, cu_q, cu_kv, rng, slopes, *call):
        return flash._fwd_impl(q, k, v, cu_q, cu_kv, rng, slopes, flash.FlashCall._make(call))

    def bwd(dout, q, k, v, out, lse, cu_q, cu_kv, rng, slopes, *call):
        return flash._bwd_impl(dout, q, k, v, out, lse, cu_q, cu_kv, rng, slopes,
                               flash.FlashCall._make(call))

    with torch.library._scoped_library("transformer_fa", "IMPL") as lib:
        lib.impl("flash_attn_fwd", fwd, "CPU")
        lib.impl("flash_attn_bwd", bwd, "CPU")
        yield ext


# ------------------------------------------------------------------------------------------
# Cases: (description, inputs, params)
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    fmt: str = "bshd"
    layout: str = "separate"   # separate | gqa_split | misaligned
    b: int = 2
    sq: int = 12
    skv: int = 12
    hq: int = 4
    hkv: int = 2
    d: int = 16
    mask: str = "causal"
    window: tuple = None
    lens_q: list = None        # thd / padding masks
    lens_kv: list = None
    alibi: tuple = None        # slopes shape
    dropout: float = 0.0

    def __post_init__(self):
        if self.window is None:
            self.window = (-1, 0) if "causal" in self.mask else (-1, -1)
        if self.lens_q is not None:
            self.b = len(self.lens_q)


CASES = {
    "bshd-causal-gqa": Case(),
    "sbhd-no_mask-sq!=skv": Case(fmt="sbhd", sq=7, skv=19, mask="no_mask", hkv=1),
    "bshd-gqa_split": Case(layout="gqa_split", mask="causal_bottom_right", hq=4, hkv=2),
    "bshd-misaligned": Case(layout="misaligned", mask="no_mask", window=(3, 2)),
    "thd-padding_causal_bottom_right-window": Case(
        fmt="thd", lens_q=[5, 17, 9], lens_kv=[9, 17, 20], mask="padding_causal_bottom_right",
        window=(6, 0)),
    "bshd-padding_causal": Case(lens_q=[12, 3, 7], lens_kv=[10, 12, 1], mask="padding_causal"),
    "bshd-alibi-bh": Case(alibi=(2, 4), mask="causal_bottom_right", sq=8, skv=20),
    "thd-alibi-h": Case(fmt="thd", lens_q=[5, 11], lens_kv=[8, 11], alibi=(4,),
                        mask="padding"),
}


def build(c: Case, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    thd = c.fmt == "thd"

    def make(n, s, h, lens):
        if thd:
            return torch.randn(sum(lens), h, c.d, generator=gen, dtype=dtype)
        x = torch.randn(c.b, s, h, c.d, generator=gen, dtype=dtype)
        return x.transpose(0, 1).contiguous() if c.fmt == "sbhd" else x

    q = make(c.b, c.sq, c.hq, c.lens_q)
    k = make(c.b, c.skv, c.hkv, c.lens_kv)
    v = make(c.b, c.skv, c.hkv, c.lens_kv)
    if c.layout == "gqa_split":
        buf = torch.cat([q, k, v], dim=-2).requires_grad_()
        leaves = [buf]
        q, k, v = buf.split([c.hq, c.hkv, c.hkv], dim=-2)
    elif c.layout == "misaligned":
        leaves = []
        tensors = []
        for x in (q, k, v):
            mem = torch.empty(x.numel() + 1, dtype=dtype)
            leaf = mem[1:].view(x.shape).copy_(x).requires_grad_()
            leaves.append(leaf)
            tensors.append(leaf)
        q, k, v = tensors
    else:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        leaves = [q, k, v]
    cu = (lambda lens: None if lens is None else
          torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32))
    slopes = (None if c.alibi is None else
              torch.rand(c.alibi, generator=gen) * 0.5 + 0.1)
    sq = max(c.lens_q) if thd else c.sq
    skv = max(c.lens_kv) if thd else c.skv
    mask = c.mask
    if thd and "padding" not in mask:
        mask = "padding" if mask == "no_mask" else "padding_" + mask
    params = AttentionParams(
        qkv_format=c.fmt, q_format=c.fmt, kv_format=c.fmt,
        qkv_layout="_".join([c.fmt] * 3), batch_size=c.b, num_heads=c.hq,
        num_gqa_groups=c.hkv, max_seqlen_q=sq, max_seqlen_kv=skv, head_dim_qk=c.d,
        head_dim_v=c.d, dtype=dtype, device_type="cpu", compute_capability=None,
        attn_mask_type=mask, window_size=c.window,
        core_attention_bias_type="alibi" if c.alibi else "no_bias",
        core_attention_bias_shape=None, core_attention_bias_requires_grad=False,
        alibi_slopes_shape=c.alibi, attention_dropout=c.dropout,
        softmax_scale=1.0 / math.sqrt(c.d), deterministic=False, requires_grad=True)
    inputs = AttentionInputs(q, k, v, cu(c.lens_q), cu(c.lens_kv), alibi_slopes=slopes)
    return inputs, params, leaves


def grads_of(out, leaves, seed=1):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, leaves, dout.to(out.dtype))


# ------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_matches_unfused(ext, name):
    inputs, params, leaves = build(CASES[name])
    out = flash.run(inputs, params)
    ref = unfused.run(inputs, params)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(grads_of(out, leaves), grads_of(ref, leaves)):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)
    assert [name for name, _ in ext.calls] == ["fwd", "bwd"]
    assert ext.calls[0][1]["return_lse"]


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_packed_qkv_gets_its_gradient_without_a_copy(ext, fmt):
    """q, k, v split from one fused projection output get dq, dk, dv as views of one buffer
    laid out as that output, which the split's backward then returns as it is (no cat)."""
    c = Case(fmt=fmt, lens_q=[5, 9] if fmt == "thd" else None,
             lens_kv=[5, 9] if fmt == "thd" else None,
             mask="padding_causal" if fmt == "thd" else "causal", hq=4, hkv=2)
    inputs, params, _ = build(c)
    mixed = torch.cat([inputs.q, inputs.k, inputs.v], dim=-2).detach().requires_grad_()
    q, k, v = split_views(mixed, [c.hq, c.hkv, c.hkv], -2)
    packed = dataclasses.replace(inputs, q=q, k=k, v=v)
    out = flash.run(packed, params)
    (grad,) = grads_of(out, [mixed])
    storage = ext.calls[-1][1]["grads_storage"]
    assert storage is not None and grad.untyped_storage().data_ptr() == storage
    (ref,) = grads_of(unfused.run(packed, params), [mixed])
    torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-5)


def test_no_grad_asks_for_no_lse(ext):
    inputs, params, _ = build(CASES["bshd-causal-gqa"])
    with torch.no_grad():
        flash.run(inputs, params)
    assert ext.calls == [("fwd", dict(return_lse=False, rng=None, family=0))]


@pytest.mark.parametrize("value,family", [("sm80", 80), ("sm90", 90), ("auto", 0), ("", 0)])
def test_kernel_family_request_reaches_the_binding(ext, monkeypatch, value, family):
    """TRANSFORMER_FA_FLASH_FAMILY picks the forward's kernel family (tests, benchmarks)."""
    monkeypatch.setenv("TRANSFORMER_FA_FLASH_FAMILY", value)
    inputs, params, _ = build(CASES["bshd-causal-gqa"])
    with torch.no_grad():
        flash.run(inputs, params)
    assert ext.calls[0][1]["family"] == family


def test_unknown_kernel_family_is_a_clear_error(ext, monkeypatch):
    monkeypatch.setenv("TRANSFORMER_FA_FLASH_FAMILY", "sm100")
    inputs, params, _ = build(CASES["bshd-causal-gqa"])
    with pytest.raises(ValueError, match="TRANSFORMER_FA_FLASH_FAMILY must be one of auto, "
                                         "sm80, sm90, got 'sm100'"):
        flash.run(inputs, params)
    assert ext.calls == []


def test_strided_dout_is_copied(ext):
    """out.sum() hands the backward an expanded (stride 0) dout: the binding would refuse it."""
    inputs, params, leaves = build(CASES["bshd-causal-gqa"])
    out = flash.run(inputs, params)
    ref = unfused.run(inputs, params)
    for g, g_ref in zip(torch.autograd.grad(out.sum(), leaves),
                        torch.autograd.grad(ref.sum(), leaves)):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


def _dropout_run(case, seed):
    inputs, params, leaves = build(case)
    torch.manual_seed(seed)
    out = flash.run(inputs, params)
    return (out,) + grads_of(out, leaves)


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_dropout_state_drawn_from_torch_and_saved(ext, fmt):
    c = Case(dropout=0.3) if fmt == "bshd" else Case(
        fmt="thd", lens_q=[5, 17], lens_kv=[9, 17], mask="padding_causal", dropout=0.3)
    first = _dropout_run(c, 7)
    fwd, bwd = ext.calls[0][1]["rng"], ext.calls[1][1]["rng"]
    assert fwd is not None and torch.equal(fwd, bwd), "the backward got another rng_state"
    again = _dropout_run(c, 7)
    other = _dropout_run(c, 8)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])
    # The state is torch's draw (support.dropout_rng_state), so manual_seed reproduces it.
    torch.manual_seed(7)
    assert torch.equal(fwd, torch.randint(0, 2 ** 62, (2,), dtype=torch.int64))


def test_deterministic_reaches_the_backward(ext):
    inputs, params, leaves = build(CASES["bshd-causal-gqa"])
    grads_of(flash.run(inputs, dataclasses.replace(params, deterministic=True)), leaves)
    assert ext.calls[-1] == ("bwd", dict(rng=None, deterministic=True, grads_storage=None))


@pytest.mark.parametrize("name", ["thd-padding_causal_bottom_right-window", "alibi+dropout"])
def test_torch_compile_matches_eager(cpu_ops, name):
    c = CASES.get(name) or Case(alibi=(2, 4), mask="causal_bottom_right", sq=8, skv=20,
                                dropout=0.2)
    inputs, params, leaves = build(c)

    def fn(q, k, v):
        return flash.run(dataclasses.replace(inputs, q=q, k=k, v=v), params)

    torch.manual_seed(3)
    eager = fn(inputs.q, inputs.k, inputs.v)
    g_eager = grads_of(eager, leaves)
    cpu_ops.calls.clear()
    torch.manual_seed(3)
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(inputs.q, inputs.k, inputs.v)
    g = grads_of(out, leaves)
    assert [name for name, _ in cpu_ops.calls] == ["fwd", "bwd"]
    assert torch.equal(out, eager)
    for a, b in zip(g, g_eager):
        assert torch.equal(a, b)


def test_opcheck(cpu_ops):
    inputs, params, _ = build(CASES["thd-alibi-h"])
    q, k, v = (x.detach().clone().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
    rng = torch.tensor([12345, 678], dtype=torch.int64)
    call = flash.FlashCall("thd", "thd", params.max_seqlen_q, params.max_seqlen_kv, 0.25, -1,
                           -1, True, 0.1, False, True)
    args = (q, k, v, inputs.cu_seqlens_q, inputs.cu_seqlens_kv, rng, inputs.alibi_slopes,
            *call)
    torch.library.opcheck(torch.ops.transformer_fa.flash_attn_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor", "test_aot_dispatch_dynamic"))


def test_philox_known_answers():
    """tests/gpu/philox.py against Random123's published Philox4x32-10 vectors."""
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2,
            (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in kat:
        assert tuple(int(w) for w in philox.philox4x32_10(*counter, *key)) == want
    keep = philox.keep_mask((2 ** 40 + 5, 3), 0.25, 2, 3, 100, 90)
    assert abs(keep.float().mean().item() - 0.75) < 0.01
    assert philox.threshold(0.0) == 2 ** 32 - 1


def test_packed_extent_only_for_exact_tilings():
    """Gradients share one buffer only where q, k, v tile one dense block exactly: TE's
    packed layouts and a fused GQA projection's head split; never overlapping or gapped
    views (the kernels would write one gradient over another, or past the buffer)."""
    from transformer_fa.attention.backends.support import packed_extent

    s, b, h, d = 5, 2, 4, 8
    mixed = torch.randn(s, b, 3 * h * d)
    assert packed_extent(mixed.view(s, b, 3, h, d).unbind(2)) == (0, mixed.numel())  # sb3hd
    assert packed_extent(mixed.view(s, b, h, 3, d).unbind(3)) == (0, mixed.numel())  # sbh3d
    gqa = mixed.view(s, b, 6, 2, d).split([4, 1, 1], dim=2)  # 8 query, 2 KV heads
    assert packed_extent([t.reshape(s, b, -1, d) for t in gqa]) == (0, mixed.numel())
    x = torch.randn(s, b, h, d)
    assert packed_extent((x, x, x)) is None  # one tensor three times
    wide = torch.randn(s, b, 4 * h * d).view(s, b, 4, h, d)
    assert packed_extent(wide[:, :, :3].unbind(2)) is None  # a gap after v
    halves = torch.randn(s, b, 2 * h, d)
    assert packed_extent((halves[:, :, :h], halves[:, :, 1:h + 1])) is None  # overlapping
    q, k, v = mixed.view(s, b, 3, h, d).unbind(2)
    assert packed_extent((q, k.double(), v)) is None
