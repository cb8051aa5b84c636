"""FlashAttention's sm90 kernel family (csrc/flash/sm90/: wgmma, TMA, warp specialization) on
an sm_90 GPU: its forward against float64 math (dense and varlen, causal masks of both
diagonals, sliding windows), the family choice (what it serves, what it declines, the debug
log), and the backward of an sm90 forward.

Error rule per case, for O and for the LSE: max |ours - float64| <= 2 x max |the same math in
the input dtype - float64| + 1e-3 (relative to the reference's magnitude; attention_cases.check
with a float64 reference). Outputs are allocated over NaN-poisoned memory, so an element the
kernel does not write fails. Query rows that keep no key have O = 0 and LSE = +inf exactly.
Skipped without an sm_90 GPU or without the family in the build.
"""
import json
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the sm90 kernels need CUDA", allow_module_level=True)

from transformer_fa.attention.backends import flash  # noqa: E402

if not flash.is_built() or flash._extension() is None:
    pytest.skip("transformer_fa_flash is not built", allow_module_level=True)

from attention_cases import DEV, capture_log, check, cu_seqlens  # noqa: E402

EXT = flash._extension()
CC = torch.cuda.get_device_capability()
ARCH = CC[0] * 10 + CC[1]
# Any of the three head dims: a reduced build (TRANSFORMER_FA_FLASH_KERNELS=sm90_bf16_hdim64)
# runs the file too, and its cases at head dims that build lacks fail with the selection's
# error (before 2026-12-02 a build without the d128 kernel skipped the whole file).
if ARCH != 90 or not any(EXT.fwd_family(90, True, d, d, d, False, -1, -1, False, False,
                                        False)[0] == "sm90" for d in (64, 128, 256)):
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


def reference(q, k, v, causal, scale, dtype, bottom_right=False, window=None):
    """(out [b, sq, h, d], lse [b, h, sq]) of bshd q, k, v in `dtype` math (float64 for the
    reference, the input dtype for the error baseline). window = (left, right), TE's (default:
    (-1, 0) if causal, else (-1, -1)): query i keeps keys i + off - left <= j <= i + off + right
    (a bound of -1: none), off = sk - sq if bottom_right else 0. Rows that keep no key: O = 0,
    LSE = +inf (the kernels' values)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    left, right = window if window is not None else ((-1, 0) if causal else (-1, -1))
    sq, sk = q.shape[1], k.shape[1]
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    off = sk - sq if bottom_right else 0
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        keep &= j >= i + off - left
    if right >= 0:
        keep &= j <= i + off + right
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s.double(), dim=-1)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    p = torch.softmax(s.double(), dim=-1)
    if not keep.any(-1).all():
        p = p.nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p.to(dtype), v), lse


def check_lse(name, lse, ref, base):
    """+inf exactly on the rows that keep no key; the rule on the others."""
    inf = torch.isinf(ref)
    assert torch.equal(torch.isposinf(lse), inf), f"{name}: +inf must mark the rows with no key"
    check(name, lse[~inf].double(), ref[~inf], base[~inf], 1e-3)


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
    check_case(name, mask, dtype, d)


# The short-row tiles (d128 unmasked on 128 x 128; d64 causal on 64 x 128, one consumer
# warpgroup, two CTAs an SM; d256 on 128 x 64) run up to a length (fwd_launch.cuh's
# short_rows), the other tiles (128 x 176, 192 x 128, 128 x 80) above it:
# TRANSFORMER_FA_SM90_SHORT_TILES=0 / 1 forces either, so both meet every case.
TILE_CASES = [(128, "no_mask"), (64, "causal"), (64, "causal_bottom_right"),
              (256, "no_mask"), (256, "causal"), (256, "causal_bottom_right")]
TILES = {"long_tiles": "0", "short_tiles": "1"}


@pytest.mark.parametrize("tiles", sorted(TILES))
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("d, mask", TILE_CASES, ids=[f"d{d}-{m}" for d, m in TILE_CASES])
def test_forward_tiles_both_ways(monkeypatch, tiles, name, d, mask):
    monkeypatch.setenv("TRANSFORMER_FA_SM90_SHORT_TILES", TILES[tiles])
    check_case(name, mask, torch.bfloat16, d)


# How the sm90 forward hands tiles to CTAs (fwd_launch.cuh's fwd_scheduler): one CTA per tile
# ("grid"), a persistent grid in the static snake order ("static"), or one whose CTAs claim
# tiles from a counter ("dynamic"); TRANSFORMER_FA_SM90_SCHEDULER forces each (the tests above
# run the default). Head dims 64, 128 and 256 (every tile stores O from registers; d256's run
# every scheduler too since 2026-12-01). Every case of CASES: grids that loop (more tiles
# than SMs), tails, sq != sk, GQA.
SCHEDULERS = ["dynamic", "grid", "static"]
SCHEDULER_DIMS = [64, 128, 256]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("d", SCHEDULER_DIMS, ids=[f"d{d}" for d in SCHEDULER_DIMS])
def test_forward_schedulers(monkeypatch, scheduler, name, mask, d):
    monkeypatch.setenv("TRANSFORMER_FA_SM90_SCHEDULER", scheduler)
    check_case(name, mask, torch.bfloat16, d, sm80=False)


def fwd_launches(fn, tmp_path):
    """(grid size of each sm90 forward kernel that fn() launches, memsets it runs), from the
    profiler's trace (the kernels' grids are there only)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    grids = [e["args"]["grid"][0] for e in events
             if e.get("cat") == "kernel" and "sm90::fwd_kernel" in e.get("name", "")]
    return grids, sum(e.get("cat") == "gpu_memset" for e in events)


def test_scheduler_switch_reaches_the_launch(monkeypatch, tmp_path):
    """Each forced scheduler launches its grid (one CTA per tile, or one per SM) and only the
    dynamic one zeroes its counter first, at d128 and at d256 (O stored from registers) alike;
    unset or an unknown value is the default (dynamic for causal calls).
    Every order computes each tile alike, so O and the LSE agree bit for bit."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    b, s, h = 8, 1024, 16  # 8 x 16 x 8 = 1024 tiles of 128 rows (d128 causal, d256 causal)
    tiles = b * h * s // 128
    expected = {None: (sms, 1), "bogus": (sms, 1), "grid": (tiles, 0), "static": (sms, 0),
                "dynamic": (sms, 1)}
    for d in (128, 256):
        q, k, v = make_qkv(b, s, s, h, h, torch.bfloat16, "bshd", d=d)
        results = {}
        for scheduler, (grid, memsets) in expected.items():
            if scheduler is None:
                monkeypatch.delenv("TRANSFORMER_FA_SM90_SCHEDULER", raising=False)
            else:
                monkeypatch.setenv("TRANSFORMER_FA_SM90_SCHEDULER", scheduler)

            def call(scheduler=scheduler):
                results[scheduler] = run_fwd(q, k, v, "bshd", True, family=90)

            call()  # the first call loads the module
            assert fwd_launches(call, tmp_path) == ([grid], memsets), (d, scheduler)
        for scheduler, (out, lse) in results.items():
            assert torch.equal(out, results[None][0]), (d, scheduler)
            assert torch.equal(lse, results[None][1]), (d, scheduler)


def check_case(name, mask, dtype, d, sm80=True):
    """CASES[name] with MASKS[mask] on the sm90 forward (family 90: an error if it declined
    the call) against float64; the sm80 family on the same call obeys the same rule (unless
    sm80 is False)."""
    b, sq, sk, h, hkv, layout, gain = CASES[name]
    causal, bottom_right = MASKS[mask]
    if bottom_right and sq == sk:
        pytest.skip("the same mask as top-left causal")
    q, k, v = make_qkv(b, sq, sk, h, hkv, dtype, layout, gain, d=d)
    out, lse = run_fwd(q, k, v, layout, causal, family=90, bottom_right=bottom_right)
    qb, kb, vb = (to_bshd(x, layout) for x in (q, k, v))
    scale = 1 / math.sqrt(d)
    ref, ref_lse = reference(qb, kb, vb, causal, scale, torch.float64, bottom_right)
    base, base_lse = reference(qb, kb, vb, causal, scale, dtype, bottom_right)
    check(f"{name} out", to_bshd(out, layout).double(), ref, base.double(), 1e-3)
    check_lse(f"{name} lse", lse, ref_lse, base_lse)
    if not sm80:
        return
    # the sm80 family on the same call obeys the same rule (and so agrees with sm90)
    out80, _ = run_fwd(q, k, v, layout, causal, family=80, bottom_right=bottom_right)
    check(f"{name} sm80 out", to_bshd(out80, layout).double(), ref, base.double(), 1e-3)


# Head dims that are not a kernel's (multiples of 8 up to 256) run on the next kernel up (64,
# 128 or 256): TMA zero-fills the columns past d and the epilogue stores none of them (a store
# past d would land in the next head's or row's columns and fail the check there).
OTHER_DIMS = [8, 40, 80, 96, 136, 160, 200, 248]
OTHER_DIM_CASES = ["tail-b2-s200-h4", "gqa-b2-s512-h8-hkv2", "sbhd-b3-s256-h4-hkv2",
                   "packed-tail-b2-s333-h2", "cross-b2-sq300-sk700-h4-hkv2"]


@pytest.mark.parametrize("name", OTHER_DIM_CASES)
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("d", OTHER_DIMS, ids=[f"d{d}" for d in OTHER_DIMS])
def test_other_head_dims_match_float64(name, mask, d):
    check_case(name, mask, torch.bfloat16, d)


@pytest.mark.parametrize("d", [40, 96, 200], ids=["d40", "d96", "d200"])
@pytest.mark.parametrize("fmt", ["thd", "bshd"])
def test_varlen_other_head_dims_match_float64(d, fmt):
    for case in sorted(VARLEN):
        for mask in ("no_mask", "causal"):
            test_varlen_matches_float64(case, mask, fmt, torch.float16, d)


def test_auto_family_for_other_head_dims():
    """Every head dim runs on sm90 by default, at every length (measured faster than sm80:
    d <= 128 on the same padded kernel head dim, 128 < d <= 192 on the d256 kernel against
    sm80's d192 one, d256)."""
    def family(d, s, causal=False):
        return EXT.fwd_family(ARCH, True, d, s, s, False, -1, 0 if causal else -1, False, False,
                              False)

    assert family(96, 1024) == ["sm90", ""]
    assert family(40, 512, causal=True) == ["sm90", ""]
    assert family(160, 4096) == ["sm90", ""]
    assert family(192, 512, causal=True) == ["sm90", ""]
    assert family(200, 4096) == ["sm90", ""]
    assert family(256, 512, causal=True) == ["sm90", ""]
    assert EXT.fwd_family(ARCH, True, 160, 4096, 4096, False, -1, -1, False, False, False,
                          90) == ["sm90", ""]  # a requested sm90 runs anyway


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
    "no keys": ((128, 256, 0, False, -1, -1, False, False, False), "at least one key"),
    "alibi": ((128, 256, 256, False, -1, 0, False, True, False), "ALiBi"),
    "dropout": ((128, 256, 256, False, -1, -1, False, False, True), "dropout"),
}
# What the sm90 forward serves since 2026-11 (ran on sm80 before): varlen, windows and
# bottom-right causal with sq > sk.
SERVED = {
    "varlen": (128, 256, 256, True, -1, -1, False, False, False),
    "varlen causal": (64, 300, 200, True, -1, 0, True, False, False),
    "window": (128, 256, 256, False, 64, 0, False, False, False),
    "right window": (64, 256, 256, False, -1, 32, False, False, False),
    "varlen window": (128, 256, 512, True, 100, 20, True, False, False),
    "bottom-right sq > sk": (128, 384, 256, False, -1, 0, True, False, False),
}


@pytest.mark.parametrize("name", sorted(SERVED))
def test_varlen_and_windows_run_on_sm90(name):
    assert EXT.fwd_family(ARCH, True, *SERVED[name]) == ["sm90", ""]
    assert EXT.fwd_family(ARCH, False, *SERVED[name]) == ["sm90", ""]


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
    q = torch.randn(1, 256, 2, 128, device=DEV, dtype=torch.bfloat16)
    slopes = torch.rand(2, device=DEV)
    with pytest.raises(RuntimeError, match="sm90 family was requested, but it does not take "
                                           "ALiBi"):
        EXT.fwd(q, q, q, None, None, 0, 0, 256, 256, 0.1, -1, -1, False, True, 0.0, None, slopes,
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


def logged_call(monkeypatch, heads, d, alibi=False):
    """A causal bf16 call at head dim d (ALiBi: with TE's default slopes) with FusedAttention
    off and the debug log on: (the backend that ran, the log lines)."""
    import transformer_fa as tfa

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    dpa = tfa.DotProductAttention(heads, d, qkv_format="bshd", attn_mask_type="causal").cuda()
    q = torch.randn(2, 256, heads, d, device=DEV, dtype=torch.bfloat16)
    with capture_log() as lines, torch.no_grad():
        dpa(q, q, q, core_attention_bias_type="alibi" if alibi else "no_bias")
    return dpa.last_backend, lines


def test_debug_log_names_the_family_and_why_not_sm90(monkeypatch):
    # ALiBi: the sm80 family serves it, the sm90 one does not
    backend, lines = logged_call(monkeypatch, heads=4, d=128, alibi=True)
    assert backend == "FlashAttention"
    assert any("FlashAttention kernel family = sm80 (not sm90: it does not take ALiBi" in line
               for line in lines), lines


def test_requested_sm90_family_declines_with_a_reason(monkeypatch):
    """TRANSFORMER_FA_FLASH_FAMILY=sm90 on a call the sm90 kernels do not serve (ALiBi):
    FlashAttention is declined with the reason and the next backend runs."""
    monkeypatch.setenv("TRANSFORMER_FA_FLASH_FAMILY", "sm90")
    backend, lines = logged_call(monkeypatch, heads=2, d=128, alibi=True)
    assert backend == "UnfusedDotProductAttention"
    assert any("Disabling FlashAttention as TRANSFORMER_FA_FLASH_FAMILY=sm90 and the sm90 "
               "kernels do not serve this call: it does not take ALiBi" in line
               for line in lines), lines


# ---------------------------------------------------------------------------------------------
# Varlen (cu_seqlens) and sliding windows
# ---------------------------------------------------------------------------------------------
THD = 2
FORMATS = {"bshd": BSHD, "sbhd": SBHD, "thd": THD}
# (lens_q, lens_k, h, hkv). Lengths around the tiles (64, 128, 192 query rows; 80 or 128 keys),
# so that thd query tiles start inside a sequence and read the next one's rows through TMA
# (never stored), and key tiles reach past a sequence (masked, V rows zeroed); empty
# sequences: no queries (nothing written), no keys (O = 0, LSE = +inf).
VARLEN = {
    "ragged": ([1, 63, 64, 65, 127, 200, 0, 5, 129], [1, 63, 64, 65, 127, 200, 9, 0, 81], 4, 2),
    "cross": ([300, 17, 129, 1], [70, 260, 129, 400], 4, 4),
    # 8 sequences x 8 heads x 6-8 tiles: the persistent grid's CTAs take several tiles,
    # empty tiles (short sequences) among them
    "loops": ([1000, 3, 700, 1000, 64, 999, 250, 1000], [1000, 5, 700, 1200, 64, 999, 1, 800],
              8, 2),
}
# (window_left, window_right, bottom_right)
WINDOWS = {
    "no_mask": (-1, -1, False),
    "causal": (-1, 0, False),
    "causal_bottom_right": (-1, 0, True),
    "left": (100, -1, False),
    "right": (-1, 40, False),
    "both": (48, 16, False),
    "both_bottom_right": (70, 3, True),
    "causal_left": (64, 0, False),
    "causal_left_bottom_right": (130, 0, True),
}


def varlen_inputs(lens_q, lens_k, h, hkv, d, dtype, fmt, seed=0):
    """q, k, v in fmt with cu_seqlens: thd packs the sequences with 3 tokens past the last one,
    bshd / sbhd pad every sequence (3 rows past the longest). Rows that belong to no sequence
    are NaN: a kernel must neither read them into a sequence's output nor write them."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    b = len(lens_q)
    out = []
    for lens, heads in ((lens_q, h), (lens_k, hkv), (lens_k, hkv)):
        if fmt == "thd":
            x = torch.randn(sum(lens) + 3, heads, d, generator=gen, device=DEV).to(dtype)
            x[sum(lens):] = float("nan")
        else:
            x = torch.randn(b, max(lens) + 3, heads, d, generator=gen, device=DEV).to(dtype)
            for i, n in enumerate(lens):
                x[i, n:] = float("nan")
            if fmt == "sbhd":
                x = x.transpose(0, 1).contiguous()
        out.append(x)
    return out


def sequence(x, fmt, lens, i):
    """Sequence i's rows of x (in fmt) as [1, len, h, d]."""
    if fmt == "thd":
        start = sum(lens[:i])
        return x[start:start + lens[i]][None]
    return (x[:, i] if fmt == "sbhd" else x[i])[:lens[i]][None]


def run_varlen(q, k, v, fmt, lens_q, lens_k, window, bottom_right, family):
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    if fmt == "thd":
        sq, sk = max(lens_q), max(lens_k)
    else:
        sq, sk = (q.shape[0], k.shape[0]) if fmt == "sbhd" else (q.shape[1], k.shape[1])
    poison()
    return EXT.fwd(q, k, v, cu_q, cu_k, FORMATS[fmt], FORMATS[fmt], sq, sk,
                   1 / math.sqrt(q.shape[-1]), window[0], window[1], bottom_right, True, 0.0,
                   None, None, family)


def check_varlen(name, q, k, v, out, lse, fmt, lens_q, lens_k, window, bottom_right):
    """Each sequence against float64; rows that belong to no sequence: thd out 0 / LSE +inf
    (the binding's fill), padding rows O = 0 and LSE = +inf (the kernel's, as from sm80)."""
    dtype, d = q.dtype, q.shape[-1]
    scale = 1 / math.sqrt(d)
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0:
            continue
        qs, ks, vs = (sequence(x, fmt, lens, i) for x, lens in ((q, lens_q), (k, lens_k),
                                                                  (v, lens_k)))
        ref, ref_lse = reference(qs, ks, vs, False, scale, torch.float64, bottom_right, window)
        base, base_lse = reference(qs, ks, vs, False, scale, dtype, bottom_right, window)
        o = sequence(out, fmt, lens_q, i)
        if fmt == "thd":
            start = sum(lens_q[:i])
            ls = lse[:, start:start + nq][None]
        else:
            ls = lse[i:i + 1, :, :nq]
        check(f"{name} seq {i} out", o.double(), ref, base.double(), 1e-3)
        check_lse(f"{name} seq {i} lse", ls, ref_lse, base_lse)
    if fmt == "thd":
        rest = slice(sum(lens_q), None)
        assert (out[rest] == 0).all() and torch.isposinf(lse[:, rest]).all(), name
    else:
        outp = out.transpose(0, 1) if fmt == "sbhd" else out
        for i, nq in enumerate(lens_q):
            assert (outp[i, nq:] == 0).all(), f"{name}: padding rows of seq {i} must be 0"
            assert torch.isposinf(lse[i, :, nq:]).all(), f"{name}: padding LSE of seq {i}"


@pytest.mark.parametrize("case", sorted(VARLEN))
@pytest.mark.parametrize("mask", sorted(WINDOWS))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_varlen_matches_float64(case, mask, fmt, dtype, d):
    """Varlen on the sm90 forward (family 90: an error if it declined the call), against
    float64 per sequence; the sm80 forward obeys the same rule and marks the same rows."""
    lens_q, lens_k, h, hkv = VARLEN[case]
    left, right, bottom_right = WINDOWS[mask]
    q, k, v = varlen_inputs(lens_q, lens_k, h, hkv, d, dtype, fmt)
    out, lse = run_varlen(q, k, v, fmt, lens_q, lens_k, (left, right), bottom_right, family=90)
    check_varlen(f"{case} {mask} {fmt}", q, k, v, out, lse, fmt, lens_q, lens_k, (left, right),
                 bottom_right)
    out80, lse80 = run_varlen(q, k, v, fmt, lens_q, lens_k, (left, right), bottom_right,
                              family=80)
    assert torch.equal(torch.isposinf(lse80), torch.isposinf(lse))
    check_varlen(f"{case} {mask} {fmt} sm80", q, k, v, out80, lse80, fmt, lens_q, lens_k,
                 (left, right), bottom_right)


@pytest.mark.parametrize("tiles", sorted(TILES))
@pytest.mark.parametrize("case", sorted(VARLEN))
@pytest.mark.parametrize("d, mask", TILE_CASES, ids=[f"d{d}-{m}" for d, m in TILE_CASES])
def test_varlen_tiles_both_ways(monkeypatch, tiles, case, d, mask):
    """Varlen thd on each tile of the cases that have two (TILE_CASES)."""
    monkeypatch.setenv("TRANSFORMER_FA_SM90_SHORT_TILES", TILES[tiles])
    check_varlen_thd(case, mask, d, tiles)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("case", sorted(VARLEN))
@pytest.mark.parametrize("mask", sorted(WINDOWS))
@pytest.mark.parametrize("d", SCHEDULER_DIMS, ids=[f"d{d}" for d in SCHEDULER_DIMS])
def test_varlen_schedulers(monkeypatch, scheduler, case, mask, d):
    """Varlen thd under each scheduler (SCHEDULERS): empty sequences and tiles with no key
    block among loaded ones ("loops": more tiles than SMs), every mask and window."""
    monkeypatch.setenv("TRANSFORMER_FA_SM90_SCHEDULER", scheduler)
    check_varlen_thd(case, mask, d, scheduler)


def check_varlen_thd(case, mask, d, label):
    """VARLEN[case] packed (thd, bf16) with WINDOWS[mask] on the sm90 forward, per sequence
    against float64."""
    lens_q, lens_k, h, hkv = VARLEN[case]
    left, right, bottom_right = WINDOWS[mask]
    q, k, v = varlen_inputs(lens_q, lens_k, h, hkv, d, torch.bfloat16, "thd")
    out, lse = run_varlen(q, k, v, "thd", lens_q, lens_k, (left, right), bottom_right, family=90)
    check_varlen(f"{case} {mask} {label}", q, k, v, out, lse, "thd", lens_q, lens_k,
                 (left, right), bottom_right)


@pytest.mark.parametrize("mask", sorted(WINDOWS))
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
def test_windows_dense_matches_float64(mask, d):
    """Sliding windows without cu_seqlens (bshd, sq != sk both ways, tails), GQA."""
    left, right, bottom_right = WINDOWS[mask]
    for b, sq, sk in ((2, 333, 333), (2, 200, 517), (3, 517, 200)):
        q, k, v = make_qkv(b, sq, sk, 4, 2, torch.bfloat16, "bshd", d=d)
        poison()
        out, lse = EXT.fwd(q, k, v, None, None, BSHD, BSHD, sq, sk, 1 / math.sqrt(d), left, right,
                           bottom_right, True, 0.0, None, None, 90)
        scale = 1 / math.sqrt(d)
        ref, ref_lse = reference(q, k, v, False, scale, torch.float64, bottom_right, (left, right))
        base, base_lse = reference(q, k, v, False, scale, torch.bfloat16, bottom_right,
                                   (left, right))
        check(f"{mask} {sq}x{sk} out", out.double(), ref, base.double(), 1e-3)
        check_lse(f"{mask} {sq}x{sk} lse", lse, ref_lse, base_lse)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("mask", sorted(WINDOWS))
@pytest.mark.parametrize("d", SCHEDULER_DIMS, ids=[f"d{d}" for d in SCHEDULER_DIMS])
def test_windows_dense_schedulers(monkeypatch, scheduler, mask, d):
    """Dense sliding windows under each scheduler (SCHEDULERS)."""
    monkeypatch.setenv("TRANSFORMER_FA_SM90_SCHEDULER", scheduler)
    test_windows_dense_matches_float64(mask, d)


def test_varlen_auto_family_is_sm90():
    """The default family runs varlen on sm90 (bitwise the forced sm90's output)."""
    lens = [300, 17, 129, 1]
    q, k, v = varlen_inputs(lens, lens, 4, 2, 128, torch.bfloat16, "thd", seed=5)
    auto, _ = run_varlen(q, k, v, "thd", lens, lens, (-1, 0), False, family=0)
    sm90, _ = run_varlen(q, k, v, "thd", lens, lens, (-1, 0), False, family=90)
    assert torch.equal(auto, sm90)


@pytest.mark.parametrize("window", [(-1, 0), (48, 0)], ids=["causal", "causal_left"])
def test_thd_training_step_sm90_forward(monkeypatch, window):
    """Through DotProductAttention (thd, padding_causal; FlashAttention selected): the sm90
    forward's O and LSE feed the backward (sm90's for causal, sm80's with the window);
    gradients obey the rule against float64 autograd per sequence."""
    import transformer_fa as tfa

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    lens, h = [200, 1, 65, 127, 300], 4
    q, k, v = (torch.nan_to_num(x) for x in varlen_inputs(lens, lens, h, h, D, torch.bfloat16,
                                                         "thd", seed=9))
    cu = cu_seqlens(lens)
    dpa = tfa.DotProductAttention(h, D, qkv_format="thd", attn_mask_type="padding_causal",
                                  window_size=window).cuda()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with capture_log() as lines:
        out = dpa(*leaves, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                  max_seqlen_kv=max(lens))
        gen = torch.Generator(device=DEV).manual_seed(11)
        dout = torch.randn(out.shape, generator=gen, device=DEV).to(out.dtype)
        grads = torch.autograd.grad(out, leaves, dout)
    assert dpa.last_backend == "FlashAttention"
    assert any("FlashAttention forward kernel family = sm90" in line for line in lines), lines
    scale = 1 / math.sqrt(D)
    for i, n in enumerate(lens):
        rows = slice(sum(lens[:i]), sum(lens[:i]) + n)
        results = {}
        for dtype in (torch.float64, torch.bfloat16):
            seq = [x[rows][None].detach().to(dtype).requires_grad_() for x in (q, k, v)]
            ref, _ = reference(*seq, True, scale, dtype, window=window)
            g = torch.autograd.grad(ref, seq, dout[rows].view(1, n, h, D).to(dtype))
            results[dtype] = (ref, g)
        (ref, ref_grads), (base, base_grads) = results[torch.float64], results[torch.bfloat16]
        check(f"seq {i} out", out[rows].view(1, n, h, D).double(), ref, base.double(), 1e-3)
        for name, g, r, bg in zip("qkv", grads, ref_grads, base_grads):
            check(f"seq {i} d{name}", g[rows][None].double(), r, bg.double(), 1e-3)
