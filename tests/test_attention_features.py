"""The reference backend's precision and cost, and TE's newer attention features.

float64 is computed in float64 (gradcheck), thd pads to the real longest sequence, and
softmax_type (attention sinks), head_dim_qk != head_dim_v (MLA), return_max_logit and softcap
are checked against the independent float64 reference (tests/reference.py), forward and
gradients, in every format.
"""
import pytest
import torch

import transformer_fa as tfa
from cases import cu_seqlens
from test_unfused import FORMATS, check_gradients, run_case

from transformer_fa.attention import masks
from transformer_fa.attention.backends import unfused
from transformer_fa.attention.params import AttentionParams

CPU = torch.device("cpu")


def assert_matches_reference(case, atol=2e-6, rtol=2e-6):
    for got, ref in zip(case["outs"], case["refs"]):
        torch.testing.assert_close(got.double(), ref, atol=atol, rtol=rtol)
    pad = case["pad"]
    assert pad.numel() == 0 or pad.abs().max() == 0, "padding rows must be zero"


# --------------------------------------------------------------------------------------------
# float64 is computed in float64
# --------------------------------------------------------------------------------------------
GRADCHECK_CASES = [
    # (qkv_format, mask_type, window, heads, groups, bias_type, extra module kwargs)
    ("sbhd", "causal", None, 2, 2, "no_bias", {}),
    ("bshd", "no_mask", (1, 1), 2, 1, "no_bias", {}),
    ("bshd", "padding", None, 2, 2, "no_bias", {}),
    ("bshd", "causal_bottom_right", (2, 0), 2, 1, "no_bias", {}),
    ("bshd", "padding_causal_bottom_right", None, 2, 2, "no_bias", {}),
    ("bshd", "arbitrary", None, 2, 2, "no_bias", {}),
    ("thd", "padding_causal", (2, 0), 2, 1, "no_bias", {}),
    ("thd", "padding", None, 2, 2, "post_scale_bias", {}),
    ("sbhd", "causal", None, 2, 2, "post_scale_bias", {}),
    ("bshd", "padding_causal", None, 2, 2, "alibi", {}),
    ("thd", "padding_causal_bottom_right", None, 2, 1, "alibi", {}),
    ("bshd", "causal", None, 2, 2, "no_bias", {"softmax_type": "learnable"}),
    ("thd", "padding", None, 2, 1, "no_bias", {"softmax_type": "off-by-one"}),
    ("sbhd", "no_mask", None, 2, 2, "post_scale_bias", {"softcap": 2.0}),
    ("bshd", "causal", None, 2, 1, "no_bias", {"kv_channels": (6, 4)}),
]


def _small_inputs(qkv_format, mask_type, heads, groups, bias_type, dq, dv, gen):
    """float64 leaves and call kwargs for a gradcheck: 2 sequences of lengths 4 and 2."""
    lens = [4, 2] if ("padding" in mask_type or qkv_format == "thd") else [4, 4]
    b, s = len(lens), max(lens)
    shape = (sum(lens),) if qkv_format == "thd" else ((s, b) if qkv_format == "sbhd" else (b, s))
    q = torch.randn(*shape, heads, dq, generator=gen, dtype=torch.float64)
    k = torch.randn(*shape, groups, dq, generator=gen, dtype=torch.float64)
    v = torch.randn(*shape, groups, dv, generator=gen, dtype=torch.float64)
    leaves, kwargs = [q, k, v], {"core_attention_bias_type": bias_type}
    if "padding" in mask_type or qkv_format == "thd":
        kwargs.update(cu_seqlens_q=cu_seqlens(lens), cu_seqlens_kv=cu_seqlens(lens))
    if mask_type == "arbitrary":
        kwargs["attention_mask"] = torch.rand(b, heads, s, s, generator=gen) < 0.3
    if bias_type == "post_scale_bias":
        leaves.append(torch.randn(1, heads, s, s, generator=gen, dtype=torch.float64))
    if bias_type == "alibi":
        kwargs["alibi_slopes"] = torch.rand(heads, generator=gen)  # float32, as TE asks
    return leaves, kwargs


@pytest.mark.parametrize("qkv_format,mask_type,window,heads,groups,bias_type,extra",
                         GRADCHECK_CASES)
def test_gradcheck_float64(qkv_format, mask_type, window, heads, groups, bias_type, extra):
    gen = torch.Generator().manual_seed(0)
    extra = dict(extra)
    dq, dv = extra.pop("kv_channels", (4, 4))
    dpa = tfa.DotProductAttention(heads, (dq, dv), num_gqa_groups=groups, qkv_format=qkv_format,
                                  attn_mask_type=mask_type, window_size=window, **extra)
    dpa = dpa.to(CPU).double()
    leaves, kwargs = _small_inputs(qkv_format, mask_type, heads, groups, bias_type, dq, dv, gen)
    if dpa.softmax_offset is not None and isinstance(dpa.softmax_offset, torch.nn.Parameter):
        with torch.no_grad():
            dpa.softmax_offset.copy_(torch.randn(heads, generator=gen))
        leaves.append(dpa.softmax_offset)
    leaves = [t.detach().requires_grad_() if not isinstance(t, torch.nn.Parameter) else t
              for t in leaves]

    def attention(q, k, v, *rest):
        if bias_type == "post_scale_bias":
            kwargs["core_attention_bias"] = rest[0]
        return dpa(q, k, v, **kwargs)

    assert attention(*leaves).dtype == torch.float64
    assert torch.autograd.gradcheck(attention, leaves, eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=True)


def test_float64_forward_is_float64_exact():
    # float32 math would leave ~1e-7 relative error; float64 math leaves ~1e-15.
    case = run_case("bshd", "padding_causal", None, 4, 2, dtype=torch.float64,
                    bias_type="alibi")
    for got, ref in zip(case["outs"], case["refs"]):
        torch.testing.assert_close(got, ref, atol=1e-13, rtol=1e-13)


def test_alibi_bias_follows_the_requested_dtype():
    slopes = torch.tensor([0.5, 0.25])  # float32, as TE's slopes are
    lens = torch.tensor([3], dtype=torch.int32)
    assert masks.alibi_bias(slopes, "no_mask", lens, lens, 3, 3).dtype == torch.float32
    bias = masks.alibi_bias(slopes, "no_mask", lens, lens, 3, 3, dtype=torch.float64)
    assert bias.dtype == torch.float64 and bias[0, 1, 0, 2].item() == -0.5


@pytest.mark.parametrize("dtype,expected", [(torch.float16, torch.float32),
                                            (torch.bfloat16, torch.float32),
                                            (torch.float32, torch.float32),
                                            (torch.float64, torch.float64)])
def test_compute_dtype(dtype, expected):
    assert unfused.compute_dtype(dtype) == expected


# --------------------------------------------------------------------------------------------
# thd: the cost follows the real lengths, not the declared max_seqlen
# --------------------------------------------------------------------------------------------
def _record_padded_lengths(monkeypatch):
    sizes = []
    real = unfused.padded_lengths

    def recording(*args):
        sizes.append(real(*args))
        return sizes[-1]
    monkeypatch.setattr(unfused, "padded_lengths", recording)
    return sizes


@pytest.mark.parametrize("qkv_format", ["thd", "thd_2bshd", "thd_2sbhd"])
def test_thd_pads_to_the_longest_sequence_not_max_seqlen(monkeypatch, qkv_format):
    sizes = _record_padded_lengths(monkeypatch)
    padded = []
    real_pad = unfused.padding.pad_packed
    monkeypatch.setattr(unfused.padding, "pad_packed",
                        lambda x, cu, n: padded.append(n) or real_pad(x, cu, n))
    case = run_case(qkv_format, "padding_causal", None, 4, 2, lens_q=(7, 3), lens_kv=(5, 9),
                    max_seqlen=8192 if qkv_format == "thd" else None)
    assert_matches_reference(case)
    kv_len = 9  # the longest kv sequence (thd) or the bshd/sbhd tensor's own length
    assert sizes == [(7, kv_len)]
    assert padded and set(padded) <= {7, 9}, padded  # nothing of 8192 was ever built


def test_thd_with_a_huge_max_seqlen_and_bias_works(monkeypatch):
    sizes = _record_padded_lengths(monkeypatch)
    case = run_case("thd", "padding", None, 2, 2, lens_q=(3, 2), lens_kv=(2, 4),
                    max_seqlen=100000)
    assert_matches_reference(case)
    assert sizes == [(3, 4)]
    # A bias is given for the declared lengths and trimmed to the padded ones.
    case = run_case("thd", "padding", None, 2, 2, lens_q=(3, 2), lens_kv=(2, 4),
                    max_seqlen=12, bias_type="post_scale_bias", grad=True)
    assert_matches_reference(case)
    check_gradients(case)


def test_thd_under_compile_keeps_the_declared_max_seqlen(monkeypatch):
    params = AttentionParams(
        qkv_format="thd", q_format="thd", kv_format="thd", qkv_layout="thd_thd_thd",
        batch_size=2, num_heads=2, num_gqa_groups=2, max_seqlen_q=64, max_seqlen_kv=32,
        head_dim_qk=8, head_dim_v=8, dtype=torch.float32, device_type="cpu",
        compute_capability=None, attn_mask_type="padding", window_size=(-1, -1),
        core_attention_bias_type="no_bias", core_attention_bias_shape=None,
        core_attention_bias_requires_grad=False, alibi_slopes_shape=None,
        attention_dropout=0.0, softmax_scale=0.35, deterministic=False, requires_grad=False)
    lens_q, lens_kv = torch.tensor([3, 5]), torch.tensor([4, 2])
    assert unfused.padded_lengths(params, lens_q, lens_kv) == (5, 4)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert unfused.padded_lengths(params, lens_q, lens_kv) == (64, 32)


def test_thd_compiled_matches_eager():
    dpa = tfa.DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding_causal")
    cu = cu_seqlens([5, 3])
    q, k, v = (torch.randn(8, 2, 8) for _ in range(3))
    eager = dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=16, max_seqlen_kv=16)
    compiled = torch.compile(dpa, backend="eager", fullgraph=False)
    out = compiled(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=16, max_seqlen_kv=16)
    torch.testing.assert_close(out, eager)


# --------------------------------------------------------------------------------------------
# softmax_type: attention sinks
# --------------------------------------------------------------------------------------------
def test_softmax_offset_is_what_te_makes():
    assert tfa.DotProductAttention(4, 8).softmax_offset is None
    off_by_one = tfa.DotProductAttention(4, 8, softmax_type="off-by-one")
    assert torch.equal(off_by_one.softmax_offset.cpu(), torch.zeros(4))
    assert not list(off_by_one.parameters()) and not off_by_one.state_dict()
    learnable = tfa.DotProductAttention(4, 8, softmax_type="learnable")
    (name, param), = learnable.named_parameters()
    assert name == "softmax_offset" and param.shape == (4,) and param.dtype == torch.float32
    assert torch.equal(param.detach().cpu(), torch.zeros(4))
    assert list(learnable.state_dict()) == ["softmax_offset"]
    with pytest.raises(ValueError, match="softmax_type must be one of"):
        tfa.DotProductAttention(4, 8, softmax_type="sink")


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("qkv_format", FORMATS)
def test_softmax_type_matches_reference(softmax_type, qkv_format):
    mask = "padding_causal" if "thd" in qkv_format else "causal_bottom_right"
    case = run_case(qkv_format, mask, None, 4, 2, softmax_type=softmax_type, grad=True)
    assert_matches_reference(case)
    check_gradients(case)


@pytest.mark.parametrize("mask_type,window,bias_type", [
    ("no_mask", (2, 1), "post_scale_bias"), ("padding_causal", None, "alibi"),
    ("arbitrary", None, "pre_scale_bias")])
def test_softmax_sink_with_masks_and_biases(mask_type, window, bias_type):
    case = run_case("bshd", mask_type, window, 4, 1, softmax_type="learnable",
                    bias_type=bias_type, grad=True)
    assert_matches_reference(case)
    check_gradients(case)


def test_off_by_one_differs_from_vanilla_by_the_sink():
    q, k, v = (torch.randn(5, 1, 2, 8) for _ in range(3))
    vanilla = tfa.DotProductAttention(2, 8, attn_mask_type="no_mask")(q, k, v)
    sink = tfa.DotProductAttention(2, 8, attn_mask_type="no_mask", softmax_type="off-by-one")
    out = sink.to(CPU)(q, k, v)
    # Each row's weights shrink by sum(exp(s)) / (1 + sum(exp(s))) < 1: never equal.
    assert not torch.allclose(out, vanilla)


def test_learnable_offset_gets_its_gradient_through_the_module():
    dpa = tfa.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal",
                                  softmax_type="learnable").to(CPU)
    q = torch.randn(2, 5, 2, 8)
    dpa(q, q, q).sum().backward()
    assert dpa.softmax_offset.grad is not None and dpa.softmax_offset.grad.abs().min() > 0


def test_sink_with_a_fully_masked_row_gives_zeros():
    dpa = tfa.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="arbitrary",
                                  softmax_type="learnable").to(CPU)
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 1, :] = True
    out = dpa(q, q, q, attention_mask=mask)
    assert torch.all(out[0, 1] == 0) and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(dpa.softmax_offset.grad).all()


# --------------------------------------------------------------------------------------------
# head_dim_qk != head_dim_v (MLA)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qkv_format", FORMATS)
def test_mla_head_dims_match_reference(qkv_format):
    mask = "padding_causal" if "thd" in qkv_format else "causal"
    case = run_case(qkv_format, mask, None, 2, 1, dq=192, dv=128, lens_q=(4, 2),
                    lens_kv=(3, 5), grad=True)
    assert case["out"].shape[-1] == 2 * 128
    assert_matches_reference(case, atol=1e-5, rtol=1e-5)
    check_gradients(case, atol=1e-4, rtol=1e-4)


def test_mla_packed_buffer_is_refused_clearly():
    # k and v packed in one [s, b, 2, h, d] buffer have one head dim; MLA needs two.
    dpa = tfa.DotProductAttention(2, (192, 128), attn_mask_type="no_mask")
    q = torch.randn(4, 1, 2, 192)
    kv = torch.randn(4, 1, 2, 2, 192)
    with pytest.raises(ValueError, match=r"value_layer head dim must be 128 \(v channels\), "
                                         r"got 192"):
        dpa(q, kv[:, :, 0], kv[:, :, 1])


# --------------------------------------------------------------------------------------------
# return_max_logit
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qkv_format", FORMATS)
def test_max_logit_matches_reference(qkv_format):
    mask = "padding_causal" if "thd" in qkv_format else "causal"
    case = run_case(qkv_format, mask, (3, 0), 4, 2, return_max_logit=True,
                    bias_type="post_scale_bias", grad=True)
    assert_matches_reference(case)
    max_logit = case["max_logit"]
    assert max_logit.shape == (4,) and max_logit.dtype == case["out"].dtype
    assert not max_logit.requires_grad
    per_seq = torch.stack([case["reference"](i, *seq, with_max_logit=True)[1]
                           for i, seq in enumerate(zip(*case["seqs"]))])
    torch.testing.assert_close(max_logit.double(), per_seq.amax(0), atol=2e-6, rtol=2e-6)
    check_gradients(case)  # the output keeps its gradients


@pytest.mark.parametrize("bias_type,softcap", [("alibi", 0.0), ("no_bias", 1.5)])
def test_max_logit_sees_alibi_and_softcap(bias_type, softcap):
    case = run_case("bshd", "padding", None, 4, 4, return_max_logit=True, bias_type=bias_type,
                    softcap=softcap, softmax_type="off-by-one")
    per_seq = torch.stack([case["reference"](i, *seq, with_max_logit=True)[1]
                           for i, seq in enumerate(zip(*case["seqs"]))])
    torch.testing.assert_close(case["max_logit"].double(), per_seq.amax(0), atol=2e-6,
                               rtol=2e-6)


def test_max_logit_in_half_precision_has_the_output_dtype():
    dpa = tfa.DotProductAttention(2, 8, attn_mask_type="no_mask", return_max_logit=True)
    q = torch.randn(4, 1, 2, 8, dtype=torch.bfloat16)
    out, max_logit = dpa(q, q, q)
    assert out.dtype == max_logit.dtype == torch.bfloat16 and max_logit.shape == (2,)
    with pytest.raises(TypeError, match="return_max_logit must be a bool"):
        tfa.DotProductAttention(2, 8, return_max_logit="yes")


def test_max_logit_of_heads_with_nothing_to_attend_is_minus_inf():
    dpa = tfa.DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding",
                                  return_max_logit=True)
    for lens_q, lens_kv in (((3, 0), (0, 4)), ((0, 0), (0, 0))):  # no pair of tokens at all
        q, k = torch.randn(sum(lens_q), 2, 8), torch.randn(sum(lens_kv), 2, 8)
        out, max_logit = dpa(q, k, k, cu_seqlens_q=cu_seqlens(lens_q),
                             cu_seqlens_kv=cu_seqlens(lens_kv), max_seqlen_q=100000,
                             max_seqlen_kv=100000)
        assert torch.all(out == 0) and max_logit.tolist() == [float("-inf")] * 2


# --------------------------------------------------------------------------------------------
# softcap
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qkv_format", FORMATS)
def test_softcap_matches_reference(qkv_format):
    mask = "padding_causal_bottom_right" if "thd" in qkv_format else "causal"
    case = run_case(qkv_format, mask, None, 4, 2, softcap=0.5, grad=True, bias_type="alibi")
    assert_matches_reference(case)
    check_gradients(case)


def test_softcap_forward_argument_overrides_the_module():
    q, k, v = (torch.randn(5, 1, 2, 8) * 4 for _ in range(3))
    capped = tfa.DotProductAttention(2, 8, attn_mask_type="no_mask", softcap=0.5)
    plain = tfa.DotProductAttention(2, 8, attn_mask_type="no_mask")
    assert not torch.allclose(capped(q, k, v), plain(q, k, v))
    torch.testing.assert_close(plain(q, k, v, softcap=0.5), capped(q, k, v))
    torch.testing.assert_close(capped(q, k, v, softcap=0.0), plain(q, k, v))


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), "1", True])
def test_softcap_bad_values(bad):
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
        tfa.DotProductAttention(2, 8, softcap=bad)
    with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
        tfa.DotProductAttention(2, 8)(*(torch.randn(3, 1, 2, 8) for _ in range(3)), softcap=bad)


# --------------------------------------------------------------------------------------------
# On a GPU: whichever backend is selected must honour the features (or decline them)
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("feature", [
    dict(softmax_type="off-by-one"), dict(softmax_type="learnable"),
    dict(return_max_logit=True), dict(softcap=0.5), dict(dq=192, dv=128)])
@pytest.mark.parametrize("qkv_format,mask_type", [("bshd", "causal"), ("thd", "padding_causal")])
def test_features_on_cuda_are_served_right(feature, dtype, qkv_format, mask_type):
    feature = dict(feature)
    dims = dict(dq=feature.pop("dq", 64), dv=feature.pop("dv", 64))
    case = run_case(qkv_format, mask_type, None, 4, 2, dtype=dtype, device="cuda",
                    lens_q=(70, 33), lens_kv=(70, 33), grad=True, backend=None, **dims,
                    **feature)
    assert case["out"].dtype == dtype
    assert_matches_reference(case, atol=2e-2, rtol=2e-2)
    if feature.get("return_max_logit"):
        per_seq = torch.stack([case["reference"](i, *seq, with_max_logit=True)[1]
                               for i, seq in enumerate(zip(*case["seqs"]))])
        torch.testing.assert_close(case["max_logit"].cpu().double(), per_seq.amax(0),
                                   atol=3e-2, rtol=2e-2)
    check_gradients(case, atol=5e-2, rtol=5e-2)


def test_softmax_offset_on_another_device_is_a_clear_error():
    dpa = tfa.DotProductAttention(2, 8, softmax_type="learnable").to("meta")
    with pytest.raises(ValueError, match="softmax_offset .* is on meta .* move the module"):
        dpa(*(torch.randn(3, 1, 2, 8) for _ in range(3)))
    mha = tfa.MultiheadAttention(16, 2, softmax_type="off-by-one", device="cpu")
    assert mha.core_attention.softmax_offset.device.type == "cpu"
