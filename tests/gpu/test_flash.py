"""FlashAttention (transformer_fa's own CUDA kernels, csrc/) on a GPU: forward and backward.

Each case runs the backend's ``run`` (tensors built as real views of one buffer where the
layout packs them) and checks the output, and for backward cases dq, dk and dv, against a
float32 reference in plain torch math: the max error may be at most 2x the error of the same
math done in the input dtype, plus a small atol (the FlashAttention rule, ``check``).
Padding rows and rows with no key must be zero; memory is poisoned (NaN) before the forward
and before the backward, so an unwritten element fails the check. The log-sum-exp output is
checked against the reference's.
Dropout cases rebuild the kernels' mask in torch (philox.py, the spec in csrc/flash/flash.h)
and the reference applies the same scaling; ALiBi cases add masks.alibi_bias.

Skipped without CUDA or without the built extension (``transformer_fa_flash``).
"""
import dataclasses
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("FlashAttention tests need CUDA", allow_module_level=True)

from transformer_fa.attention import masks  # noqa: E402
from transformer_fa.attention.backends import flash  # noqa: E402
from transformer_fa.attention.backends.support import dropout_rng_state  # noqa: E402
from transformer_fa.attention.params import AttentionInputs, AttentionParams  # noqa: E402

if not flash.is_built():
    pytest.skip("transformer_fa_flash is not built", allow_module_level=True)

import philox  # noqa: E402
from attention_cases import (DEV, Case, build_inputs, check, cu_seqlens, keep_mask,  # noqa: E402
                             out_to_padded, pad_rows, reference, reference_grads,
                             to_padded, valid_rows)

CC = torch.cuda.get_device_capability()
if CC[0] not in flash.SUPPORTED_ARCH_MAJORS:
    pytest.skip(f"FlashAttention does not claim sm{CC[0]}{CC[1]}", allow_module_level=True)


# ------------------------------------------------------------------------------------------
# Running one case
# ------------------------------------------------------------------------------------------
def make_params(c: Case, requires_grad=False, dropout=0.0, deterministic=False, slopes=None,
                **changes):
    params = AttentionParams(
        qkv_format=c.qkv_format, q_format=c.fmt, kv_format=c.kv_fmt,
        qkv_layout=c.layout_name, batch_size=c.b, num_heads=c.hq, num_gqa_groups=c.hkv,
        max_seqlen_q=c.sq, max_seqlen_kv=c.skv, head_dim_qk=c.dqk, head_dim_v=c.dv,
        dtype=c.dtype, device_type="cuda", compute_capability=CC, attn_mask_type=c.mask,
        window_size=c.window,
        core_attention_bias_type="alibi" if slopes is not None else "no_bias",
        core_attention_bias_shape=None, core_attention_bias_requires_grad=False,
        alibi_slopes_shape=tuple(slopes.shape) if slopes is not None else None,
        attention_dropout=dropout,
        softmax_scale=c.scale if c.scale is not None else 1.0 / math.sqrt(c.dqk),
        deterministic=deterministic, requires_grad=requires_grad)
    return dataclasses.replace(params, **changes) if changes else params


def _poison_allocator(nbytes):
    """Fill a block of the caching allocator with NaN and free it: outputs allocated next
    reuse it, so elements the kernel does not write stay NaN."""
    junk = torch.full((nbytes // 4 + 1024,), float("nan"), dtype=torch.float32, device=DEV)
    del junk


def alibi_slopes(c: Case):
    """float32 [h] (c.alibi == "h") or [b, h] ("bh") slopes, ALiBi's geometric ones scaled."""
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / c.hq) for h in range(c.hq)], device=DEV)
    if c.alibi == "h":
        return base
    gen = torch.Generator(device=DEV).manual_seed(c.seed + 5)
    return (base.view(1, -1) * (0.5 + torch.rand(c.b, 1, generator=gen, device=DEV))).contiguous()


def _seqlens(c: Case):
    lq = torch.tensor(c.lens_q if c.padded else [c.sq] * c.b, device=DEV)
    lk = torch.tensor(c.lens_kv if c.padded else [c.skv] * c.b, device=DEV)
    return lq, lk


def reference_kwargs(c: Case, slopes=None, dropout=0.0, rng=None):
    """The reference's bias (ALiBi, from masks.alibi_bias) and dropout scaling for a case."""
    kw = {}
    if slopes is not None:
        lq, lk = _seqlens(c)
        kw["bias"] = masks.alibi_bias(slopes, c.mask, lq, lk, c.sq, c.skv)
        kw["float_bias"] = True  # the kernel adds ALiBi to float32 scores
    if dropout > 0.0:
        kw["dropout"] = philox.dropout_scale(rng, dropout, c.b, c.hq, c.sq, c.skv, device=DEV)
    return kw


def run_case(c: Case, backward=False, dropout=0.0, deterministic=False, check_lse=True,
             seed=0):
    """Runs c through flash.run (and the backward), checks everything against the reference;
    returns (out, grads or None)."""
    (qp, kp, vp), (q, k, v), _ = build_inputs(c, requires_grad=backward)
    slopes = alibi_slopes(c) if c.alibi else None
    params = make_params(c, requires_grad=backward, dropout=dropout,
                         deterministic=deterministic, slopes=slopes)
    reasons = flash.not_supported_reasons(params)
    assert not reasons, f"FlashAttention declined a case it must serve {c}: {reasons}"
    cu_q = cu_seqlens(c.lens_q) if c.padded else None
    cu_kv = cu_seqlens(c.lens_kv) if c.padded else None
    rng = None
    if dropout > 0.0:
        torch.manual_seed(seed)
        rng = dropout_rng_state(q.device)  # what run() draws after the same seed
        torch.manual_seed(seed)
    nbytes = 4 * (q.numel() + k.numel() + v.numel()) * 4 + 4 * c.b * c.hq * c.sq * 4
    _poison_allocator(nbytes)
    out = flash.run(AttentionInputs(q, k, v, cu_q, cu_kv, alibi_slopes=slopes), params)
    assert out.dtype == c.dtype
    expected_shape = {"sbhd": (c.sq, c.b, c.hq * c.dv), "bshd": (c.b, c.sq, c.hq * c.dv),
                      "thd": (q.shape[0], c.hq * c.dv)}[c.fmt]
    assert tuple(out.shape) == expected_shape

    keep = keep_mask(c)
    scale = params.softmax_scale
    kw = reference_kwargs(c, slopes, dropout, rng)
    grads = None
    if backward:
        gen = torch.Generator(device=DEV).manual_seed(seed + 1)
        dout = torch.randn(out.shape, generator=gen, device=DEV).to(c.dtype)
        _poison_allocator(nbytes)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        dout_p = out_to_padded(dout, c)
        ref32 = reference_grads(qp, kp, vp, dout_p, keep, scale, upcast=True, **kw)
        refdt = reference_grads(qp, kp, vp, dout_p, keep, scale, upcast=False, **kw)
    else:
        ref32 = reference(qp, kp, vp, keep, scale, upcast=True, **kw)
        refdt = reference(qp, kp, vp, keep, scale, upcast=False, **kw)

    atol = 2e-3 if c.dtype == torch.float16 else 8e-3
    outp = out_to_padded(out.detach(), c)
    check(f"out {c}", valid_rows(outp, c.lens_q), valid_rows(ref32[0], c.lens_q),
          valid_rows(refdt[0], c.lens_q), atol)
    # Rows with no key (fully masked) are zero, as in the reference.
    dead = ~keep.any(-1).squeeze(1)  # [b, sq]
    outp_rows = outp.float()
    assert (outp_rows[dead.unsqueeze(-1).unsqueeze(-1).expand_as(outp_rows)] == 0).all(), \
        "rows with no key to attend are not zero"
    if c.padded and c.fmt != "thd":
        assert (pad_rows(outp, c.lens_q) == 0).all(), "padded query rows are not zero"

    if check_lse:
        _check_lse(c, q, k, v, cu_q, cu_kv, params, keep, ref32[1], dropout, rng, slopes)

    if backward:
        for i, (name, fmt, lens, s) in enumerate((("dq", c.fmt, c.lens_q, c.sq),
                                                  ("dk", c.kv_fmt, c.lens_kv, c.skv),
                                                  ("dv", c.kv_fmt, c.lens_kv, c.skv))):
            assert grads[i].shape == (q, k, v)[i].shape and grads[i].dtype == c.dtype
            gp = to_padded(grads[i], fmt, lens, s)
            check(f"{name} {c}", valid_rows(gp, lens), valid_rows(ref32[2][i], lens),
                  valid_rows(refdt[2][i], lens), atol)
            if c.padded and fmt != "thd":
                assert (pad_rows(gp, lens) == 0).all(), f"{name} is not zero in padding rows"
    return out, grads


def _check_lse(c, q, k, v, cu_q, cu_kv, params, keep, lse32, dropout, rng, slopes):
    call = flash.FlashCall.from_params(params, return_lse=True)._replace(
        q_format=c.fmt, kv_format=c.kv_fmt, max_seqlen_q=c.sq, max_seqlen_kv=c.skv,
        dropout_p=dropout)
    with torch.no_grad():
        _, lse = flash._fwd_impl(q, k, v, cu_q, cu_kv, rng, slopes, call)
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


# ------------------------------------------------------------------------------------------
# Forward cases
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


# Scores that grow along the kernels' key order (the last block first): the forward's softmax
# reference max must move after the first key block, in steps under and over its threshold
# (2^8, kLazyRescale) ("ramp") or in one jump at the last block visited ("jump").
GROWTH_CASES = [Case(b=1, sq=sq, skv=1024, hq=2, dqk=d, dtype=dt, mask=mask, k_growth=g)
                for g in ("ramp", "jump")
                for d, dt in ((64, torch.float16), (128, torch.bfloat16), (192, torch.float16),
                              (256, torch.bfloat16))
                for mask, sq in (("no_mask", 256), ("causal_bottom_right", 384))]


@pytest.mark.parametrize("case", GROWTH_CASES, ids=str)
def test_growing_scores(case):
    run_case(case, backward=True)


# The same through the kernels with dropout / ALiBi, chosen by the dropout (the lazy rescale
# is on in those at d192 / d256; d64 / d128 rescale every block there). No ALiBi here: its
# distance penalty would undo the growth.
@pytest.mark.parametrize("case", [Case(b=1, sq=256, skv=1024, hq=2, dqk=d, dtype=dt,
                                       mask="no_mask", k_growth=g)
                                  for g in ("ramp", "jump")
                                  for d, dt in ((64, torch.float16), (128, torch.bfloat16),
                                                (192, torch.float16), (256, torch.bfloat16))],
                         ids=str)
def test_growing_scores_dropout(case):
    run_case(case, backward=True, dropout=0.1)


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
    run_case(case)


# ------------------------------------------------------------------------------------------
# Backward cases: every value of every axis, every (dtype, head dim) pair
# ------------------------------------------------------------------------------------------
ALL_DIMS = (32, 64, 96, 128, 160, 192, 256)  # each kernel (64, 128, 192, 256) and below it
SHAPES = ((128, 128), (96, 200), (200, 96), (257, 320))
HEADS = ((4, 4), (8, 2), (4, 1))  # GQA ratios 1, 4 and MQA
# (mask, window): the masks and a sliding window of each alignment
BWD_MASKS = (("no_mask", None), ("causal", None), ("causal_bottom_right", None),
             ("window", None))


def _window_mask(i):
    return (("causal", (48, 0)), ("no_mask", (32, 16)), ("causal_bottom_right", (40, 0)))[i % 3]


BWD_DIM_CASES = []
for dt in DTYPES:
    for d in ALL_DIMS:
        for mask, window in BWD_MASKS:
            i = len(BWD_DIM_CASES)
            if mask == "window":
                mask, window = _window_mask(i)
            sq, skv = SHAPES[(i + i // 4) % len(SHAPES)]  # each mask meets every shape
            hq, hkv = HEADS[i % len(HEADS)]
            BWD_DIM_CASES.append(Case(dqk=d, dtype=dt, mask=mask, window=window, sq=sq, skv=skv,
                                      hq=hq, hkv=hkv, fmt=("bshd", "sbhd")[(i // 4) % 2]))

BWD_GQA_CASES = []
for hkv in (8, 2, 1):
    for mask, window in BWD_MASKS:
        i = len(BWD_GQA_CASES)
        if mask == "window":
            mask, window = _window_mask(i)
        BWD_GQA_CASES.append(Case(hq=8, hkv=hkv, mask=mask, window=window, sq=192, skv=320,
                                  dqk=(64, 128, 192)[i % 3], dtype=DTYPES[(i + i // 4) % 2]))

BWD_LAYOUT_CASES = []
for fmt in ("sbhd", "bshd", "thd"):
    for layout in ("3", "h3", "2", "h2", "separate"):
        for j in range(2):
            d = ALL_DIMS[len(BWD_LAYOUT_CASES) % len(ALL_DIMS)]
            BWD_LAYOUT_CASES.append(Case(fmt=fmt, layout=layout, b=3, sq=136, hq=4, dqk=d,
                                         mask=("causal", "no_mask")[j], dtype=DTYPES[j]))
    for d, mask in ((64, "causal"), (160, "no_mask"), (256, "causal_bottom_right")):
        BWD_LAYOUT_CASES.append(Case(fmt=fmt, layout="gqa_split", hq=8, hkv=2, sq=130, dqk=d,
                                     mask=mask))  # the classic trap
BWD_LAYOUT_CASES += [
    Case(fmt="sbhd", kv_fmt="bshd", sq=96, skv=160, mask="no_mask", dqk=96),  # mixed formats
    Case(fmt="bshd", kv_fmt="sbhd", sq=160, skv=160, mask="causal", dqk=128),
    Case(fmt="thd", kv_fmt="bshd", lens_q=[30, 64, 7], lens_kv=[64, 40, 64], sq=64, skv=64,
         mask="padding", dqk=192),
    Case(fmt="bshd", kv_fmt="thd", lens_q=[30, 64, 7], lens_kv=[64, 40, 3], sq=64, skv=64,
         mask="padding_causal_bottom_right", dqk=32, dtype=torch.float16),
]

BWD_VARLEN_CASES = []
for seed in range(16):  # random ragged lengths
    gen = torch.Generator().manual_seed(200 + seed)
    b = int(torch.randint(1, 6, (1,), generator=gen))
    lq = torch.randint(1, 400, (b,), generator=gen).tolist()
    lk = lq if seed % 3 == 0 else torch.randint(1, 400, (b,), generator=gen).tolist()
    mask, window = (("padding", None), ("padding_causal", None),
                    ("padding_causal_bottom_right", None), ("padding_causal", (64, 0)),
                    ("padding", (48, 20)))[seed % 5]
    hq, hkv = HEADS[seed % 3]
    fmt = ("thd", "thd", "bshd", "sbhd")[seed % 4]
    sq, skv = max(lq) + (seed % 4) * 7, max(lk) + (seed % 3) * 5  # sbhd/bshd: padded tails
    BWD_VARLEN_CASES.append(Case(fmt=fmt, lens_q=lq, lens_kv=lk, sq=sq, skv=skv, mask=mask,
                                 window=window, hq=hq, hkv=hkv,
                                 dqk=ALL_DIMS[seed % len(ALL_DIMS)],
                                 dtype=DTYPES[(seed // 2) % 2], seed=seed))
BWD_VARLEN_CASES += [
    Case(fmt="bshd", lens_q=[128, 0, 77], lens_kv=[128, 100, 0], sq=128, mask="padding"),
    Case(fmt="thd", lens_q=[1, 1, 300], lens_kv=[1, 513, 2], mask="padding_causal_bottom_right",
         hq=4, hkv=2, dqk=128),
    Case(fmt="thd", lens_q=[37, 256, 1, 90], mask="padding_causal", dqk=256,
         dtype=torch.float16),
    Case(fmt="sbhd", lens_q=[128, 3, 77], lens_kv=[128, 100, 1], sq=128,
         mask="padding_causal", dqk=160),
]

# Every head dim that is claimed (multiples of 8 up to 256), forward and backward.
SWEEP_CASES = [Case(fmt="thd", lens_q=[100, 33], lens_kv=[70, 33], mask="padding_causal",
                    hq=4, hkv=2, dqk=d, dtype=DTYPES[(d // 8) % 2]) for d in range(8, 257, 8)]


@pytest.mark.parametrize("case", BWD_DIM_CASES, ids=str)
def test_backward_dims_dtypes_masks(case):
    run_case(case, backward=True)


@pytest.mark.parametrize("case", BWD_GQA_CASES, ids=str)
def test_backward_gqa_mqa(case):
    run_case(case, backward=True)


@pytest.mark.parametrize("case", BWD_LAYOUT_CASES, ids=str)
def test_backward_layouts(case):
    run_case(case, backward=True)


@pytest.mark.parametrize("case", BWD_VARLEN_CASES, ids=str)
def test_backward_varlen(case):
    run_case(case, backward=True)


@pytest.mark.parametrize("case", SWEEP_CASES, ids=str)
def test_every_head_dim(case):
    run_case(case, backward=True)


def test_thd_tokens_past_the_last_sequence():
    """Tokens after cu_seqlens[-1] belong to no sequence: zero output and zero gradients."""
    c = Case(fmt="thd", lens_q=[50, 70], mask="padding_causal", hq=4, hkv=2)
    (_, _, _), (q, k, v), _ = build_inputs(c, requires_grad=False)
    extra = 24
    q, k, v = (torch.cat([x, 100 * torch.randn(extra, *x.shape[1:], device=DEV,
                                                dtype=x.dtype)]).requires_grad_()
               for x in (q, k, v))
    params = make_params(c, requires_grad=True)
    _poison_allocator(1 << 22)
    out = flash.run(AttentionInputs(q, k, v, cu_seqlens(c.lens_q), cu_seqlens(c.lens_kv)),
                    params)
    assert (out[-extra:] == 0).all() and not out.isnan().any()
    _poison_allocator(1 << 22)
    for g in torch.autograd.grad(out, (q, k, v), torch.randn_like(out)):
        assert (g[-extra:] == 0).all() and not g.isnan().any()


# ------------------------------------------------------------------------------------------
# Dropout, ALiBi, determinism
# ------------------------------------------------------------------------------------------
DROPOUT_CASES = [
    (Case(mask="no_mask", dqk=64, dtype=torch.float16), 0.1),
    (Case(mask="causal", dqk=128, hq=8, hkv=2, sq=200, skv=200), 0.3),
    (Case(fmt="sbhd", mask="causal_bottom_right", sq=96, skv=230, dqk=96), 0.2),
    (Case(fmt="thd", lens_q=[100, 257, 3], lens_kv=[90, 300, 40], mask="padding_causal",
          hq=6, hkv=2, dqk=256), 0.15),
    (Case(mask="causal", window=(40, 0), sq=256, skv=256, dqk=160, dtype=torch.float16), 0.25),
    (Case(mask="no_mask", alibi="bh", sq=100, skv=180, dqk=192), 0.1),
    (Case(mask="causal", hq=4, hkv=1, sq=150, skv=150, dqk=32), 0.5),
    (Case(fmt="bshd", lens_q=[128, 17], lens_kv=[60, 128], sq=128, mask="padding", dqk=64,
          dtype=torch.float16), 0.2),
]


@pytest.mark.parametrize("case,p", DROPOUT_CASES, ids=lambda x: str(x))
def test_dropout(case, p):
    """Output and gradients against the reference with the kernels' mask (philox.py)."""
    run_case(case, backward=True, dropout=p, seed=11)


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_dropout_reproducible(fmt):
    """Same seed: bitwise the same output and gradients; another seed: different ones."""
    c = Case(fmt=fmt, b=2, sq=256, hq=4, hkv=2, mask="causal", dqk=128)
    (_, _, _), (q, k, v), _ = build_inputs(c)
    # deterministic: else dq's summation order may change its last bits from run to run
    params = make_params(c, requires_grad=True, dropout=0.2, deterministic=True)
    inputs = AttentionInputs(q, k, v, cu_seqlens(c.lens_q) if c.padded else None,
                             cu_seqlens(c.lens_kv) if c.padded else None)
    dout = torch.randn(flash.run(inputs, params).shape, device=DEV).to(c.dtype)

    def once(seed):
        torch.manual_seed(seed)
        out = flash.run(inputs, params)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    first, again, other = once(3), once(3), once(4)
    for a, b in zip(first, again):
        assert torch.equal(a, b), "same seed, different results"
    for a, b in zip(first, other):
        assert not torch.equal(a, b), "different seeds, same results"


ALIBI_CASES = []
for kind in ("h", "bh"):
    for mask, (sq, skv) in (("no_mask", (128, 192)), ("causal", (160, 160)),
                            ("causal_bottom_right", (96, 250))):
        i = len(ALIBI_CASES)
        ALIBI_CASES.append(Case(alibi=kind, mask=mask, sq=sq, skv=skv, dqk=ALL_DIMS[i + 1],
                                hq=8, hkv=(8, 2, 1)[i % 3], dtype=DTYPES[i % 2]))
ALIBI_CASES += [
    Case(alibi="h", fmt="thd", lens_q=[100, 20, 64], lens_kv=[180, 20, 33], mask="padding",
         hq=4, hkv=2),
    Case(alibi="bh", fmt="bshd", lens_q=[128, 3, 77], lens_kv=[100, 128, 1], sq=128,
         mask="padding_causal_bottom_right", dqk=128),
]


@pytest.mark.parametrize("case", ALIBI_CASES, ids=str)
def test_alibi(case):
    run_case(case, backward=True)


def _grads_three_times(run):
    runs = [run() for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b), "deterministic backward gave different gradients"


DETERMINISTIC_CASE = Case(fmt="thd", lens_q=[1024, 700, 1536], lens_kv=[1024, 900, 1536],
                          mask="padding_causal_bottom_right", hq=16, hkv=4, dqk=128)


def test_deterministic_backward():
    """params.deterministic: bitwise-equal gradients (many key blocks add into dq)."""
    c = DETERMINISTIC_CASE
    (_, _, _), (q, k, v), _ = build_inputs(c)
    params = make_params(c, requires_grad=True, deterministic=True)
    inputs = AttentionInputs(q, k, v, cu_seqlens(c.lens_q), cu_seqlens(c.lens_kv))
    dout = torch.randn(q.shape[0], c.hq * c.dv, device=DEV).to(c.dtype)

    def run():
        out = flash.run(inputs, params)
        return torch.autograd.grad(out, (q, k, v), dout)

    _grads_three_times(run)
    run_case(dataclasses.replace(c, lens_q=[300, 17, 128], lens_kv=[290, 60, 128]),
             backward=True, deterministic=True)


def test_deterministic_through_torch_mode(monkeypatch):
    """torch.use_deterministic_algorithms(True) reaches the kernels through
    DotProductAttention (params.deterministic)."""
    import transformer_fa as tfa

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    c = DETERMINISTIC_CASE
    (_, _, _), (q, k, v), _ = build_inputs(c)
    cu_q, cu_kv = cu_seqlens(c.lens_q), cu_seqlens(c.lens_kv)
    dpa = tfa.DotProductAttention(c.hq, c.dqk, num_gqa_groups=c.hkv, qkv_format="thd",
                                  attn_mask_type="padding_causal_bottom_right").cuda()
    dout = torch.randn(q.shape[0], c.hq * c.dv, device=DEV).to(c.dtype)
    was, warn_only = (torch.are_deterministic_algorithms_enabled(),
                      torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        def run():
            out = dpa(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
            assert dpa.last_backend == "FlashAttention"
            return torch.autograd.grad(out, (q, k, v), dout)

        _grads_three_times(run)
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


# ------------------------------------------------------------------------------------------
# Memory, streams, long sequences
# ------------------------------------------------------------------------------------------
def test_same_results_on_another_stream():
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
    """Misaligned q, a d stride of 2 in k and a stride-0 dout run on copies, same results."""
    c = Case(b=2, sq=128, hq=4, mask="causal", dtype=torch.float16)
    (_, _, _), (q, k, v), _ = build_inputs(c)
    params = make_params(c, requires_grad=True, deterministic=True)  # bitwise comparable
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device=DEV)
    q_mis = buf[1:].view(q.shape).copy_(q.detach()).requires_grad_()
    wide = torch.empty(*k.shape[:-1], 2 * k.shape[-1], dtype=k.dtype, device=DEV)
    k_strided = wide[..., ::2].copy_(k.detach()).requires_grad_()
    out = flash.run(AttentionInputs(q_mis, k_strided, v), params)
    ref = flash.run(AttentionInputs(q, k, v), params)
    assert torch.equal(out, ref)
    # out.sum(): the backward gets an expanded dout (stride 0)
    for a, b in zip(torch.autograd.grad(out.sum(), (q_mis, k_strided, v)),
                    torch.autograd.grad(ref.sum(), (q, k, v))):
        assert torch.equal(a, b)


def _heads_per_group(bytes_per_head, heads, pairs):
    """common/launch.cuh's heads_per_group on this GPU."""
    group = torch.cuda.get_device_properties(DEV).L2_cache_size // 3 // bytes_per_head
    if group >= pairs:
        return pairs
    if group >= heads:
        return group // heads * heads
    while group > 1 and heads % group:
        group -= 1
    return max(group, 1)


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("split", ["batches", "heads"])
def test_causal_grid_in_head_groups(split, direction):
    """A causal case whose (batch, head) pairs fall into several groups of the grid (the
    launches run heavy tiles first inside groups of heads whose K and V, forward, or Q, dO
    and dQ rows, backward, fit in a third of L2): groups of whole batches with a smaller last
    one, or of a share of one batch's heads. Every tile runs once."""
    s, d = 4096, 128
    # bf16 K and V of one head (forward); Q, dO and the float dQ accumulator (backward)
    per_head = 2 * s * d * 2 if direction == "forward" else s * d * (2 * 2 + 4)
    fits = torch.cuda.get_device_properties(DEV).L2_cache_size // 3 // per_head
    # heads split: twice a group's heads, so whole groups of `fits` heads divide h on any L2
    b, h = (3, max(1, fits // 2)) if split == "batches" else (1, 2 * fits)
    group = _heads_per_group(per_head, h, b * h)
    if split == "batches":
        assert h < group < b * h and (b * h) % group, (h, group)
    else:
        assert 1 < group < h and h % group == 0, (h, group)
    run_case(Case(b=b, sq=s, hq=h, dqk=d, mask="causal"), backward=direction == "backward")


def test_long_sequence():
    """s = 131072 (b=1, h=8, d=128, bf16, causal): forward and backward run in memory linear
    in s, with finite gradients; the last query rows (the longest rows) against the
    reference, the backward with dO on those rows only (so dk, dv come from them alone)."""
    s, h, d, rows = 131072, 8, 128, 64
    gen = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, generator=gen, device=DEV, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    c = Case(b=1, sq=s, hq=h, dqk=d, mask="causal")
    params = make_params(c, requires_grad=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = flash.run(AttentionInputs(q, k, v), params)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out), retain_graph=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 8 << 30, f"peak memory {peak / 2**30:.1f} GiB"  # s^2 would be 256 GiB
    for g in grads:
        assert torch.isfinite(g).all()
    del grads

    dout = torch.zeros_like(out)
    dout[:, -rows:] = torch.randn(1, rows, h * d, generator=gen, device=DEV).to(dout.dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    i = torch.arange(s - rows, s, device=DEV).view(1, 1, -1, 1)
    keep = torch.arange(s, device=DEV).view(1, 1, 1, -1) <= i  # causal, for the last rows
    dout_p = dout[:, -rows:].view(1, rows, h, d)
    scale = params.softmax_scale
    qs = q.detach()[:, -rows:]
    ref32 = reference_grads(qs, k, v, dout_p, keep, scale, upcast=True)
    refdt = reference_grads(qs, k, v, dout_p, keep, scale, upcast=False)
    atol = 8e-3
    check("out (last rows)", out.detach()[:, -rows:].view(1, rows, h, d), ref32[0], refdt[0],
          atol)
    check("dq (last rows)", dq[:, -rows:], ref32[2][0], refdt[2][0], atol)
    assert (dq[:, :-rows] == 0).all(), "dq of rows with zero dO must be zero"
    check("dk", dk, ref32[2][1], refdt[2][1], atol)
    check("dv", dv, ref32[2][2], refdt[2][2], atol)


# ------------------------------------------------------------------------------------------
# Support claims, selection, torch.compile
# ------------------------------------------------------------------------------------------
def test_reasons():
    base = make_params(Case())
    assert flash.not_supported_reasons(base) == []
    for change in ({"requires_grad": True}, {"attention_dropout": 0.1},
                   {"deterministic": True}, {"window_size": (16, 0)},
                   {"core_attention_bias_type": "alibi", "alibi_slopes_shape": (4,)},
                   {"head_dim_qk": 96, "head_dim_v": 96},
                   {"head_dim_qk": 256, "head_dim_v": 256}):
        assert flash.not_supported_reasons(dataclasses.replace(base, **change)) == [], change
    for change, words in [({"dtype": torch.float32}, "dtype"),
                          ({"device_type": "cpu", "compute_capability": None}, "CUDA"),
                          ({"head_dim_qk": 100, "head_dim_v": 100}, "head_dim"),
                          ({"head_dim_qk": 264, "head_dim_v": 264}, "head_dim"),
                          ({"head_dim_qk": 128, "head_dim_v": 64}, "head_dim"),
                          ({"attn_mask_type": "arbitrary"}, "arbitrary"),
                          ({"core_attention_bias_type": "post_scale_bias",
                            "core_attention_bias_shape": "1hss"}, "bias"),
                          ({"compute_capability": (8, 0)}, "compute capability"),
                          ({"batch_size": flash.MAX_BATCH_OR_HEADS + 1}, "sequences")]:
        reasons = flash.not_supported_reasons(dataclasses.replace(base, **change))
        assert reasons and any(words in r for r in reasons), (change, reasons)


@pytest.mark.parametrize("bad", ["head_dim", "head_dim_0", "heads", "sequences"])
def test_binding_rejects_bad_input(bad):
    """The binding's own checks raise, numbers in the message included, before any kernel
    runs. More than 65535 sequences (here thd, one token each) are not claimed either: the
    grids hold sequences and heads in y and z."""
    def randn(*shape):
        return torch.randn(*shape, device=DEV, dtype=torch.bfloat16)

    q = k = randn(2, 8, 2, 64)
    cu, fmt, match = None, "bshd", None
    if bad == "head_dim":
        q = k = randn(2, 8, 2, 264)
        match = "head dim 264 must be"
    elif bad == "head_dim_0":
        q = k = randn(2, 8, 2, 0)
        match = "head dim 0 must be a positive multiple of 8"
    elif bad == "heads":
        q = randn(2, 8, 3, 64)
        match = r"heads of q \(3\) must be a multiple of those of k/v \(2\)"
    else:
        b = flash.MAX_BATCH_OR_HEADS + 1
        q = k = randn(b, 1, 64)
        cu, fmt = torch.arange(b + 1, device=DEV, dtype=torch.int32), "thd"
        match = "at most 65535 sequences and heads per call, got batch 65536"
    assert flash._extension() is not None
    with pytest.raises(RuntimeError, match=match):
        flash._fwd_ext(q, k, k, cu, cu, None, None,
                       flash.FlashCall(fmt, fmt, 8, 8, 0.125, -1, -1, False, 0.0, False, True))
    torch.cuda.synchronize()  # nothing was launched that could fail later


def test_selected_with_and_without_grads(monkeypatch):
    import transformer_fa as tfa

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    dpa = tfa.DotProductAttention(8, 64, num_gqa_groups=2, qkv_format="sbhd").cuda()
    q = torch.randn(200, 2, 8, 64, device=DEV, dtype=torch.bfloat16)
    kv = torch.randn(200, 2, 2, 64, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        out = dpa(q, kv, kv)
    assert dpa.last_backend == "FlashAttention"
    q.requires_grad_()
    out_grad = dpa(q, kv, kv)
    assert dpa.last_backend == "FlashAttention"
    dq = torch.autograd.grad(out_grad, q, torch.ones_like(out_grad))[0]
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    ref = dpa(q, kv, kv)
    assert dpa.last_backend == "UnfusedDotProductAttention"
    dq_ref = torch.autograd.grad(ref, q, torch.ones_like(ref))[0]
    torch.testing.assert_close(out, ref.detach(), rtol=2e-2, atol=2e-2)
    err = (dq.float() - dq_ref.float()).abs().max().item()
    assert err <= 2e-2 * dq_ref.float().abs().max().item(), err


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_torch_compile_matches_eager(fmt):
    """torch.compile(fullgraph=True) traces forward and backward through the ops; the thd
    case with dropout and ALiBi too (same seed: same mask)."""
    thd = fmt == "thd"
    c = Case(fmt=fmt, b=3, sq=128, hq=4, hkv=2, mask="causal", alibi="bh" if thd else None)
    (_, _, _), (q, k, v), _ = build_inputs(c)
    slopes = alibi_slopes(c) if c.alibi else None
    params = make_params(c, requires_grad=True, dropout=0.1 if thd else 0.0, slopes=slopes,
                         deterministic=True)  # bitwise comparable gradients
    assert not flash.not_supported_reasons(params)
    cu_q = cu_seqlens(c.lens_q) if c.padded else None
    cu_kv = cu_seqlens(c.lens_kv) if c.padded else None

    def fn(q, k, v):
        return flash.run(AttentionInputs(q, k, v, cu_q, cu_kv, alibi_slopes=slopes), params)

    torch.manual_seed(0)
    eager = fn(q, k, v)
    dout = torch.randn_like(eager)
    g_eager = torch.autograd.grad(eager, (q, k, v), dout)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch.manual_seed(0)
    out = compiled(q, k, v)
    g = torch.autograd.grad(out, (q, k, v), dout)
    assert torch.equal(out, eager)
    for a, b in zip(g, g_eager):
        assert torch.equal(a, b)


def test_opcheck():
    c = Case(b=2, sq=64, hq=2, mask="causal", dtype=torch.float16)
    (_, _, _), (q, k, v), _ = build_inputs(c)
    q, k, v = (x.detach().contiguous().requires_grad_() for x in (q, k, v))
    rng = torch.tensor([1234, 5678], dtype=torch.int64, device=DEV)
    slopes = torch.rand(2, device=DEV)
    call = flash.FlashCall("bshd", "bshd", 64, 64, 0.125, -1, 0, False, 0.1, False, True)
    args = (q, k, v, None, None, rng, slopes, *call)
    torch.library.opcheck(torch.ops.transformer_fa.flash_attn_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor", "test_aot_dispatch_dynamic"))
    with torch.no_grad():
        out, lse = torch.ops.transformer_fa.flash_attn_fwd(*args)
    bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, None,
                None, rng, slopes, *call._replace(deterministic=True))
    torch.library.opcheck(torch.ops.transformer_fa.flash_attn_bwd.default, bwd_args,
                          test_utils=("test_schema", "test_faketensor"))
