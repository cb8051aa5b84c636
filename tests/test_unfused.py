"""UnfusedDotProductAttention against the independent float64 reference (tests/reference.py)."""
import itertools

import pytest
import torch

import transformer_fa as tfa
from cases import cu_seqlens, make_sequences, output_rows, to_format
from reference import attention_one

from transformer_fa.attention.masks import check_set_window_size

FORMATS = ["sbhd", "bshd", "thd", "sbhd_2bshd", "bshd_2sbhd", "thd_2bshd", "thd_2sbhd"]
MASKS = ["no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
         "padding_causal_bottom_right", "arbitrary"]
WINDOWS = [None, (2, 1), (3, 0)]
GQA = [(4, 4), (4, 2), (4, 1)]


def run_case(qkv_format, mask_type, window, heads, groups, dtype=torch.float32, dq=8, dv=8,
             lens_q=(7, 3), lens_kv=(5, 9), grad=False, bias_type="no_bias", seed=0,
             device="cpu", softmax_type="vanilla", softcap=0.0, return_max_logit=False,
             max_seqlen=None, backend="UnfusedDotProductAttention"):
    """Runs DotProductAttention on one case; returns (per-seq outputs, padding rows, refs).

    softmax_type "learnable" gets a random softmax_offset; with grad=True it and the bias
    are leaves too (case["extra_leaves"]). max_seqlen: declared for both sides (thd only).
    backend: the backend that must have run (None: any).
    """
    gen = torch.Generator().manual_seed(seed)
    q_fmt, kv_fmt = qkv_format.split("_2") if "_2" in qkv_format else (qkv_format,) * 2
    ragged = "padding" in mask_type or "thd" in qkv_format
    if not ragged:  # without padding every sequence has the full length
        lens_q, lens_kv = [max(lens_q)] * len(lens_q), [max(lens_kv)] * len(lens_kv)
    b, sq, skv = len(lens_q), max(lens_q), max(lens_kv)
    qs = make_sequences(lens_q, heads, dq, dtype, gen)
    ks = make_sequences(lens_kv, groups, dq, dtype, gen)
    vs = make_sequences(lens_kv, groups, dv, dtype, gen)
    q, k, v = (to_format(seqs, fmt, gen=gen).to(device).requires_grad_(grad)
               for seqs, fmt in ((qs, q_fmt), (ks, kv_fmt), (vs, kv_fmt)))
    kwargs = {}
    if "thd" in qkv_format or "padding" in mask_type:
        kwargs.update(cu_seqlens_q=cu_seqlens(lens_q).to(device),
                      cu_seqlens_kv=cu_seqlens(lens_kv).to(device))
    if max_seqlen is not None:
        kwargs.update(max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
        sq = skv = max_seqlen  # the bias's shape follows the declared lengths
    arbitrary = None
    if mask_type == "arbitrary":
        arbitrary = torch.rand(b, heads, sq, skv, generator=gen) < 0.3
        kwargs["attention_mask"] = arbitrary.to(device)
    bias = slopes = None
    if bias_type in ("post_scale_bias", "pre_scale_bias"):
        bias = torch.randn(1, heads, sq, skv, generator=gen).to(dtype)
        kwargs["core_attention_bias"] = bias.to(device).requires_grad_(grad)
    if bias_type == "alibi":
        slopes = torch.rand(heads, generator=gen)
        kwargs["alibi_slopes"] = slopes.to(device)
    dpa = tfa.DotProductAttention(heads, (dq, dv), num_gqa_groups=groups, qkv_format=qkv_format,
                                  attn_mask_type=mask_type, window_size=window,
                                  softmax_type=softmax_type, softcap=softcap,
                                  return_max_logit=return_max_logit).to(device)
    if softmax_type == "learnable":
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.randn(heads, generator=gen))
    offset = None if dpa.softmax_offset is None else dpa.softmax_offset.detach().cpu()
    out = dpa(q, k, v, core_attention_bias_type=bias_type, **kwargs)
    assert backend is None or dpa.last_backend == backend, dpa.last_backend
    max_logit = None
    if return_max_logit:
        out, max_logit = out
    outs, pad = output_rows(out.cpu(), q_fmt, lens_q, heads)
    win = check_set_window_size(mask_type, window)

    def reference(i, qi, ki, vi, dtype=torch.float64, bias=bias, offset=offset,
                  with_max_logit=False):
        """The reference for sequence i, from its own q, k, v (float64 unless told)."""
        return attention_one(
            qi, ki, vi, mask_type, win,
            bias=None if bias is None else bias[0, :, : lens_q[i], : lens_kv[i]],
            pre_scale_bias=bias_type == "pre_scale_bias", alibi_slopes=slopes,
            arbitrary=None if arbitrary is None else arbitrary[i, :, : lens_q[i], : lens_kv[i]],
            dtype=dtype, softmax_offset=offset, softcap=softcap, with_max_logit=with_max_logit)

    refs = [reference(i, *seq) for i, seq in enumerate(zip(qs, ks, vs))]
    # What else has a gradient: the bias and the learnable softmax offset.
    extra_leaves = {name: leaf for name, leaf in (
        ("bias", kwargs.get("core_attention_bias")),
        ("offset", dpa.softmax_offset if softmax_type == "learnable" else None))
        if grad and leaf is not None}
    return dict(out=out, outs=outs, pad=pad, refs=refs, inputs=(q, k, v), seqs=(qs, ks, vs),
                reference=reference, formats=(q_fmt, kv_fmt), lens=(lens_q, lens_kv),
                max_logit=max_logit, extra_leaves=extra_leaves, bias=bias, offset=offset)


def check_gradients(case, atol=1e-5, rtol=1e-5):
    """dq, dk, dv (and the extra leaves' gradients) against the reference's, per sequence."""
    grads_out = [torch.randn_like(r) for r in case["refs"]]
    loss = sum((o.double() * g).sum() for o, g in zip(case["outs"], grads_out))
    extra_names = list(case["extra_leaves"])
    got = torch.autograd.grad(loss, (*case["inputs"], *case["extra_leaves"].values()))
    ref_extra = {name: torch.zeros_like(case[name], dtype=torch.float64) for name in extra_names}
    ref_grads = []
    for i, seq in enumerate(zip(*case["seqs"])):
        leaves = [t.double().requires_grad_() for t in seq]
        extras = {name: case[name].double().requires_grad_() for name in extra_names}
        ref = case["reference"](i, *leaves, **extras)
        grads = torch.autograd.grad((ref * grads_out[i]).sum(), [*leaves, *extras.values()],
                                    allow_unused=True)
        ref_grads.append(grads[:3])
        for name, g in zip(extra_names, grads[3:]):
            if g is not None:
                ref_extra[name] += g
    (q_fmt, kv_fmt), (lens_q, lens_kv) = case["formats"], case["lens"]
    for idx, name, fmt, lens in ((0, "dq", q_fmt, lens_q), (1, "dk", kv_fmt, lens_kv),
                                 (2, "dv", kv_fmt, lens_kv)):
        g = got[idx]
        rows, pad = output_rows(g.reshape(*g.shape[:-2], -1), fmt, lens, g.shape[-2])
        for row, ref in zip(rows, ref_grads):
            torch.testing.assert_close(row.cpu().double(), ref[idx], atol=atol, rtol=rtol,
                                       msg=lambda m, name=name: f"{name}: {m}")
        assert pad.numel() == 0 or pad.abs().max() == 0, f"{name} of padding must be zero"
    for name, g in zip(extra_names, got[3:]):
        torch.testing.assert_close(g.cpu().double().reshape(ref_extra[name].shape),
                                   ref_extra[name], atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"{name}: {m}")


CASES = [c for c in itertools.product(FORMATS, MASKS, WINDOWS, GQA)
         if not (c[1] == "arbitrary" and "thd" in c[0])]


@pytest.mark.parametrize("qkv_format,mask_type,window,gqa", CASES)
def test_forward_matches_reference(qkv_format, mask_type, window, gqa):
    case = run_case(qkv_format, mask_type, window, *gqa)
    for got, ref in zip(case["outs"], case["refs"]):
        torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=2e-6)
    pad = case["pad"]
    assert pad.numel() == 0 or pad.abs().max() == 0, "padding rows must be zero"


@pytest.mark.parametrize("bias_type", ["post_scale_bias", "pre_scale_bias", "alibi"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right", "padding_causal"])
def test_bias_and_alibi(bias_type, mask_type):
    case = run_case("bshd", mask_type, None, 4, 2, bias_type=bias_type, lens_q=(6, 6),
                    lens_kv=(9, 9))
    for got, ref in zip(case["outs"], case["refs"]):
        torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("qkv_format,mask_type,window,gqa", [
    ("sbhd", "causal", None, (4, 2)), ("bshd", "padding_causal_bottom_right", (2, 0), (4, 1)),
    ("thd", "padding", (1, 2), (4, 4)), ("thd_2bshd", "padding_causal", None, (4, 2)),
    ("bshd", "arbitrary", None, (4, 4)), ("sbhd", "no_mask", (3, 3), (4, 2))])
def test_gradients_match_reference(qkv_format, mask_type, window, gqa):
    check_gradients(run_case(qkv_format, mask_type, window, *gqa, grad=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_type", ["causal", "padding"])
def test_half_precision(dtype, mask_type):
    case = run_case("bshd", mask_type, None, 4, 2, dtype=dtype, dq=16, dv=16)
    assert case["out"].dtype == dtype
    for got, ref in zip(case["outs"], case["refs"]):
        torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2)


def test_fully_masked_rows_are_zero_not_nan():
    heads, s = 2, 5
    dpa = tfa.DotProductAttention(heads, 8, qkv_format="bshd", attn_mask_type="arbitrary")
    q = torch.randn(1, s, heads, 8, requires_grad=True)
    mask = torch.zeros(1, 1, s, s, dtype=torch.bool)
    mask[..., 2, :] = True  # query 2 sees nothing
    out = dpa(q, q, q, attention_mask=mask)
    assert torch.all(out[0, 2] == 0) and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_dropout_train_only_reproducible_and_unbiased():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 6, 2, 8) for _ in range(3))
    dpa = tfa.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="no_mask",
                                  attention_dropout=0.5)
    plain = tfa.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="no_mask")
    expected = plain(q, k, v)
    dpa.eval()
    torch.testing.assert_close(dpa(q, k, v), expected)
    dpa.train()
    torch.manual_seed(1)
    a = dpa(q, k, v)
    torch.manual_seed(1)
    b = dpa(q, k, v)
    assert torch.equal(a, b) and not torch.allclose(a, expected)
    mean = torch.stack([dpa(q, k, v) for _ in range(2000)]).mean(0)
    torch.testing.assert_close(mean, expected, atol=0.08, rtol=0)


def test_softmax_scale():
    q, k, v = (torch.randn(5, 1, 2, 8) for _ in range(3))
    dpa = tfa.DotProductAttention(2, 8, attn_mask_type="no_mask", softmax_scale=0.3)
    ref = attention_one(q[:, 0], k[:, 0], v[:, 0], scale=0.3)
    torch.testing.assert_close(dpa(q, k, v)[:, 0].reshape(5, 2, 8).double(), ref, atol=2e-6, rtol=0)
