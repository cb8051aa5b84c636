"""FusedAttention (cuDNN through cudnn-frontend) on a GPU.

Each case runs the backend's ``run`` directly (tensors built as real views of one buffer where
the layout packs them), then forward and backward are checked against a float32 reference in
plain torch math: the error may be at most 2x the error of the same math done in the input
dtype, plus a small atol (the FlashAttention rule). Padding rows must be zero.

Cases that a support check may decline (cuDNN's own validation) are skipped with its reason,
except the ones marked ``must``: those the backend claims and must serve.
Skipped without CUDA or without cudnn-frontend.
"""
import dataclasses
import math

import pytest
import torch

pytest.importorskip("cudnn", reason="cudnn-frontend (nvidia-cudnn-frontend) is not installed")
if not torch.cuda.is_available():
    pytest.skip("FusedAttention tests need CUDA", allow_module_level=True)

from transformer_fa.attention.backends import fused  # noqa: E402
from transformer_fa.attention.params import AttentionInputs, AttentionParams  # noqa: E402

from attention_cases import (DEV, Case, alibi_bias, build_inputs, capture_log, check,  # noqa: E402
                             cu_seqlens, keep_mask, out_to_padded, pad_rows, reference, to_format,
                             to_padded, valid_rows)

CC = torch.cuda.get_device_capability()
if CC[0] not in fused.SUPPORTED_ARCH_MAJORS:
    pytest.skip(f"FusedAttention does not claim sm{CC[0]}{CC[1]}", allow_module_level=True)


# ------------------------------------------------------------------------------------------
# Case description and input construction
# ------------------------------------------------------------------------------------------
def make_params(c: Case, q, requires_grad=True, dropout=0.0, deterministic=False,
                bias_shape=None, slopes_shape=None):
    thd = "thd" in (c.fmt, c.kv_fmt)
    return AttentionParams(
        qkv_format=c.qkv_format, q_format=c.fmt, kv_format=c.kv_fmt,
        qkv_layout=c.layout_name, batch_size=c.b, num_heads=c.hq, num_gqa_groups=c.hkv,
        max_seqlen_q=c.sq, max_seqlen_kv=c.skv, head_dim_qk=c.dqk, head_dim_v=c.dv,
        dtype=c.dtype, device_type="cuda", compute_capability=CC,
        attn_mask_type=c.mask if not thd or "padding" in c.mask else (
            "padding" if c.mask == "no_mask" else "padding_" + c.mask),
        window_size=c.window,
        core_attention_bias_type=("post_scale_bias" if c.bias else
                                  "alibi" if c.alibi else "no_bias"),
        core_attention_bias_shape=bias_shape,
        core_attention_bias_requires_grad=bool(c.bias and c.bias_grad),
        alibi_slopes_shape=slopes_shape, attention_dropout=dropout,
        softmax_scale=c.scale if c.scale is not None else 1.0 / math.sqrt(c.dqk),
        deterministic=deterministic, requires_grad=requires_grad)


# ------------------------------------------------------------------------------------------
# Running one case
# ------------------------------------------------------------------------------------------
def run_fused(c: Case, q, k, v, bias=None, slopes=None, dropout=0.0, deterministic=False,
              requires_grad=True):
    cu_q = cu_seqlens(c.lens_q) if c.padded else None
    cu_kv = cu_seqlens(c.lens_kv) if c.padded else None
    bias_shape = None
    if bias is not None:
        bias_shape = ("b" if bias.shape[0] > 1 else "1") + ("h" if bias.shape[1] > 1 else "1") + "ss"
    params = make_params(c, q, requires_grad=requires_grad, dropout=dropout,
                         deterministic=deterministic, bias_shape=bias_shape,
                         slopes_shape=None if slopes is None else tuple(slopes.shape))
    reasons = fused.not_supported_reasons(params)
    if reasons:
        if c.must:
            pytest.fail(f"FusedAttention declined a claimed case {c}: {reasons}")
        pytest.skip(f"declined: {reasons[0][:300]}")
    inputs = AttentionInputs(q, k, v, cu_q, cu_kv, None, bias, slopes)
    return fused.run(inputs, params), params


def run_case(c: Case, seed=0, mangle=None):
    (qp, kp, vp), (q, k, v), leaves = build_inputs(c, seed)
    if mangle is not None:  # same values, other memory
        q, k, v = mangle(q, k, v)
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    thd = "thd" in (c.fmt, c.kv_fmt)
    mask_type = c.mask if not thd or "padding" in c.mask else (
        "padding" if c.mask == "no_mask" else "padding_" + c.mask)
    bias = slopes = None
    ref_bias32 = ref_biasdt = None
    if c.bias:
        shape = (c.b if c.bias[0] == "b" else 1, c.hq if c.bias[1] == "h" else 1, c.sq, c.skv)
        bias = torch.randn(shape, generator=gen, device=DEV).to(c.dtype).requires_grad_(c.bias_grad)
        ref_bias32 = bias.detach().float().requires_grad_(c.bias_grad)
        ref_biasdt = bias.detach().clone().requires_grad_(c.bias_grad)
    if c.alibi:
        base = torch.tensor([2.0 ** (-8.0 * (h + 1) / c.hq) for h in range(c.hq)], device=DEV)
        slopes = base if c.alibi == "h" else (
            base.view(1, -1) * torch.rand(c.b, 1, generator=gen, device=DEV) * 2)
        # The input-dtype reference adds ALiBi exactly, to float32 scores (as a kernel that
        # makes the bias itself): rounding the bias is the backend's error, not the dtype's.
        ref_bias32 = ref_biasdt = alibi_bias(c, slopes, mask_type)

    out, params = run_fused(c, q, k, v, bias=bias, slopes=slopes)
    assert out.dtype == c.dtype
    expected_shape = {"sbhd": (c.sq, c.b, c.hq * c.dv), "bshd": (c.b, c.sq, c.hq * c.dv),
                      "thd": (q.shape[0], c.hq * c.dv)}[c.fmt]
    assert tuple(out.shape) == expected_shape
    dout = torch.randn(out.shape, generator=gen, device=DEV).to(c.dtype)
    wrt = [q, k, v] + ([bias] if c.bias and c.bias_grad else [])
    grads = torch.autograd.grad(out, wrt, dout)

    keep = keep_mask(c, mask_type)
    scale = params.softmax_scale
    lens_q, lens_kv = c.lens_q, c.lens_kv
    refs = {}
    for upcast in (True, False):
        qr = qp.detach().clone().float().requires_grad_() if upcast else qp.detach().clone().requires_grad_()
        kr = kp.detach().clone().float().requires_grad_() if upcast else kp.detach().clone().requires_grad_()
        vr = vp.detach().clone().float().requires_grad_() if upcast else vp.detach().clone().requires_grad_()
        br = ref_bias32 if upcast else ref_biasdt
        o = reference(qr, kr, vr, keep, scale, br, upcast, float_bias=bool(c.alibi))[0]
        dop = out_to_padded(dout, c)
        rw = [qr, kr, vr] + ([br] if c.bias and c.bias_grad else [])
        g = torch.autograd.grad(o, rw, dop.to(o.dtype))
        refs[upcast] = (o.detach(), [x.detach() for x in g])

    atol = 2e-3 if c.dtype == torch.float16 else 8e-3
    outp = out_to_padded(out.detach(), c)
    check(f"out {c}", valid_rows(outp, lens_q), valid_rows(refs[True][0], lens_q),
          valid_rows(refs[False][0], lens_q), atol)
    if c.padded and c.fmt != "thd":
        assert (pad_rows(outp, lens_q) == 0).all(), "padded query rows of the output are not zero"
    if c.fmt == "thd" and q.shape[0] > sum(lens_q):
        assert (out[sum(lens_q):] == 0).all()

    names = ("dq", "dk", "dv")
    fmts = (c.fmt, c.kv_fmt, c.kv_fmt)
    lens = (lens_q, lens_kv, lens_kv)
    seqs = (c.sq, c.skv, c.skv)
    for i in range(3):
        gp = to_padded(grads[i].detach(), fmts[i], lens[i], seqs[i])
        check(f"{names[i]} {c}", valid_rows(gp, lens[i]), valid_rows(refs[True][1][i], lens[i]),
              valid_rows(refs[False][1][i], lens[i]), atol)
        if c.padded and fmts[i] != "thd":
            assert (pad_rows(gp, lens[i]) == 0).all(), f"{names[i]} is not zero in padding rows"
    if c.bias and c.bias_grad:
        check(f"dbias {c}", grads[3], refs[True][1][3], refs[False][1][3], atol)
        assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype


# ------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------
HEAD_DIM_CASES = [Case(dqk=dqk, dv=dv, dtype=torch.bfloat16 if i % 2 else torch.float16,
                       sq=160, skv=224, hq=4, hkv=2, mask="causal")
                  for i, (dqk, dv) in enumerate(sorted(fused.SUPPORTED_HEAD_DIMS))]

MASK_CASES = []
for i, (mask, sq, skv, window) in enumerate([
        ("no_mask", 128, 128, None), ("no_mask", 96, 200, None), ("no_mask", 200, 96, None),
        ("causal", 128, 128, None), ("causal", 96, 200, None), ("causal", 200, 96, None),
        ("causal_bottom_right", 96, 200, None), ("causal_bottom_right", 128, 128, None),
        ("causal", 256, 256, (32, 0)), ("causal", 128, 256, (48, 0)),
        ("causal_bottom_right", 128, 256, (48, 0)),
        ("no_mask", 256, 256, (32, 16)), ("no_mask", 128, 256, (20, 30)),
        ("padding", 128, 128, None), ("padding", 96, 160, None),
        ("padding_causal", 128, 128, None), ("padding_causal", 160, 96, None),
        ("padding_causal_bottom_right", 96, 160, None),
        ("padding_causal_bottom_right", 160, 96, None),
        ("padding_causal", 192, 192, (24, 0)), ("padding", 192, 192, (24, 24))]):
    # sliding windows with a right side, and bottom-right masks with more queries than keys,
    # are up to cuDNN's own validation
    must = not ((window is not None and window[1] > 0) or
                ("bottom_right" in mask and sq > skv) or (window is not None and sq != skv))
    MASK_CASES.append(Case(mask=mask, sq=sq, skv=skv, window=window, hq=4, hkv=4,
                           dqk=64 if i % 3 else 128,
                           dtype=torch.float16 if i % 2 else torch.bfloat16, must=must))

GQA_CASES = [Case(hq=8, hkv=hkv, mask=m, sq=192, skv=192, window=w)
             for hkv, m, w in [(2, "causal", None), (1, "no_mask", None), (1, "causal", (40, 0)),
                               (4, "padding_causal", None)]]

LAYOUT_CASES = []
for fmt in ("sbhd", "bshd", "thd"):
    for layout in ("3", "h3", "2", "h2", "separate"):
        LAYOUT_CASES.append(Case(fmt=fmt, layout=layout, b=3, sq=136, hq=4,
                                 mask="padding_causal" if fmt == "thd" else "causal"))
LAYOUT_CASES += [
    Case(fmt="sbhd", layout="gqa_split", hq=8, hkv=2, sq=128),        # the classic trap
    Case(fmt="bshd", layout="gqa_split", hq=6, hkv=2, sq=100, mask="no_mask"),
    Case(fmt="sbhd", kv_fmt="bshd", sq=96, skv=160, mask="no_mask"),  # mixed formats
    Case(fmt="bshd", kv_fmt="sbhd", sq=160, skv=160, mask="causal"),
    Case(fmt="thd", kv_fmt="bshd", lens_q=[30, 64, 7], lens_kv=[64, 40, 64], sq=64, skv=64,
         mask="padding", must=False),
]

VARLEN_CASES = [
    Case(fmt="thd", lens_q=[37, 256, 1, 90], mask="padding"),
    Case(fmt="thd", lens_q=[37, 256, 1, 90], mask="padding_causal", dtype=torch.float16),
    Case(fmt="thd", lens_q=[100, 20, 64], lens_kv=[180, 20, 33], mask="padding"),
    Case(fmt="thd", lens_q=[100, 20, 64], lens_kv=[180, 20, 33],
         mask="padding_causal_bottom_right", must=False),
    Case(fmt="thd", lens_q=[50, 200, 129], lens_kv=[60, 250, 129], mask="padding_causal",
         hq=8, hkv=2, dqk=128),
    Case(fmt="thd", lens_q=[300, 17, 128], mask="padding_causal", window=(64, 0)),
    Case(fmt="thd", lens_q=[300, 17, 128], mask="padding", window=(32, 32), must=False),
    Case(fmt="sbhd", lens_q=[128, 3, 77], lens_kv=[128, 100, 1], sq=128, mask="padding_causal",
         dtype=torch.float16),
    Case(fmt="bshd", lens_q=[128, 0, 77], lens_kv=[128, 100, 0], sq=128, mask="padding",
         must=False),  # empty sequences: zero rows expected
]

BIAS_CASES = [
    Case(bias="1hss", bias_grad=True, mask="no_mask", sq=128, skv=192),
    Case(bias="1hss", bias_grad=True, mask="causal", dtype=torch.float16),
    Case(bias="bhss", bias_grad=False, mask="padding_causal", sq=128),
    Case(bias="b1ss", bias_grad=False, mask="no_mask"),
    Case(bias="11ss", bias_grad=False, mask="causal"),
    Case(bias="bhss", bias_grad=True, mask="no_mask", must=False),
    Case(bias="11ss", bias_grad=True, mask="no_mask", must=False),
    Case(alibi="h", mask="causal", sq=128, skv=128),
    Case(alibi="h", mask="no_mask", sq=96, skv=160, dtype=torch.float16),
    Case(alibi="bh", mask="padding", sq=128, skv=128),
    Case(alibi="h", mask="padding_causal", sq=160, skv=160, dtype=torch.float16),
]


# ALiBi far from the diagonal: with sq > skv the early rows (bottom-right) or the late rows
# (top-left causal) have only keys at a distance in the thousands. Slopes that are not powers
# of two (the "bh" draw) are not exact in fp16/bf16 at that size: a bias rounded there was off
# by 0.3 (fp16) and 2 (bf16) in the output against an allowed 1e-2 / 6e-2.
ALIBI_FAR_CASES = [
    Case(alibi="bh", mask="no_mask", sq=2048, skv=128, dtype=torch.float16),
    Case(alibi="bh", mask="no_mask", sq=2048, skv=128, dtype=torch.bfloat16),
    Case(alibi="bh", mask="causal", sq=2048, skv=128, dtype=torch.float16),
    Case(alibi="bh", mask="causal", sq=2048, skv=128, dtype=torch.bfloat16),
    Case(alibi="bh", mask="no_mask", sq=2048, skv=2048, dtype=torch.bfloat16),
    Case(alibi="h", mask="causal", sq=2048, skv=2048, dtype=torch.float16),
]


@pytest.mark.parametrize("case", HEAD_DIM_CASES, ids=str)
def test_head_dims(case):
    run_case(case)


@pytest.mark.parametrize("case", MASK_CASES, ids=str)
def test_masks(case):
    run_case(case)


@pytest.mark.parametrize("case", GQA_CASES, ids=str)
def test_gqa_mqa(case):
    run_case(case)


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=str)
def test_layouts(case):
    run_case(case)


@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_varlen(case):
    run_case(case)


@pytest.mark.parametrize("case", BIAS_CASES, ids=str)
def test_bias_and_alibi(case):
    run_case(case)


@pytest.mark.parametrize("case", ALIBI_FAR_CASES, ids=str)
def test_alibi_far_from_the_diagonal(case):
    """Forward and gradients within the rule where the ALiBi bias is large."""
    run_case(case)


# ------------------------------------------------------------------------------------------
# Dropout, determinism, execution details
# ------------------------------------------------------------------------------------------
def _dropout_run(c, q, k, v, p, seed):
    torch.manual_seed(seed)
    out, _ = run_fused(c, q, k, v, dropout=p)
    return out


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_dropout(fmt):
    """cuDNN's dropout mask, read back with V = I, must be the one its backward uses."""
    p = 0.25
    n = 64
    c = Case(fmt=fmt, b=2, sq=n, skv=n, hq=2, dqk=n, mask="no_mask" if fmt == "bshd" else "padding",
             lens_q=[n, n] if fmt == "thd" else None, dtype=torch.float16)
    (qp, kp, _), (q, k, _), _ = build_inputs(c)
    eye = torch.eye(n, device=DEV, dtype=c.dtype).view(1, n, 1, n).expand(c.b, n, c.hkv, n)
    v_eye = to_format(eye.contiguous(), fmt, c.lens_kv).contiguous()
    with torch.no_grad():
        m = out_to_padded(_dropout_run(c, q, k, v_eye, p, 7), c).float()  # [b, sq, h, skv]
        m_again = out_to_padded(_dropout_run(c, q, k, v_eye, p, 7), c).float()
        m_other = out_to_padded(_dropout_run(c, q, k, v_eye, p, 8), c).float()
    assert torch.equal(m, m_again), "same seed, different dropout mask"
    assert not torch.equal(m, m_other), "different seeds, same dropout mask"

    scale = 1.0 / math.sqrt(n)
    s = torch.einsum("bqhd,bkhd->bhqk", qp.float(), kp.float()) * scale
    prob = torch.softmax(s, -1).permute(0, 2, 1, 3)  # [b, q, h, k]
    dropped = (m == 0)
    rate = dropped.float().mean().item()
    assert abs(rate - p) < 0.03, f"dropout rate {rate:.3f}, expected {p}"
    kept = ~dropped
    torch.testing.assert_close(m[kept], (prob / (1 - p))[kept], rtol=2e-2, atol=2e-3)

    # Same seed, random V: out = M V; gradients from M (dS = M * dM - P * rowsum(dO * O)).
    vp = torch.randn(c.b, n, c.hkv, n, device=DEV).to(c.dtype)
    v2 = to_format(vp, fmt, c.lens_kv).contiguous().requires_grad_()
    out = _dropout_run(c, q, k, v2, p, 7)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v2), dout)
    mm = m.permute(0, 2, 1, 3)  # [b, h, q, k]
    pp = prob.permute(0, 2, 1, 3)
    vv = vp.float().permute(0, 2, 1, 3)
    o_ref = mm @ vv
    do = out_to_padded(dout, c).float().permute(0, 2, 1, 3)
    torch.testing.assert_close(out_to_padded(out, c).float().permute(0, 2, 1, 3), o_ref,
                               rtol=2e-2, atol=2e-2)
    dm = do @ vv.transpose(-1, -2)
    dsum = (do * o_ref).sum(-1, keepdim=True)
    ds = mm * dm - pp * dsum
    qq, kk = qp.float().permute(0, 2, 1, 3), kp.float().permute(0, 2, 1, 3)
    refs = {"dq": ds @ kk * scale, "dk": ds.transpose(-1, -2) @ qq * scale,
            "dv": mm.transpose(-1, -2) @ do}
    for name, ours, lens, f in (("dq", dq, c.lens_q, fmt), ("dk", dk, c.lens_kv, fmt),
                                ("dv", dv, c.lens_kv, fmt)):
        got = to_padded(ours, f, lens, n).float().permute(0, 2, 1, 3)
        err = (got - refs[name]).abs().max().item()
        assert err <= 3e-2 * max(1.0, refs[name].abs().max().item()), f"{name}: {err}"


def test_deterministic_backward():
    """NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (params.deterministic): bitwise-equal gradients."""
    c = Case(b=2, sq=1024, hq=16, hkv=4, dqk=64, mask="causal")
    (_, _, _), (q, k, v), _ = build_inputs(c)
    runs = []
    for _ in range(3):
        out, params = run_fused(c, q, k, v, deterministic=True)
        assert params.deterministic
        dout = torch.ones_like(out) * 0.01
        runs.append(torch.autograd.grad(out, (q, k, v), dout))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b), "deterministic backward gave different gradients"


def test_fast_and_public_execute_agree(monkeypatch):
    c = Case(b=2, sq=128, hq=4, mask="causal")
    (_, _, _), (q, k, v), _ = build_inputs(c)
    results = []
    try:
        for fast in (True, False):
            monkeypatch.setattr(fused.CACHE, "fast_execute", fast)
            fused.clear_cache()
            out, _ = run_fused(c, q, k, v)
            results.append((out,) + torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    finally:
        fused.clear_cache()  # no plan built with the public execute stays
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_current_stream_and_cache():
    c = Case(b=2, sq=128, hq=4, mask="causal", dtype=torch.float16)
    (_, _, _), (q, k, v), _ = build_inputs(c)
    fused.clear_cache()
    with capture_log() as lines, torch.no_grad():
        ref, _ = run_fused(c, q, k, v, requires_grad=False)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                out, _ = run_fused(c, q, k, v, requires_grad=False)
        torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(ref, out)
    builds = [line for line in lines if "built the cuDNN forward graph" in line]
    assert len(builds) == 1, lines


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_inference_no_grad(fmt):
    c = Case(fmt=fmt, b=3, sq=128, hq=4, mask="padding_causal" if fmt == "thd" else "causal")
    (_, _, _), (q, k, v), _ = build_inputs(c)
    with torch.no_grad():
        out, _ = run_fused(c, q, k, v, requires_grad=False)
    out2, _ = run_fused(c, q, k, v)
    assert not out.requires_grad and out2.requires_grad
    torch.testing.assert_close(out, out2.detach(), rtol=1e-2, atol=1e-2)


def _misaligned(t):
    """t's values in memory 2 bytes off a 16-byte boundary (a leaf)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    return buf[1:].view(t.shape).copy_(t.detach()).requires_grad_()


def _strided_d(t):
    """t's values with a d stride of 2 (a leaf)."""
    buf = torch.empty(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype, device=t.device)
    return buf[..., ::2].copy_(t.detach()).requires_grad_()


@pytest.mark.parametrize("how", ["misaligned", "d_stride"])
def test_unusual_memory(how):
    """Inputs cuDNN cannot take as they are run on copies, with the same results."""
    c = Case(b=2, sq=128, hq=4, mask="causal", dtype=torch.float16)
    if how == "misaligned":
        run_case(c, mangle=lambda q, k, v: (_misaligned(q), k, _misaligned(v)))
    else:
        run_case(c, mangle=lambda q, k, v: (q, _strided_d(k), v))


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_torch_compile_traces_the_ops(fmt):
    c = Case(fmt=fmt, b=3, sq=128, hq=4, hkv=2,
             mask="padding_causal" if fmt == "thd" else "causal")
    (_, _, _), (q, k, v), _ = build_inputs(c)
    params = make_params(c, q)
    assert not fused.not_supported_reasons(params)
    cu_q = cu_seqlens(c.lens_q) if c.padded else None
    cu_kv = cu_seqlens(c.lens_kv) if c.padded else None

    def fn(q, k, v):
        return fused.run(AttentionInputs(q, k, v, cu_q, cu_kv), params)

    eager = fn(q, k, v)
    g_eager = torch.autograd.grad(eager, (q, k, v), torch.ones_like(eager))
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    g = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert torch.equal(out, eager)
    for a, b in zip(g, g_eager):
        assert torch.equal(a, b)


def test_opcheck():
    c = Case(b=2, sq=64, hq=2, mask="causal", dtype=torch.float16)
    (_, _, _), (q, k, v), _ = build_inputs(c)
    q, k, v = (x.detach().contiguous().requires_grad_() for x in (q, k, v))
    call = fused.FusedCall("bshd", "bshd", 64, 64, "causal", -1, 0, 0.125, 0.0, False, True)
    args = (q, k, v, None, None, None, None, *call)
    torch.library.opcheck(torch.ops.transformer_fa.fused_attn_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor", "test_aot_dispatch_dynamic"))


# ------------------------------------------------------------------------------------------
# Support detection
# ------------------------------------------------------------------------------------------
def test_plain_reasons_never_raise():
    c = Case()
    q = torch.empty(1)
    base = make_params(c, q)
    assert fused.not_supported_reasons(base) == []
    for change, words in [({"dtype": torch.float32}, "dtype"),
                          ({"device_type": "cpu", "compute_capability": None}, "CUDA"),
                          ({"head_dim_qk": 72, "head_dim_v": 72}, "head_dim"),
                          ({"attn_mask_type": "arbitrary"}, "arbitrary"),
                          ({"compute_capability": (7, 5)}, "compute capability"),
                          ({"softmax_type": "off-by-one"}, "softmax_type"),
                          ({"return_max_logit": True}, "return_max_logit"),
                          ({"softcap": 30.0}, "softcap")]:
        reasons = fused.not_supported_reasons(dataclasses.replace(base, **change))
        assert reasons and words in reasons[0], (change, reasons)
    # cuDNN's own rejection becomes a reason: dropout with a bottom-right causal mask
    bad = dataclasses.replace(base, attn_mask_type="causal_bottom_right", max_seqlen_kv=256,
                              attention_dropout=0.1)
    reasons = fused.not_supported_reasons(bad)
    assert reasons and "cuDNN" in reasons[0], reasons


def test_unsupported_falls_through_to_next_backend(monkeypatch):
    """A configuration cuDNN rejects is logged as a reason, and the next backend runs."""
    import transformer_fa as tfa
    from transformer_fa.attention import selection

    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    selection.clear_cache()
    dpa = tfa.DotProductAttention(4, 64, attn_mask_type="causal_bottom_right",
                                  attention_dropout=0.1, qkv_format="bshd").cuda()
    q = torch.randn(2, 96, 4, 64, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(2, 160, 4, 64, device=DEV, dtype=torch.bfloat16)
    with capture_log() as lines:
        dpa(q, kv, kv)
    assert dpa.last_backend == "UnfusedDotProductAttention", dpa.last_backend
    assert any(line.startswith("Disabling FusedAttention as cuDNN") for line in lines), lines
    # ... and a supported configuration selects FusedAttention (sm90: its preferred backend)
    dpa = tfa.DotProductAttention(4, 64, attn_mask_type="causal", qkv_format="bshd").cuda()
    dpa(q, q, q)
    assert dpa.last_backend == "FusedAttention"


@pytest.mark.parametrize("qkv_format", ["sbhd", "thd"])
def test_dot_product_attention_fused_matches_unfused(monkeypatch, qkv_format):
    """Through transformer_fa.DotProductAttention: FusedAttention against the unfused backend,
    on a packed qkv buffer (sb3hd / t3hd)."""
    import transformer_fa as tfa
    from transformer_fa.attention import selection

    h, d = 4, 64
    gen = torch.Generator(device=DEV).manual_seed(5)
    lens = [100, 37, 128]
    cu = cu_seqlens(lens)
    if qkv_format == "sbhd":
        qkv = torch.randn(128, 3, 3, h, d, generator=gen, device=DEV).to(torch.bfloat16)
        mask_type, extra = "causal", {}
    else:
        qkv = torch.randn(sum(lens), 3, h, d, generator=gen, device=DEV).to(torch.bfloat16)
        mask_type, extra = "padding_causal", dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
    dpa = tfa.DotProductAttention(h, d, qkv_format=qkv_format, attn_mask_type=mask_type).cuda()
    results = {}
    for fused_on in ("1", "0"):
        monkeypatch.setenv("NVTE_FUSED_ATTN", fused_on)
        monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
        selection.clear_cache()
        buf = qkv.detach().clone().requires_grad_()
        q, k, v = buf.unbind(-3)
        out = dpa(q, k, v, **extra)
        results[dpa.last_backend] = (out.detach().float(),) + torch.autograd.grad(
            out, buf, torch.ones_like(out))
    assert set(results) == {"FusedAttention", "UnfusedDotProductAttention"}, set(results)
    (o1, g1), (o2, g2) = results["FusedAttention"], results["UnfusedDotProductAttention"]
    torch.testing.assert_close(o1, o2, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g1.float(), g2.float(), rtol=5e-2, atol=5e-2)
