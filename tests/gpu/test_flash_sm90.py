"""FlashAttention's sm90 kernel family (csrc/flash/sm90/: wgmma, TMA, warp specialization) on
an sm_90 GPU: its forward against float64 math, the family choice (what it serves, what it
declines, the debug log), and the sm80 backward of an sm90 forward.

Error rule per case, for O and for the LSE: max |ours - float64| <= 2 x max |the same math in
the input dtype - float64| + 1e-3 (relative to the reference's magnitude; attention_cases.check
with a float64 reference). Outputs are allocated over NaN-poisoned memory, so an element the
kernel does not write fails. Skipped without an sm_90 GPU or without the family in the build.
"""
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the sm90 kernels need CUDA", allow_module_level=True)

from transformer_fa.attention.backends import flash  # noqa: E402

if not flash.is_built() or flash._extension() is None:
    pytest.skip("transformer_fa_flash is not built", allow_module_level=True)

from attention_cases import DEV, capture_log, check  # noqa: E402

EXT = flash._extension()
CC = torch.cuda.get_device_capability()
ARCH = CC[0] * 10 + CC[1]
if ARCH != 90 or EXT.fwd_family(90, True, 128, 128, 128, False, -1, -1, False, False,
                                 False)[0] != "sm90":
    pytest.skip("needs an sm_90 GPU and a build with the sm90 family", allow_module_level=True)

BSHD, SBHD = 0, 1
D = 128


def make_qkv(b, sq, sk, h, hkv, dtype, layout, gain=1.0, seed=0, d=D):
    """q, k, v ([b, s, h, d] views, or [s, b, h, d] for sbhd) in one of the layouts: separate
    bshd tensors, separate sbhd, or slices of one packed [b, s, 3, h, d] buffer (bs3hd)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape):
        return (torch.randn(*shape, generator=gen, device=DEV) * gain).to(dtype)

    if layout == "bs3hd":
        assert h == hkv and sq == sk
        qkv = randn(b, sq, 3, h, d)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if layout == "sbhd":
        return randn(sq, b, h, d), randn(sk, b, hkv, d), randn(sk, b, hkv, d)
    return randn(b, sq, h, d), randn(b, sk, hkv, d), randn(b, sk, hkv, d)


def to_bshd(x, layout):
    return x.transpose(0, 1) if layout == "sbhd" else x


def reference(q, k, v, causal, scale, dtype, bottom_right=False):
    """(out [b, sq, h, d], lse [b, h, sq]) of bshd q, k, v in `dtype` math (float64 for the
    reference, the input dtype for the error baseline). Causal: query i sees keys
    j <= i + (sk - sq if bottom_right else 0)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(
            sk - sq if bottom_right else 0)
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s.double(), dim=-1)
    p = torch.softmax(s.double(), dim=-1).to(dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def poison():
    junk = torch.full((64 << 20,), float("nan"), device=DEV)
    del junk


def run_fwd(q, k, v, layout, causal, family, return_lse=True, bottom_right=False):
    fmt = SBHD if layout == "sbhd" else BSHD
    sq, sk = (q.shape[0], k.shape[0]) if layout == "sbhd" else (q.shape[1], k.shape[1])
    poison()
    return EXT.fwd(q, k, v, None, None, fmt, fmt, sq, sk, 1 / math.sqrt(q.shape[-1]), -1,
                   0 if causal else -1, bottom_right, return_lse, 0.0, None, None, family)


# (b, sq, sk, h, hkv, layout, input gain): small and large grids (the persistent grid loops
# when tiles outnumber SMs: 4 x 16 x 8 and 8 x 16 x 4 = 512 tiles on 132 SMs at d128; causal
# d64 is persistent up to s = 512 only: 12 x 16 x 3 = 576 tiles of 192 rows), GQA and MQA,
# the layouts' strides, a sharper softmax (gain 4), lengths that are not tile multiples (the
# key tail masked, the query tail not stored), one token, and sq != sk both ways.
CASES = {
    "b2-s128-h2": (2, 128, 128, 2, 2, "bshd", 1.0),
    "b1-s1024-h4": (1, 1024, 1024, 4, 4, "bshd", 1.0),
    "gqa-b2-s512-h8-hkv2": (2, 512, 512, 8, 2, "bshd", 1.0),
    "mqa-b1-s2048-h4-hkv1": (1, 2048, 2048, 4, 1, "bshd", 1.0),
    "packed-bs3hd-b2-s512-h4": (2, 512, 512, 4, 4, "bs3hd", 1.0),
    "sbhd-b3-s256-h4-hkv2": (3, 256, 256, 4, 2, "sbhd", 1.0),
    "sharp-b2-s512-h4": (2, 512, 512, 4, 4, "bshd", 4.0),
    "loops-b4-s2048-h8-hkv2": (4, 2048, 2048, 8, 2, "bshd", 1.0),
    "loops-b8-s1024-h16": (8, 1024, 1024, 16, 16, "bshd", 1.0),
    "loops-b12-s512-h16": (12, 512, 512, 16, 16, "bshd", 1.0),
    "tail-b2-s200-h4": (2, 200, 200, 4, 4, "bshd", 1.0),
    "one-token-b3-s1-h2": (3, 1, 1, 2, 2, "bshd", 1.0),
    "packed-tail-b2-s333-h2": (2, 333, 333, 2, 2, "bs3hd", 1.0),
    "cross-b2-sq300-sk700-h4-hkv2": (2, 300, 700, 4, 2, "bshd", 1.0),
    "cross-b2-sq700-sk300-h4": (2, 700, 300, 4, 4, "bshd", 1.0),
    "cross-sbhd-b2-sq129-sk257-h4-hkv2": (2, 129, 257, 4, 2, "sbhd", 1.0),
    "decode-b4-sq1-sk1000-h8-hkv2": (4, 1, 1000, 8, 2, "bshd", 1.0),
    "chunk-b2-sq130-sk1100-h4": (2, 130, 1100, 4, 4, "bshd", 2.0),
}
MASKS = {"no_mask": (False, False), "causal": (True, False), "causal_bottom_right": (True, True)}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_forward_matches_float64(name, mask, dtype, d):
    b, sq, sk, h, hkv, layout, gain = CASES[name]
    causal, bottom_right = MASKS[mask]
    if bottom_right and sq == sk:
        pytest.skip("the same mask as top-left causal")
    if bottom_right and sq > sk:
        pytest.skip("declined by the sm90 family (test_declined_calls_...)")
    q, k, v = make_qkv(b, sq, sk, h, hkv, dtype, layout, gain, d=d)
    out, lse = run_fwd(q, k, v, layout, causal, family=90, bottom_right=bottom_right)
    qb, kb, vb = (to_bshd(x, layout) for x in (q, k, v))
    scale = 1 / math.sqrt(d)
    ref, ref_lse = reference(qb, kb, vb, causal, scale, torch.float64, bottom_right)
    base, base_lse = reference(qb, kb, vb, causal, scale, dtype, bottom_right)
    check(f"{name} out", to_bshd(out, layout).double(), ref, base.double(), 1e-3)
    check(f"{name} lse", lse.double(), ref_lse, base_lse, 1e-3)
    # the sm80 family on the same call obeys the same rule (and so agrees with sm90)
    out80, _ = run_fwd(q, k, v, layout, causal, family=80, bottom_right=bottom_right)
    check(f"{name} sm80 out", to_bshd(out80, layout).double(), ref, base.double(), 1e-3)


def test_forward_without_lse():
    q, k, v = make_qkv(2, 256, 256, 4, 2, torch.bfloat16, "bshd")
    out, lse = run_fwd(q, k, v, "bshd", True, family=90, return_lse=False)
    ref, _ = run_fwd(q, k, v, "bshd", True, family=90)
    assert lse.numel() == 0
    assert torch.equal(out, ref)


def test_auto_family_runs_sm90_where_it_serves():
    """The default (family 0) gives bitwise what the forced sm90 family gives."""
    q, k, v = make_qkv(2, 512, 512, 8, 2, torch.bfloat16, "bshd", seed=3)
    auto, _ = run_fwd(q, k, v, "bshd", True, family=0)
    sm90, _ = run_fwd(q, k, v, "bshd", True, family=90)
    sm80, _ = run_fwd(q, k, v, "bshd", True, family=80)
    assert torch.equal(auto, sm90)
    assert not torch.equal(auto, sm80)  # a different kernel: rounding differs somewhere


# (d, sq, sk, varlen, window_left, window_right, bottom_right, alibi, dropout) -> the
# reason's words
DECLINED = {
    "head dim 96": ((96, 256, 256, False, -1, -1, False, False, False),
                    "head dim 64, 128 and 256 kernels only"),
    "bottom-right sq > sk": ((128, 384, 256, False, -1, 0, True, False, False),
                             "bottom-right causal masks with seqlen_q > seqlen_kv"),
    "no keys": ((128, 256, 0, False, -1, -1, False, False, False), "at least one key"),
    "varlen": ((128, 256, 256, True, -1, -1, False, False, False), "varlen"),
    "window": ((128, 256, 256, False, 64, 0, False, False, False), "sliding windows"),
    "alibi": ((128, 256, 256, False, -1, 0, False, True, False), "ALiBi"),
    "dropout": ((128, 256, 256, False, -1, -1, False, False, True), "dropout"),
}


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_declined_calls_run_on_sm80_and_say_why(name):
    args, words = DECLINED[name]
    family, why = EXT.fwd_family(ARCH, True, *args)
    assert family == "sm80" and words in why, (family, why)
    served = (128, 200, 300, False, -1, 0, True, False, False)
    assert EXT.fwd_family(ARCH, True, *served) == ["sm90", ""]
    assert EXT.fwd_family(ARCH, True, *served, 80)[0] == "sm80"
    assert EXT.fwd_family(80, True, *served)[0] == "sm80"


def test_forced_sm90_on_a_declined_call_is_a_clear_error():
    q = torch.randn(1, 256, 2, 96, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="sm90 family was requested, but it has head dim 64, "
                                           "128 and 256 kernels only"):
        EXT.fwd(q, q, q, None, None, 0, 0, 256, 256, 0.1, -1, -1, False, True, 0.0, None, None,
                90)
    with pytest.raises(RuntimeError, match="family must be 0"):
        EXT.fwd(q, q, q, None, None, 0, 0, 256, 256, 0.1, -1, -1, False, True, 0.0, None, None,
                100)


def _dpa_grads(dpa, q, k, v):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = dpa(*leaves)
    gen = torch.Generator(device=DEV).manual_seed(11)
    dout = torch.randn(out.shape, generator=gen, device=DEV).to(out.dtype)
    return out, torch.autograd.grad(out, leaves, dout), dout


@pytest.mark.parametrize("causal", [False, True], ids=["no_mask", "causal"])
def test_training_step_sm90_forward_sm80_backward(monkeypatch, causal):
    """Through DotProductAttention (FlashAttention selected): the sm90 forward's O and LSE
    feed the sm80 backward; gradients obey the rule against float64 autograd."""
    import transformer_fa as tfa

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    b, s, h, hkv = 2, 300, 8, 2  # 300: the sm90 query and key tails
    q, k, v = make_qkv(b, s, s, h, hkv, torch.bfloat16, "bshd", seed=7)
    dpa = tfa.DotProductAttention(h, D, num_gqa_groups=hkv, qkv_format="bshd",
                                  attn_mask_type="causal" if causal else "no_mask").cuda()
    with capture_log() as lines:
        out, grads, dout = _dpa_grads(dpa, q, k, v)
    assert dpa.last_backend == "FlashAttention"
    assert any("FlashAttention forward kernel family = sm90" in line for line in lines), lines
    scale = 1 / math.sqrt(D)
    results = {}
    for dtype in (torch.float64, torch.bfloat16):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        ref, _ = reference(*leaves, causal, scale, dtype)
        results[dtype] = (ref, torch.autograd.grad(ref, leaves, dout.view(b, s, h, D).to(dtype)))
    (ref, ref_grads), (base, base_grads) = results[torch.float64], results[torch.bfloat16]
    check("out", out.view(b, s, h, D).double(), ref, base.double(), 1e-3)
    for name, g, r, bg in zip("qkv", grads, ref_grads, base_grads):
        check(f"d{name}", g.double(), r, bg.double(), 1e-3)


def logged_d96_call(monkeypatch, heads):
    """A causal bf16 call at head dim 96 (no sm90 kernel) with FusedAttention off and the
    debug log on: (the backend that ran, the log lines)."""
    import transformer_fa as tfa

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    dpa = tfa.DotProductAttention(heads, 96, qkv_format="bshd", attn_mask_type="causal").cuda()
    q = torch.randn(2, 256, heads, 96, device=DEV, dtype=torch.bfloat16)
    with capture_log() as lines, torch.no_grad():
        dpa(q, q, q)
    return dpa.last_backend, lines


def test_debug_log_names_the_family_and_why_not_sm90(monkeypatch):
    backend, lines = logged_d96_call(monkeypatch, heads=4)
    assert backend == "FlashAttention"
    assert any("FlashAttention kernel family = sm80 (not sm90: it has head dim 64, 128 and "
               "256 kernels only)" in line for line in lines), lines


def test_requested_sm90_family_declines_with_a_reason(monkeypatch):
    """TRANSFORMER_FA_FLASH_FAMILY=sm90 on a call the sm90 kernels do not serve: FlashAttention
    is declined with the reason and the next backend runs."""
    monkeypatch.setenv("TRANSFORMER_FA_FLASH_FAMILY", "sm90")
    backend, lines = logged_d96_call(monkeypatch, heads=2)
    assert backend == "UnfusedDotProductAttention"
    assert any("Disabling FlashAttention as TRANSFORMER_FA_FLASH_FAMILY=sm90 and the sm90 "
               "kernels do not serve this call: it has head dim 64, 128 and 256 kernels "
               "only" in line for line in lines), lines


def test_auto_family_prefers_the_faster_family_at_d256():
    """At d256 the sm90 kernel trails sm80 on short rows (measured): the default takes sm80
    there and says why; a requested sm90 still runs sm90."""
    short_causal = (256, 1024, 1024, False, -1, 0, False, False, False)
    family, why = EXT.fwd_family(ARCH, True, *short_causal)
    assert family == "sm80" and "faster at head dim 256" in why, (family, why)
    assert EXT.fwd_family(ARCH, True, *short_causal, 90)[0] == "sm90"
    long_causal = (256, 4096, 4096, False, -1, 0, False, False, False)
    assert EXT.fwd_family(ARCH, True, *long_causal)[0] == "sm90"
    assert EXT.fwd_family(ARCH, True, 256, 1024, 1024, False, -1, -1, False, False,
                          False)[0] == "sm90"
