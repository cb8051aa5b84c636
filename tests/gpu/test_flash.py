"""FlashAttention (transformer_fa's own CUDA kernels, csrc/) forward on a GPU.

Each case runs the backend's ``run`` (tensors built as real views of one buffer where the
layout packs them) and checks the output against a float32 reference in plain torch math:
the max error may be at most 2x the error of the same math done in the input dtype, plus a
small atol (the FlashAttention rule). Padding rows and rows with no key must be zero; the
output memory is poisoned (NaN) before every call, so an unwritten element fails the check.
The log-sum-exp output is checked against the float32 reference's.

Skipped without CUDA or without the built extension (``transformer_fa_flash``).
"""
import dataclasses
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("FlashAttention tests need CUDA", allow_module_level=True)

from transformer_fa.attention.backends import flash  # noqa: E402
from transformer_fa.attention.params import AttentionInputs, AttentionParams  # noqa: E402

if not flash.is_built():
    pytest.skip("transformer_fa_flash is not built", allow_module_level=True)

from attention_cases import (DEV, Case, build_inputs, check, cu_seqlens, keep_mask,  # noqa: E402
                             out_to_padded, pad_rows, reference, valid_rows)

CC = torch.cuda.get_device_capability()
if CC[0] not in flash.SUPPORTED_ARCH_MAJORS:
    pytest.skip(f"FlashAttention does not claim sm{CC[0]}{CC[1]}", allow_module_level=True)


# ------------------------------------------------------------------------------------------
# Cases and inputs
# ------------------------------------------------------------------------------------------
def make_params(c: Case, requires_grad=False, **changes):
    params = AttentionParams(
        qkv_format=c.qkv_format, q_format=c.fmt, kv_format=c.kv_fmt,
        qkv_layout=c.layout_name, batch_size=c.b, num_heads=c.hq, num_gqa_groups=c.hkv,
        max_seqlen_q=c.sq, max_seqlen_kv=c.skv, head_dim_qk=c.dqk, head_dim_v=c.dv,
        dtype=c.dtype, device_type="cuda", compute_capability=CC, attn_mask_type=c.mask,
        window_size=c.window, core_attention_bias_type="no_bias",
        core_attention_bias_shape=None, core_attention_bias_requires_grad=False,
        alibi_slopes_shape=None, attention_dropout=0.0,
        softmax_scale=c.scale if c.scale is not None else 1.0 / math.sqrt(c.dqk),
        deterministic=False, requires_grad=requires_grad)
    return dataclasses.replace(params, **changes) if changes else params


def _poison_allocator(nbytes):
    """Fill a block of the caching allocator with NaN and free it: outputs allocated next
    reuse it, so elements the kernel does not write stay NaN."""
    junk = torch.full((nbytes // 4 + 1024,), float("nan"), dtype=torch.float32, device=DEV)
    del junk


def run_case(c: Case, check_lse=True, claimed=True):
    (qp, kp, vp), (q, k, v), _ = build_inputs(c, requires_grad=False)
    params = make_params(c)
    reasons = flash.not_supported_reasons(params)
    if claimed:
        assert not reasons, f"FlashAttention declined a case it must serve {c}: {reasons}"
    cu_q = cu_seqlens(c.lens_q) if c.padded else None
    cu_kv = cu_seqlens(c.lens_kv) if c.padded else None
    _poison_allocator(4 * q.numel() * 2 + 4 * c.b * c.hq * c.sq * 4)
    out = flash.run(AttentionInputs(q, k, v, cu_q, cu_kv), params)
    assert out.dtype == c.dtype
    expected_shape = {"sbhd": (c.sq, c.b, c.hq * c.dqk), "bshd": (c.b, c.sq, c.hq * c.dqk),
                      "thd": (q.shape[0], c.hq * c.dqk)}[c.fmt]
    assert tuple(out.shape) == expected_shape

    keep = keep_mask(c)
    scale = params.softmax_scale
    ref32, lse32 = reference(qp, kp, vp, keep, scale, upcast=True)
    refdt, _ = reference(qp, kp, vp, keep, scale, upcast=False)
    atol = 2e-3 if c.dtype == torch.float16 else 8e-3
    outp = out_to_padded(out, c)
    check(f"out {c}", valid_rows(outp, c.lens_q), valid_rows(ref32, c.lens_q),
          valid_rows(refdt, c.lens_q), atol)
    # Rows with no key (fully masked) are zero, as in the reference.
    dead = ~keep.any(-1).squeeze(1)  # [b, sq]
    outp_rows = outp.float()
    assert (outp_rows[dead.unsqueeze(-1).unsqueeze(-1).expand_as(outp_rows)] == 0).all(), \
        "rows with no key to attend are not zero"
    if c.padded and c.fmt != "thd":
        assert (pad_rows(outp, c.lens_q) == 0).all(), "padded query rows are not zero"
    if c.fmt == "thd" and q.shape[0] > sum(c.lens_q):
        assert (out[sum(c.lens_q):] == 0).all()

    if check_lse:
        left, right, bottom_right = flash._mask_args(params)
        _, lse = flash._fwd_impl(q, k, v, cu_q, cu_kv, c.fmt, c.kv_fmt, c.sq, c.skv, scale,
                                 left, right, bottom_right, True)
        if c.fmt == "thd":  # [h, t] -> [b, h, sq] (padding slots +inf)
            lse_p = torch.full((c.b, c.hq, c.sq), float("inf"), device=DEV)
            start = 0
            for i, n in enumerate(c.lens_q):
                lse_p[i, :, :n] = lse[:, start:start + n]
                start += n
        else:
            lse_p = lse
        assert lse_p.shape == lse32.shape, (lse_p.shape, lse32.shape)
        alive = keep.any(-1).expand_as(lse32)  # rows with at least one key
        assert torch.isinf(lse_p[~alive]).all() and (lse_p[~alive] > 0).all(), \
            "lse of rows with no key must be +inf"
        err = (lse_p[alive] - lse32[alive]).abs().max().item() if alive.any() else 0.0
        assert err <= 1e-3 * max(1.0, lse32[alive].abs().max().item()), f"lse error {err}"
    return out


# ------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------
DTYPES = (torch.float16, torch.bfloat16)
DIMS = (64, 128)

BASIC_CASES = [Case(dqk=d, dtype=dt, mask=mask, sq=sq, skv=skv, hq=4, hkv=2)
               for d in DIMS for dt in DTYPES
               for mask in ("no_mask", "causal", "causal_bottom_right")
               for sq, skv in ((128, 128), (96, 200), (200, 96), (257, 1000))]

GQA_CASES = [Case(hq=8, hkv=hkv, mask=m, sq=192, skv=320, dqk=d, dtype=dt)
             for hkv in (8, 2, 1) for m in ("no_mask", "causal", "causal_bottom_right")
             for d, dt in ((64, torch.float16), (128, torch.bfloat16))]

LAYOUT_CASES = []
for fmt in ("sbhd", "bshd", "thd"):
    for layout in ("3", "h3", "2", "h2", "separate"):
        for d in DIMS:
            LAYOUT_CASES.append(Case(fmt=fmt, layout=layout, b=3, sq=136, hq=4, dqk=d,
                                     mask="causal"))
    for d in DIMS:
        LAYOUT_CASES.append(Case(fmt=fmt, layout="gqa_split", hq=8, hkv=2, sq=130, dqk=d,
                                 mask="causal" if d == 64 else "no_mask"))  # the classic trap
LAYOUT_CASES += [
    Case(fmt="sbhd", kv_fmt="bshd", sq=96, skv=160, mask="no_mask"),  # mixed formats
    Case(fmt="bshd", kv_fmt="sbhd", sq=160, skv=160, mask="causal", dqk=128),
    Case(fmt="thd", kv_fmt="bshd", lens_q=[30, 64, 7], lens_kv=[64, 40, 64], sq=64, skv=64,
         mask="padding"),
    Case(fmt="bshd", kv_fmt="thd", lens_q=[30, 64, 7], lens_kv=[64, 40, 3], sq=64, skv=64,
         mask="padding_causal_bottom_right", dqk=128),
]

VARLEN_CASES = []
for d in DIMS:
    for dt in DTYPES:
        VARLEN_CASES += [
            Case(fmt="thd", lens_q=[37, 256, 1, 90], mask="padding", dqk=d, dtype=dt),
            Case(fmt="thd", lens_q=[37, 256, 1, 90], mask="padding_causal", dqk=d, dtype=dt),
            Case(fmt="thd", lens_q=[100, 20, 64], lens_kv=[180, 20, 33], mask="padding",
                 dqk=d, dtype=dt),
            Case(fmt="thd", lens_q=[100, 20, 64], lens_kv=[180, 20, 33],
                 mask="padding_causal_bottom_right", dqk=d, dtype=dt),
            Case(fmt="thd", lens_q=[50, 200, 129], lens_kv=[60, 250, 129],
                 mask="padding_causal", hq=8, hkv=2, dqk=d, dtype=dt),
            Case(fmt="thd", lens_q=[300, 17, 128, 513], mask="padding_causal", hq=6, hkv=1,
                 dqk=d, dtype=dt),
            Case(fmt="sbhd", lens_q=[128, 3, 77], lens_kv=[128, 100, 1], sq=128,
                 mask="padding_causal", dqk=d, dtype=dt),
            Case(fmt="bshd", lens_q=[128, 3, 77], lens_kv=[120, 100, 1], sq=128,
                 mask="padding_causal_bottom_right", dqk=d, dtype=dt),
            Case(fmt="bshd", lens_q=[128, 0, 77], lens_kv=[128, 100, 0], sq=128,
                 mask="padding", dqk=d, dtype=dt),  # empty sequences: zero rows
        ]
# random ragged lengths
for seed in range(6):
    gen = torch.Generator().manual_seed(100 + seed)
    b = int(torch.randint(1, 7, (1,), generator=gen))
    lq = torch.randint(1, 600, (b,), generator=gen).tolist()
    lk = lq if seed % 2 else torch.randint(1, 600, (b,), generator=gen).tolist()
    mask = ("padding", "padding_causal", "padding_causal_bottom_right")[seed % 3]
    VARLEN_CASES.append(Case(fmt="thd", lens_q=lq, lens_kv=lk, mask=mask, hq=4,
                             hkv=(4, 2, 1)[seed % 3], dqk=DIMS[seed % 2],
                             dtype=DTYPES[(seed // 2) % 2], seed=seed))

OTHER_CASES = [
    Case(scale=0.3, mask="no_mask", sq=64, skv=64),
    Case(scale=0.05, mask="causal", sq=300, skv=300, dqk=128, dtype=torch.float16),
    Case(b=1, sq=1, skv=1, mask="no_mask"),
    Case(b=1, sq=1, skv=777, mask="causal_bottom_right", dqk=128),  # decode-like
    Case(b=1, sq=1, skv=777, mask="causal", dqk=128),  # top-left: one key
    Case(b=2, sq=1000, skv=5, mask="causal_bottom_right"),  # most rows see no key
]

WINDOW_CASES = [
    Case(mask="causal", sq=256, skv=256, window=(32, 0)),
    Case(mask="causal", sq=128, skv=256, window=(48, 0), dqk=128),
    Case(mask="causal_bottom_right", sq=128, skv=256, window=(48, 0), dtype=torch.float16),
    Case(mask="no_mask", sq=256, skv=256, window=(32, 16), dqk=128),
    Case(mask="no_mask", sq=128, skv=300, window=(20, 130)),
    Case(fmt="thd", lens_q=[300, 17, 128], mask="padding_causal", window=(64, 0)),
    Case(fmt="thd", lens_q=[300, 17, 128], mask="padding", window=(32, 32), dqk=128),
]


@pytest.mark.parametrize("case", BASIC_CASES, ids=str)
def test_dims_dtypes_masks(case):
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


@pytest.mark.parametrize("case", OTHER_CASES, ids=str)
def test_scale_and_edges(case):
    run_case(case)


@pytest.mark.parametrize("case", WINDOW_CASES, ids=str)
def test_sliding_window(case):
    """Sliding windows run in the kernel; claimed only when flash.WINDOW_SUPPORTED."""
    run_case(case, claimed=flash.WINDOW_SUPPORTED)


VARIANT_CASES = {
    "thd-gqa-causal-br": dict(fmt="thd", lens_q=[300, 17, 128, 513], lens_kv=[290, 60, 128, 700],
                              mask="padding_causal_bottom_right", hq=4, hkv=2),
    "sb3hd-causal": dict(fmt="sbhd", layout="3", b=3, sq=333, hq=4, mask="causal"),
    "bshd-gqa-split-nomask": dict(fmt="bshd", layout="gqa_split", b=2, sq=200, skv=200, hq=6,
                                  hkv=2, mask="no_mask"),
    "thd-window": dict(fmt="thd", lens_q=[300, 17, 128], mask="padding", window=(40, 24)),
}


@pytest.mark.parametrize("name", sorted(VARIANT_CASES))
@pytest.mark.parametrize("variant", [1, 2, 3, 4])
@pytest.mark.parametrize("d", DIMS)
def test_tile_variants(name, variant, d):
    """Every tile shape computes the same function as variant 0 (which the cases above test
    in full), so that flash.TILE_VARIANT may pick any of them."""
    c = Case(dqk=d, **VARIANT_CASES[name])
    (qp, kp, vp), (q, k, v), _ = build_inputs(c, requires_grad=False)
    params = make_params(c)
    left, right, bottom_right = flash._mask_args(params)
    cu_q = cu_seqlens(c.lens_q) if c.padded else None
    cu_kv = cu_seqlens(c.lens_kv) if c.padded else None
    args = (q, k, v, cu_q, cu_kv, c.fmt, c.kv_fmt, c.sq, c.skv, params.softmax_scale, left,
            right, bottom_right, True)
    out0, lse0 = flash._fwd_impl(*args, tile_variant=0)
    out1, lse1 = flash._fwd_impl(*args, tile_variant=variant)
    torch.testing.assert_close(out1, out0, rtol=0, atol=2e-2)
    torch.testing.assert_close(lse1, lse0, rtol=1e-5, atol=1e-4)
    if variant == flash.TILE_VARIANT.get(d):  # the default: against the reference too
        run_case(c, claimed="window" not in VARIANT_CASES[name] or flash.WINDOW_SUPPORTED)


def test_deterministic_and_streams():
    c = Case(b=2, sq=512, hq=8, hkv=2, mask="causal", dqk=128)
    (_, _, _), (q, k, v), _ = build_inputs(c, requires_grad=False)
    params = make_params(c)
    inputs = AttentionInputs(q, k, v)
    ref = flash.run(inputs, params)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs = [flash.run(inputs, params) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    for out in outs:
        assert torch.equal(out, ref)


def test_unaligned_inputs_run_on_copies():
    c = Case(b=2, sq=128, hq=4, mask="causal", dtype=torch.float16)
    (qp, kp, vp), (q, k, v), _ = build_inputs(c, requires_grad=False)
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device=DEV)
    q_mis = buf[1:].view(q.shape).copy_(q)
    params = make_params(c)
    out = flash.run(AttentionInputs(q_mis, k, v), params)
    torch.testing.assert_close(out, flash.run(AttentionInputs(q, k, v), params), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# Support claims, selection, torch.compile
# ------------------------------------------------------------------------------------------
def test_reasons():
    base = make_params(Case())
    assert flash.not_supported_reasons(base) == []
    for change, words in [({"requires_grad": True}, "backward is not implemented"),
                          ({"dtype": torch.float32}, "dtype"),
                          ({"device_type": "cpu", "compute_capability": None}, "CUDA"),
                          ({"head_dim_qk": 96, "head_dim_v": 96}, "head_dim"),
                          ({"head_dim_qk": 128, "head_dim_v": 64}, "head_dim"),
                          ({"attn_mask_type": "arbitrary"}, "arbitrary"),
                          ({"attention_dropout": 0.1}, "dropout"),
                          ({"core_attention_bias_type": "alibi"}, "alibi"),
                          ({"core_attention_bias_type": "post_scale_bias",
                            "core_attention_bias_shape": "1hss"}, "bias"),
                          ({"compute_capability": (7, 5)}, "compute capability")]:
        reasons = flash.not_supported_reasons(dataclasses.replace(base, **change))
        assert reasons and any(words in r for r in reasons), (change, reasons)
    assert flash.not_supported_reasons(dataclasses.replace(base, requires_grad=True)) == [
        "as the FlashAttention backward is not implemented yet"]
    windowed = flash.not_supported_reasons(dataclasses.replace(base, window_size=(16, 0)))
    assert bool(windowed) != flash.WINDOW_SUPPORTED


def test_selected_for_inference(monkeypatch):
    import transformer_fa as tfa

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    dpa = tfa.DotProductAttention(8, 64, num_gqa_groups=2, qkv_format="sbhd").cuda()
    q = torch.randn(200, 2, 8, 64, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(200, 2, 2, 64, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        out = dpa(q, kv, kv)
    assert dpa.last_backend == "FlashAttention"
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    with torch.no_grad():
        ref = dpa(q, kv, kv)
    assert dpa.last_backend == "UnfusedDotProductAttention"
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    # Gradients needed: FlashAttention declines (no backward yet) and another backend runs.
    monkeypatch.delenv("NVTE_FLASH_ATTN")
    dpa(q.requires_grad_(), kv, kv)
    assert dpa.last_backend == "UnfusedDotProductAttention"


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_torch_compile_traces_the_op(fmt):
    c = Case(fmt=fmt, b=3, sq=128, hq=4, hkv=2, mask="causal")
    (_, _, _), (q, k, v), _ = build_inputs(c, requires_grad=False)
    params = make_params(c)
    assert not flash.not_supported_reasons(params)
    cu_q = cu_seqlens(c.lens_q) if c.padded else None
    cu_kv = cu_seqlens(c.lens_kv) if c.padded else None

    def fn(q, k, v):
        return flash.run(AttentionInputs(q, k, v, cu_q, cu_kv), params)

    eager = fn(q, k, v)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v), eager)


def test_opcheck():
    c = Case(b=2, sq=64, hq=2, mask="causal", dtype=torch.float16)
    (_, _, _), (q, k, v), _ = build_inputs(c, requires_grad=False)
    args = (q, k, v, None, None, "bshd", "bshd", 64, 64, 0.125, -1, 0, False, True)
    torch.library.opcheck(torch.ops.transformer_fa.flash_attn_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
