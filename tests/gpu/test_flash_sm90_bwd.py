"""FlashAttention's sm90 backward (csrc/flash/sm90/bwd_*: TMA, wgmma, warp specialization) on
an sm_90 GPU, forced with the binding's family argument (TRANSFORMER_FA_FLASH_BWD_FAMILY=sm90
in Python): dq, dk, dv against float64 autograd (bshd, sbhd, packed bs3hd, and varlen: thd
and padded bshd; MHA, GQA and MQA; no mask, causal and sliding windows of both diagonal
alignments; deterministic mode: bitwise the same gradients run after run), what it declines
and the error when it is forced on such a call, and training steps through
DotProductAttention. Head dims 64, 128 and 256: d256 (and 129-255) run on the d256 kernel
(bwd_kernel_d256.cuh), which `auto` takes as well (test_auto_runs_the_d256_backward_on_sm90).

Error rule per gradient: max |ours - float64| <= 2 x max |the same math in the input dtype -
float64| + 1e-3 (relative to the reference's magnitude; attention_cases.check). The gradients
are allocated over NaN-poisoned memory, so an element the kernels do not write fails.
Skipped without an sm_90 GPU or without the family's backward in the build.
"""
import math

import pytest
import torch

from attention_cases import DEV, capture_log, check
# (skips this module without CUDA, the extension or the sm90 family, as it skips its own)
from test_flash_sm90 import ARCH, BSHD, EXT, SBHD, make_qkv, poison, to_bshd

# (arch, bf16, d, sq, sk, varlen, window_left, window_right, bottom_right, alibi, dropout, gqa,
#  deterministic, family) of a call the sm90 backward serves
SERVED = (90, True, 128, 256, 256, False, -1, 0, False, False, False, False, False)
# (any of the three head dims, as test_flash_sm90's check: a reduced build runs the file)
if ARCH != 90 or not hasattr(EXT, "bwd_family") or not any(
        EXT.bwd_family(SERVED[0], SERVED[1], d, *SERVED[3:], 90)[0] == "sm90"
        for d in (64, 128, 256)):
    pytest.skip("needs an sm_90 GPU and a build with the sm90 backward", allow_module_level=True)


def reference_grads(q, k, v, dout, causal, bottom_right, scale, dtype, window=None):
    """(dq, dk, dv) of bshd q, k, v in `dtype` math (float64: the reference; the input dtype:
    the error baseline). GQA / MQA: each KV head serves h / h_k consecutive query heads (its
    dk / dv: the sum over them, by autograd through the expansion). window = (left, right),
    TE's (default: (-1, 0) if causal, else (-1, -1)): query i sees keys
    i + off - left <= j <= i + off + right (a bound of -1: none), off = sk - sq if bottom_right
    else 0; a query row without any key has P = 0 (the kernels' LSE is +inf there)."""
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    ql, kl, vl = leaves
    group = ql.shape[2] // kl.shape[2]
    kl, vl = kl.repeat_interleave(group, dim=2), vl.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", ql, kl) * scale
    sq, sk = ql.shape[1], kl.shape[1]
    left, right = window if window is not None else (-1, 0 if causal else -1)
    off = sk - sq if bottom_right else 0
    i = torch.arange(sq, device=DEV)[:, None]
    j = torch.arange(sk, device=DEV)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=DEV)
    if right >= 0:
        keep &= j <= i + off + right
    if left >= 0:
        keep &= j >= i + off - left
    has_key = keep.any(-1, keepdim=True)
    s = s.masked_fill(~keep, float("-inf")).masked_fill(~has_key, 0.0)
    p = torch.softmax(s, dim=-1) * has_key
    out = torch.einsum("bhqk,bkhd->bqhd", p, vl)
    return torch.autograd.grad(out, leaves, dout.to(dtype))


def run_fwd_bwd(q, k, v, dout, layout, causal, bottom_right, family, deterministic=False,
                window_left=-1, window=None):
    """The binding's forward (its default family) and backward (`family`): (dq, dk, dv).
    window = (left, right) overrides causal and window_left."""
    fmt = SBHD if layout == "sbhd" else BSHD
    sq, sk = (q.shape[0], k.shape[0]) if layout == "sbhd" else (q.shape[1], k.shape[1])
    scale = 1 / math.sqrt(q.shape[-1])
    right = 0 if causal else -1
    if window is not None:
        window_left, right = window
    out, lse = EXT.fwd(q, k, v, None, None, fmt, fmt, sq, sk, scale, window_left, right,
                       bottom_right, True, 0.0, None, None, 0)
    poison()
    return EXT.bwd(dout, q, k, v, out, lse, None, None, fmt, fmt, sq, sk, scale, window_left,
                   right, bottom_right, 0.0, None, None, deterministic, None, family)


# (b, sq, sk, h, layout, input gain): ragged lengths that are no multiple of the tiles (1, 17,
# 113, 257, 1000; the key and query tails), the layouts' strides (sbhd, packed bs3hd), sq != sk
# both ways (bottom-right with sq > sk: query rows without any key), a sharper softmax.
CASES = {
    "s1-b3-h2": (3, 1, 1, 2, "bshd", 1.0),
    "s17-b2-h2": (2, 17, 17, 2, "bshd", 1.0),
    "sbhd-s113-b2-h4": (2, 113, 113, 4, "sbhd", 1.0),
    "s257-b2-h4": (2, 257, 257, 4, "bshd", 1.0),
    "s1000-b1-h4": (1, 1000, 1000, 4, "bshd", 1.0),
    "packed-bs3hd-s257-b2-h2": (2, 257, 257, 2, "bs3hd", 1.0),
    "sharp-s257-b2-h2": (2, 257, 257, 2, "bshd", 4.0),
    "cross-sq113-sk1000-b2-h2": (2, 113, 1000, 2, "bshd", 1.0),
    "cross-sq1000-sk257-b2-h2": (2, 1000, 257, 2, "bshd", 1.0),
    "cross-sbhd-sq17-sk1-b2-h2": (2, 17, 1, 2, "sbhd", 1.0),
}
MASKS = {"no_mask": (False, False), "causal": (True, False), "causal_bottom_right": (True, True)}
# The kernels' head dims (the tests here request the sm90 backward: family 90). Deterministic
# mode: d64 and d128 only (the d256 kernel declines it).
DIMS = [64, 128, 256]
DIM_IDS = [f"d{d}" for d in DIMS]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", DIMS, ids=DIM_IDS)
def test_backward_matches_float64(name, mask, dtype, d):
    b, sq, sk, h, layout, gain = CASES[name]
    causal, bottom_right = MASKS[mask]
    if bottom_right and sq == sk:
        pytest.skip("the same mask as top-left causal")
    q, k, v = make_qkv(b, sq, sk, h, h, dtype, layout, gain, d=d)
    check_grads(name, q, k, v, layout, causal, bottom_right)


def check_grads(tag, q, k, v, layout, causal, bottom_right, window=None):
    """q, k, v through the binding's forward and the sm90 backward (family 90: an error if it
    declines the call): dq, dk, dv against float64 by the rule (the input dtype's math as the
    baseline). window = (left, right) overrides causal."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    dout = torch.randn(q.shape, generator=gen, device=DEV).to(q.dtype)
    grads = run_fwd_bwd(q, k, v, dout, layout, causal, bottom_right, family=90, window=window)
    qb, kb, vb, dob = (to_bshd(x, layout) for x in (q, k, v, dout))
    scale = 1 / math.sqrt(q.shape[-1])
    ref = reference_grads(qb, kb, vb, dob, causal, bottom_right, scale, torch.float64, window)
    base = reference_grads(qb, kb, vb, dob, causal, bottom_right, scale, q.dtype, window)
    for which, g, r, bg in zip("qkv", grads, ref, base):
        check(f"{tag} d{which}", to_bshd(g, layout).double(), r, bg.double(), 1e-3)


# Head dims below a kernel's (multiples of 8 up to 256) on the d64, d128 or d256 kernel: TMA
# zero-fills the columns past d; dK / dV store none of them, dQ's conversion writes d columns.
OTHER_DIMS = [8, 40, 96, 120, 160, 200]


@pytest.mark.parametrize("name", ["s257-b2-h4", "sbhd-s113-b2-h4", "cross-sq113-sk1000-b2-h2"])
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("d", OTHER_DIMS, ids=[f"d{d}" for d in OTHER_DIMS])
def test_other_head_dims_backward_matches_float64(name, mask, d):
    b, sq, sk, h, layout, gain = CASES[name]
    causal, bottom_right = MASKS[mask]
    if bottom_right and sq == sk:
        pytest.skip("the same mask as top-left causal")
    q, k, v = make_qkv(b, sq, sk, h, h, torch.bfloat16, layout, gain, d=d)
    check_grads(f"{name} d={d}", q, k, v, layout, causal, bottom_right)


# GQA (8 query heads on 2 KV heads) and MQA (on 1): (b, sq, sk, layout) with ragged lengths,
# sq != sk both ways, sbhd strides, and k / v as views of a fused [b, s, h + 2 h_k, d]
# projection (row stride (h + 2 h_k) d).
GQA_CASES = {
    "s1-b3": (3, 1, 1, "bshd"),
    "s257-b2": (2, 257, 257, "bshd"),
    "sbhd-s113-b2": (2, 113, 113, "sbhd"),
    "fused-s300-b2": (2, 300, 300, "fused"),
    "cross-sq113-sk1000-b1": (1, 113, 1000, "bshd"),
    "cross-sq1000-sk257-b1": (1, 1000, 257, "bshd"),
}
GROUPS = {"gqa-h8-hkv2": (8, 2), "mqa-h8-hkv1": (8, 1)}


def make_gqa_qkv(b, sq, sk, h, hkv, dtype, layout, d, seed=0):
    """make_qkv's layouts, and "fused": q, k, v split from one [b, s, h + 2 h_k, d] tensor."""
    if layout != "fused":
        return make_qkv(b, sq, sk, h, hkv, dtype, layout, seed=seed, d=d)
    assert sq == sk
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(b, sq, h + 2 * hkv, d, generator=gen, device=DEV).to(dtype)
    return x.split([h, hkv, hkv], dim=2)


@pytest.mark.parametrize("name", sorted(GQA_CASES))
@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", DIMS, ids=DIM_IDS)
def test_gqa_backward_matches_float64(name, group, mask, dtype, d):
    """dk / dv summed over each KV head's query heads (float32 reductions, then converted)."""
    b, sq, sk, layout = GQA_CASES[name]
    h, hkv = GROUPS[group]
    causal, bottom_right = MASKS[mask]
    if bottom_right and sq == sk:
        pytest.skip("the same mask as top-left causal")
    q, k, v = make_gqa_qkv(b, sq, sk, h, hkv, dtype, layout, d)
    check_grads(f"{name} {group}", q, k, v, layout, causal, bottom_right)


# Sliding windows (left, right), TE's: with the causal bound, left or right alone, both, a
# window of the diagonal only, and one wider than the tiles on both sides.
WINDOWS = {"causal-left64": (64, 0), "left100": (100, -1), "right37": (-1, 37),
           "left48-right16": (48, 16), "diagonal": (0, 0), "left300-right200": (300, 200)}
WINDOW_CASES = ("s257-b2-h4", "s1000-b1-h4", "sbhd-s113-b2-h4", "cross-sq113-sk1000-b2-h2",
                "cross-sq1000-sk257-b2-h2")


@pytest.mark.parametrize("name", WINDOW_CASES)
@pytest.mark.parametrize("window", sorted(WINDOWS))
@pytest.mark.parametrize("bottom_right", [False, True], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", DIMS, ids=DIM_IDS)
def test_window_backward_matches_float64(name, window, bottom_right, dtype, d):
    """Sliding windows: each key block's query blocks from the band, the blocks it cuts
    masked (ragged tails, sq != sk both ways: rows without any key, key blocks no query sees,
    whose dK / dV are zeros)."""
    b, sq, sk, h, layout, gain = CASES[name]
    if bottom_right and sq == sk:
        pytest.skip("the same mask as top-left")
    q, k, v = make_qkv(b, sq, sk, h, h, dtype, layout, gain, d=d)
    check_grads(f"{name} {window}", q, k, v, layout, False, bottom_right, WINDOWS[window])


@pytest.mark.parametrize("name", ["s257-b2", "cross-sq113-sk1000-b1", "cross-sq1000-sk257-b1"])
@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("window", sorted(WINDOWS))
@pytest.mark.parametrize("bottom_right", [False, True], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("d", DIMS, ids=DIM_IDS)
def test_gqa_window_backward_matches_float64(name, group, window, bottom_right, d):
    """GQA / MQA with sliding windows (bf16): the dK / dV reductions of key blocks that no
    query of a head sees add zeros."""
    b, sq, sk, layout = GQA_CASES[name]
    h, hkv = GROUPS[group]
    if bottom_right and sq == sk:
        pytest.skip("the same mask as top-left")
    q, k, v = make_gqa_qkv(b, sq, sk, h, hkv, torch.bfloat16, layout, d)
    check_grads(f"{name} {group} {window}", q, k, v, layout, False, bottom_right,
                WINDOWS[window])


THD = 2
# Sequence lengths (query, key) of the varlen cases: ragged, sq != sk both ways, empty-ish.
LENS_Q = [1, 17, 113, 257, 1000, 64]
LENS_K = [17, 1, 257, 113, 300, 64]


def cu_seqlens(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=DEV)


@pytest.mark.parametrize("fmt", ["thd", "bshd-padded"])
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", DIMS, ids=DIM_IDS)
def test_varlen_backward_matches_float64(fmt, mask, dtype, d):
    """cu_seqlens: packed thd tensors (a sequence's tiles reach into the next one's tokens),
    or bshd batch rows padded past each sequence's length (dK / dV padding rows: zeros)."""
    check_varlen(fmt, mask_window(mask), MASKS[mask][1], dtype, d, 2, 2)


@pytest.mark.parametrize("fmt", ["thd", "bshd-padded"])
@pytest.mark.parametrize("window", sorted(WINDOWS))
@pytest.mark.parametrize("bottom_right", [False, True], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("hkv", [2, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", DIMS, ids=DIM_IDS)
def test_varlen_window_backward_matches_float64(fmt, window, bottom_right, hkv, dtype, d):
    """Varlen with sliding windows, MHA (2 heads) and MQA (2 query heads on 1): each
    sequence's band from its own lengths (ragged, sq != sk both ways)."""
    check_varlen(fmt, WINDOWS[window], bottom_right, dtype, d, 2, hkv)


@pytest.mark.parametrize("fmt", ["thd", "bshd-padded"])
@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", DIMS, ids=DIM_IDS)
def test_varlen_gqa_backward_matches_float64(fmt, group, mask, dtype, d):
    """As above with GQA / MQA: a sequence's dk / dv rows get only its own keys' sums (thd: the
    accumulators' rows of the next sequence are untouched by its tiles)."""
    check_varlen(fmt, mask_window(mask), MASKS[mask][1], dtype, d, *GROUPS[group])


def mask_window(mask):
    """The (left, right) window of a MASKS entry."""
    return (-1, 0 if MASKS[mask][0] else -1)


def check_varlen(fmt, window, bottom_right, dtype, d, h, hkv, deterministic=False, runs=1):
    """Varlen backward of `window` against float64 per sequence; with runs > 1, that many
    backwards, whose dq, dk, dv must agree bit for bit."""
    b = len(LENS_Q)
    gen = torch.Generator(device=DEV).manual_seed(5)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=DEV).to(dtype)

    if fmt == "thd":
        q, dout = randn(sum(LENS_Q), h, d), randn(sum(LENS_Q), h, d)
        k, v = randn(sum(LENS_K), hkv, d), randn(sum(LENS_K), hkv, d)
        sq, sk = max(LENS_Q), max(LENS_K)

        def rows(x, lens, i):  # sequence i's rows as [1, len, h, d]
            start = sum(lens[:i])
            return x[start:start + lens[i]].unsqueeze(0)
    else:
        sq, sk = max(LENS_Q) + 8, max(LENS_K) + 8  # padded batch rows
        q, dout = randn(b, sq, h, d), randn(b, sq, h, d)
        k, v = randn(b, sk, hkv, d), randn(b, sk, hkv, d)

        def rows(x, lens, i):
            return x[i:i + 1, :lens[i]]
    code = THD if fmt == "thd" else BSHD
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    scale = 1 / math.sqrt(d)
    left, right = window
    out, lse = EXT.fwd(q, k, v, cu_q, cu_k, code, code, sq, sk, scale, left, right,
                       bottom_right, True, 0.0, None, None, 0)
    poison()
    grads = EXT.bwd(dout, q, k, v, out, lse, cu_q, cu_k, code, code, sq, sk, scale, left, right,
                    bottom_right, 0.0, None, None, deterministic, None, 90)
    for _ in range(runs - 1):
        again = EXT.bwd(dout, q, k, v, out, lse, cu_q, cu_k, code, code, sq, sk, scale, left,
                        right, bottom_right, 0.0, None, None, deterministic, None, 90)
        for which, g, a in zip("qkv", grads, again):
            assert torch.equal(g, a), f"d{which} differs between runs"
    for i in range(b):
        args = [rows(x, lens, i) for x, lens in ((q, LENS_Q), (k, LENS_K), (v, LENS_K),
                                                  (dout, LENS_Q))]
        ref = reference_grads(*args, False, bottom_right, scale, torch.float64, window)
        base = reference_grads(*args, False, bottom_right, scale, dtype, window)
        for which, g, r, bg, lens in zip("qkv", grads, ref, base, (LENS_Q, LENS_K, LENS_K)):
            check(f"sequence {i} d{which}", rows(g, lens, i).double(), r, bg.double(), 1e-3)
    if fmt != "thd":  # the padding rows past each sequence: zeros (no NaN: all written)
        for g, lens in zip(grads, (LENS_Q, LENS_K, LENS_K)):
            for i in range(b):
                assert not g[i, lens[i]:].isnan().any() and not g[i, lens[i]:].any()


def bwd_kernels(fn):
    """The backward kernels (sm80::bwd_kernel / sm90::bwd_kernel) that fn() launches."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {f for f in ("sm80::bwd_kernel", "sm90::bwd_kernel") if any(f in n for n in names)}


def test_auto_runs_the_sm90_backward_where_it_serves():
    """auto (family 0) runs the sm90 backward on a call it serves (measured faster than sm80),
    as a forced sm90 does, with the same dk and dv bits (dQ's reductions run in any order);
    a forced sm80 runs the sm80 kernel. (The results alone could not tell the families apart:
    their dk and dv may agree bit for bit.)"""
    q, k, v = make_qkv(2, 512, 512, 4, 4, torch.bfloat16, "bshd", seed=3)
    dout = torch.randn_like(q)
    grads = {}
    kernels = {}
    for family in (0, 80, 90):
        def call(family=family):
            grads[family] = run_fwd_bwd(q, k, v, dout, "bshd", True, False, family=family)
        call()  # the first call loads the modules
        kernels[family] = bwd_kernels(call)
    assert kernels == {0: {"sm90::bwd_kernel"}, 80: {"sm80::bwd_kernel"},
                       90: {"sm90::bwd_kernel"}}
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1:], grads[90][1:]))
    assert EXT.bwd_family(*SERVED, 0) == ["sm90", ""]
    assert EXT.bwd_family(*SERVED, 80) == ["sm80", "the sm80 family was requested"]


@pytest.mark.parametrize("hkv", [4, 2], ids=["mha", "gqa"])
def test_auto_runs_the_d256_backward_on_sm90(hkv):
    """d256: auto (family 0) runs the sm90 d256 kernel (bwd_kernel_d256; measured faster than
    sm80 at every grid row), in deterministic mode too; a forced sm80 runs sm80. Every result
    obeys the file's rule against float64."""
    q, k, v = make_qkv(2, 512, 512, 4, hkv, torch.bfloat16, "bshd", seed=3, d=256)
    dout = torch.randn_like(q)
    grads = {}
    kernels = {}
    runs = {"auto": (0, False), "sm80": (80, False), "auto-deterministic": (0, True)}
    for name, (family, deterministic) in runs.items():
        def call(name=name, family=family, deterministic=deterministic):
            grads[name] = run_fwd_bwd(q, k, v, dout, "bshd", True, False, family=family,
                                      deterministic=deterministic)
        call()  # the first call loads the modules
        kernels[name] = bwd_kernels(call)
    assert kernels == {"auto": {"sm90::bwd_kernel"}, "sm80": {"sm80::bwd_kernel"},
                       "auto-deterministic": {"sm90::bwd_kernel"}}
    args = (90, True, 256, 512, 512, False, -1, 0, False, False, False, hkv != 4)
    assert EXT.bwd_family(*args, False, 0) == ["sm90", ""]
    assert EXT.bwd_family(*args, True, 0) == ["sm90", ""]
    scale = 1 / math.sqrt(q.shape[-1])
    ref = reference_grads(q, k, v, dout, True, False, scale, torch.float64)
    base = reference_grads(q, k, v, dout, True, False, scale, torch.bfloat16)
    for name in runs:
        for which, g, r, bg in zip("qkv", grads[name], ref, base):
            check(f"{name} d{which}", g.double(), r, bg.double(), 1e-3)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_auto_runs_the_sm90_backward_on_gqa(group):
    """GQA / MQA: auto (family 0) runs the sm90 kernel (no sm80 kernel in the profile), and its
    dk / dv match the sm80 family's (which sums a group in registers) within the file's rule
    against float64 (dK / dV reductions run in any order: not bit for bit)."""
    h, hkv = GROUPS[group]
    q, k, v = make_qkv(2, 512, 512, h, hkv, torch.bfloat16, "bshd", seed=3)
    dout = torch.randn_like(q)
    grads = {}
    kernels = {}
    for family in (0, 80):
        def call(family=family):
            grads[family] = run_fwd_bwd(q, k, v, dout, "bshd", True, False, family=family)
        call()
        kernels[family] = bwd_kernels(call)
    assert kernels == {0: {"sm90::bwd_kernel"}, 80: {"sm80::bwd_kernel"}}
    assert EXT.bwd_family(*SERVED[:11], True, False, 0) == ["sm90", ""]
    scale = 1 / math.sqrt(q.shape[-1])
    ref = reference_grads(q, k, v, dout, True, False, scale, torch.float64)
    base = reference_grads(q, k, v, dout, True, False, scale, torch.bfloat16)
    for family in (0, 80):
        for which, g, r, bg in zip("qkv", grads[family], ref, base):
            check(f"family {family} d{which}", g.double(), r, bg.double(), 1e-3)


@pytest.mark.parametrize("window", ["causal-left64", "left48-right16", "right37"])
@pytest.mark.parametrize("hkv", [4, 2], ids=["mha", "gqa"])
def test_auto_runs_the_sm90_backward_on_windows(window, hkv):
    """Sliding windows: auto (family 0) runs the sm90 kernel (no sm80 kernel in the profile),
    and bwd_family says so; the gradients obey the file's rule against float64."""
    left, right = WINDOWS[window]
    q, k, v = make_qkv(2, 512, 512, 4, hkv, torch.bfloat16, "bshd", seed=3)
    dout = torch.randn_like(q)
    grads = {}

    def call():
        grads[0] = run_fwd_bwd(q, k, v, dout, "bshd", False, True, family=0,
                               window=WINDOWS[window])
    call()
    assert bwd_kernels(call) == {"sm90::bwd_kernel"}
    assert EXT.bwd_family(90, True, 128, 512, 512, False, left, right, True, False, False,
                          hkv != 4, False, 0) == ["sm90", ""]
    scale = 1 / math.sqrt(q.shape[-1])
    ref = reference_grads(q, k, v, dout, False, True, scale, torch.float64, WINDOWS[window])
    base = reference_grads(q, k, v, dout, False, True, scale, torch.bfloat16, WINDOWS[window])
    for which, g, r, bg in zip("qkv", grads[0], ref, base):
        check(f"d{which}", g.double(), r, bg.double(), 1e-3)


# Deterministic mode: the key blocks that see a query block add their dQ tiles into it one at a
# time, last key block first, and GQA's query heads add their dK / dV into the group's
# accumulators one at a time (bwd_kernel.cuh, turns_of), so that dq, dk and dv are bitwise the
# same on every run. The cases: many key blocks per query block (s 2048: 16), sq !=
# sk both ways, ragged tails; no mask, causal of both alignments and windows (whose first key
# block differs per query block).
DETERMINISTIC_CASES = {
    "s2048-b1-h4": (1, 2048, 2048, 4, "bshd", 1.0),
    "s1000-b1-h4": CASES["s1000-b1-h4"],
    "sbhd-s113-b2-h4": CASES["sbhd-s113-b2-h4"],
    "cross-sq113-sk1000-b2-h2": CASES["cross-sq113-sk1000-b2-h2"],
    "cross-sq1000-sk257-b2-h2": CASES["cross-sq1000-sk257-b2-h2"],
}
DETERMINISTIC_MASKS = {"no_mask": ((-1, -1), False), "causal": ((-1, 0), False),
                       "causal_bottom_right": ((-1, 0), True),
                       "left48-right16": ((48, 16), False),
                       "causal-left64-bottom_right": ((64, 0), True),
                       "left300-right200": ((300, 200), False)}


@pytest.mark.parametrize("name", sorted(DETERMINISTIC_CASES))
@pytest.mark.parametrize("mask", sorted(DETERMINISTIC_MASKS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 192, 256], ids=["d64", "d128", "d192", "d256"])
@pytest.mark.parametrize("group", [1, 2], ids=["mha", "gqa"])
def test_deterministic_backward_is_bitwise_reproducible(name, mask, dtype, d, group):
    """Three deterministic backwards of one call: dq, dk, dv bit for bit equal, and within the
    file's rule against float64; GQA (two query heads per KV head; MQA where h = 2)."""
    b, sq, sk, h, layout, gain = DETERMINISTIC_CASES[name]
    window, bottom_right = DETERMINISTIC_MASKS[mask]
    if bottom_right and sq == sk:
        pytest.skip("the same mask as top-left")
    q, k, v = make_qkv(b, sq, sk, h, h // group, dtype, layout, gain, d=d)
    gen = torch.Generator(device=DEV).manual_seed(1)
    dout = torch.randn(q.shape, generator=gen, device=DEV).to(dtype)
    runs = [run_fwd_bwd(q, k, v, dout, layout, False, bottom_right, family=90,
                        deterministic=True, window=window) for _ in range(3)]
    for again in runs[1:]:
        for which, g, a in zip("qkv", runs[0], again):
            assert torch.equal(g, a), f"d{which} differs between runs"
    qb, kb, vb, dob = (to_bshd(x, layout) for x in (q, k, v, dout))
    scale = 1 / math.sqrt(d)
    ref = reference_grads(qb, kb, vb, dob, False, bottom_right, scale, torch.float64, window)
    base = reference_grads(qb, kb, vb, dob, False, bottom_right, scale, dtype, window)
    for which, g, r, bg in zip("qkv", runs[0], ref, base):
        check(f"{name} {mask} d{which}", to_bshd(g, layout).double(), r, bg.double(), 1e-3)


@pytest.mark.parametrize("fmt", ["thd", "bshd-padded"])
@pytest.mark.parametrize("mask", sorted(DETERMINISTIC_MASKS))
@pytest.mark.parametrize("d", [64, 128, 256], ids=["d64", "d128", "d256"])
@pytest.mark.parametrize("hkv", [2, 1], ids=["mha", "mqa"])
def test_varlen_deterministic_backward_is_bitwise_reproducible(fmt, mask, d, hkv):
    """Varlen (bf16): three deterministic backwards bit for bit equal (thd: the 8-row groups
    that two sequences' tiles share), each sequence within the rule against float64; MHA and
    MQA (2 query heads on 1 KV head)."""
    window, bottom_right = DETERMINISTIC_MASKS[mask]
    check_varlen(fmt, window, bottom_right, torch.bfloat16, d, 2, hkv, deterministic=True,
                 runs=3)


@pytest.mark.parametrize("mask", ["no_mask", "causal", "left48-right16"])
def test_auto_runs_the_sm90_backward_when_deterministic(mask):
    """Deterministic MHA and GQA: auto (family 0) runs the sm90 kernel (no sm80 kernel in the
    profile), bwd_family says so, and two runs give the same bits."""
    window, bottom_right = DETERMINISTIC_MASKS[mask]
    q, k, v = make_qkv(2, 1024, 1024, 4, 4, torch.bfloat16, "bshd", seed=3)
    dout = torch.randn_like(q)
    grads = []

    def call():
        grads.append(run_fwd_bwd(q, k, v, dout, "bshd", False, bottom_right, family=0,
                                 deterministic=True, window=window))
    call()
    assert bwd_kernels(call) == {"sm90::bwd_kernel"}
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
    left, right = window
    args = (90, True, 128, 1024, 1024, False, left, right, bottom_right, False, False)
    assert EXT.bwd_family(*args, False, True, 0) == ["sm90", ""]
    assert EXT.bwd_family(*args, True, True, 0) == ["sm90", ""]
    q, k, v = make_qkv(2, 1024, 1024, 4, 2, torch.bfloat16, "bshd", seed=3)
    grads = []

    def call_gqa():
        grads.append(run_fwd_bwd(q, k, v, dout, "bshd", False, bottom_right, family=0,
                                 deterministic=True, window=window))
    call_gqa()  # the first call loads the modules
    assert bwd_kernels(call_gqa) == {"sm90::bwd_kernel"}
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))


def sm90_backward_through_dpa(monkeypatch, q, k, v, hkv, causal, window=None):
    """bshd q, k, v through DotProductAttention with FlashAttention alone (debug log on): its
    output, the leaves and a dout; the log must name the sm90 backward."""
    import transformer_fa as tfa

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    h, d = q.shape[2], q.shape[3]
    dpa = tfa.DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format="bshd",
                                  attn_mask_type="causal" if causal else "no_mask",
                                  window_size=window).cuda()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with capture_log() as lines:
        out = dpa(*leaves)
    assert dpa.last_backend == "FlashAttention"
    assert any("backward = sm90 (wgmma, TMA)" in line for line in lines), lines
    dout = torch.randn(out.shape, generator=torch.Generator(device=DEV).manual_seed(11),
                       device=DEV).to(out.dtype)
    return out, leaves, dout


def test_deterministic_training_step_through_dot_product_attention(monkeypatch):
    """NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 through DotProductAttention: the debug log names the
    sm90 backward, two backwards give the same bits, and the rule against float64 holds."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    b, s, h, d = 2, 700, 4, 128
    q, k, v = make_qkv(b, s, s, h, h, torch.bfloat16, "bshd", seed=7, d=d)
    out, leaves, dout = sm90_backward_through_dpa(monkeypatch, q, k, v, h, True)
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    again = torch.autograd.grad(out, leaves, dout)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    dob = dout.view(b, s, h, d)
    ref = reference_grads(q, k, v, dob, True, False, 1 / math.sqrt(d), torch.float64)
    base = reference_grads(q, k, v, dob, True, False, 1 / math.sqrt(d), torch.bfloat16)
    for which, g, r, bg in zip("qkv", grads, ref, base):
        check(f"d{which}", g.double(), r, bg.double(), 1e-3)


# (d, sq, sk, varlen, window_left, window_right, bottom_right, alibi, dropout, gqa,
#  deterministic) -> the reason's words
DECLINED = {
    "head dim 264": ((264, 256, 256, False, -1, 0, False, False, False, False, False),
                     "head dims up to 256 only"),
    "alibi": ((128, 256, 256, False, -1, 0, False, True, False, False, False), "ALiBi"),
    "dropout": ((128, 256, 256, False, -1, -1, False, False, True, False, False), "dropout"),
}


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_declined_calls_say_why(name):
    args, words = DECLINED[name]
    family, why = EXT.bwd_family(ARCH, True, *args, 90)
    assert family == "sm80" and words in why, (family, why)
    assert EXT.bwd_family(80, True, *SERVED[2:], 90)[0] == "sm80"  # not an sm_90 GPU


def test_forced_sm90_on_a_declined_call_is_a_clear_error():
    q, k, v = make_qkv(1, 256, 256, 2, 2, torch.bfloat16, "bshd", d=256)
    fmt, scale = BSHD, 1 / math.sqrt(256)
    slopes = torch.tensor([0.5, 0.25], device=DEV)
    out, lse = EXT.fwd(q, k, v, None, None, fmt, fmt, 256, 256, scale, -1, 0, True, True, 0.0,
                       None, slopes, 0)
    with pytest.raises(RuntimeError, match="flash_attn_bwd: the sm90 family was requested, but "
                                           ".*does not take ALiBi"):
        EXT.bwd(torch.randn_like(q), q, k, v, out, lse, None, None, fmt, fmt, 256, 256, scale,
                -1, 0, True, 0.0, None, slopes, False, None, 90)
    with pytest.raises(RuntimeError, match="family must be 0"):
        run_fwd_bwd(q, k, v, torch.randn_like(q), "bshd", True, True, family=100)


@pytest.mark.parametrize("hkv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("mask", ["no_mask", "causal", "window"])
@pytest.mark.parametrize("d", [128, 256], ids=["d128", "d256"])
def test_training_step_with_the_sm90_backward(monkeypatch, mask, hkv, d):
    """Through DotProductAttention with TRANSFORMER_FA_FLASH_BWD_FAMILY=sm90: the debug log
    names the sm90 backward, and the gradients obey the rule against float64 autograd
    (window: causal with window_size (64, 0))."""
    monkeypatch.setenv("TRANSFORMER_FA_FLASH_BWD_FAMILY", "sm90")
    b, s, h = 2, 300, 4
    q, k, v = make_qkv(b, s, s, h, hkv, torch.bfloat16, "bshd", seed=7, d=d)
    causal = mask != "no_mask"
    window = (64, 0) if mask == "window" else None
    out, leaves, dout = sm90_backward_through_dpa(monkeypatch, q, k, v, hkv, causal, window)
    grads = torch.autograd.grad(out, leaves, dout)
    dob = dout.view(b, s, h, d)
    ref = reference_grads(q, k, v, dob, causal, False, 1 / math.sqrt(d), torch.float64, window)
    base = reference_grads(q, k, v, dob, causal, False, 1 / math.sqrt(d), torch.bfloat16, window)
    for which, g, r, bg in zip("qkv", grads, ref, base):
        check(f"d{which}", g.double(), r, bg.double(), 1e-3)


def test_forced_sm90_backward_on_a_declined_call_fails_with_the_reason(monkeypatch):
    """TRANSFORMER_FA_FLASH_BWD_FAMILY=sm90 on a call its backward declines (dropout, at head
    dim 256; GQA with a sliding window): the forward runs, the backward raises the binding's
    error naming the reason (no silent fallback)."""
    import transformer_fa as tfa

    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setenv("TRANSFORMER_FA_FLASH_BWD_FAMILY", "sm90")
    q, k, v = make_qkv(2, 256, 256, 4, 2, torch.bfloat16, "bshd", d=256)
    dpa = tfa.DotProductAttention(4, 256, num_gqa_groups=2, qkv_format="bshd",
                                  attention_dropout=0.1, window_size=(64, 0)).cuda()
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = dpa(*leaves)
    assert dpa.last_backend == "FlashAttention"
    with pytest.raises(RuntimeError, match="sm90 family was requested, but its backward does "
                                           "not take dropout"):
        out.sum().backward()
