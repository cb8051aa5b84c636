"""Quick check of the flash extension's fwd/bwd (called directly, no backend code) against the
GPU tests' float32 reference and error rule (tests/gpu/attention_cases.py, masks from
transformer_fa.attention.masks), and a timing of the standard-grid rows against torch's
FLASH_ATTENTION. For kernel development on the GPU machine:

    python tools/flash_kernel_check.py [--dims 64,128] [--dtypes bf16] [--bench] [--long]

The full test suite is tests/gpu/test_flash.py; this is the short loop.
"""
import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import transformer_fa_flash as ext

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu")]
from attention_cases import check, reference_grads  # noqa: E402  (the GPU tests' reference)
from benchmarks.timing import median_ms, once_ms  # noqa: E402
from transformer_fa.attention import masks  # noqa: E402

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEV = "cuda"


def run_case(dt, d, b, sq, sk, h, hk, mask="no_mask", window=(-1, -1), alibi=False,
             deterministic=False):
    """One bshd case through the extension, against the GPU tests' reference and error rule.
    mask: no_mask, causal or causal_bottom_right; the diagonal as transformer_fa.masks puts it
    (top-left for causal only)."""
    torch.manual_seed(0)
    q = torch.randn(b, sq, h, d, device=DEV, dtype=dt)
    k, v = (torch.randn(b, sk, hk, d, device=DEV, dtype=dt) for _ in range(2))
    do = torch.randn(b, sq, h, d, device=DEV, dtype=dt)
    slopes = torch.rand(h, device=DEV) if alibi else None
    scale = 1 / math.sqrt(d)
    bottom_right = mask != "causal"
    left, right = window
    right = 0 if "causal" in mask else right
    lens_q = torch.full((b,), sq, device=DEV)
    lens_k = torch.full((b,), sk, device=DEV)
    keep = masks.keep_mask(mask, (left, right), lens_q, lens_k, sq, sk)
    bias = None if slopes is None else masks.alibi_bias(slopes, mask, lens_q, lens_k, sq, sk)

    out, lse = ext.fwd(q, k, v, None, None, 0, 0, sq, sk, scale, left, right, bottom_right,
                       True, 0.0, None, slopes)
    grads = ext.bwd(do, q, k, v, out, lse, None, None, 0, 0, sq, sk, scale, left, right,
                    bottom_right, 0.0, None, slopes, deterministic)
    refs = [reference_grads(q, k, v, do, keep, scale, upcast=up, bias=bias, float_bias=True)
            for up in (True, False)]
    tag = (f"{str(dt)[6:]} d{d} b{b} sq{sq} sk{sk} h{h}/{hk} {mask} win={window} alibi={alibi} "
           f"det={deterministic}")
    atol = 2e-3 if dt == torch.float16 else 8e-3
    try:
        check("out", out, refs[0][0], refs[1][0], atol)
        for name, got, r32, rdt in zip(("dq", "dk", "dv"), grads, refs[0][2], refs[1][2]):
            check(name, got, r32, rdt, atol)
        if deterministic:
            again = ext.bwd(do, q, k, v, out, lse, None, None, 0, 0, sq, sk, scale, left, right,
                            bottom_right, 0.0, None, slopes, True)
            assert all(torch.equal(x, y) for x, y in zip(grads, again)), "not bitwise equal"
    except AssertionError as exc:
        print("FAIL", tag, exc)
        return False
    print("ok  ", tag)
    return True


def bench(dims, dt, peers=True, fwd=True, bwd=True):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    print("d causal s | ours fwd/bwd TFLOPS | FA2 fwd/bwd")
    for d in dims:
        for causal in (False, True):
            for s in (1024, 4096, 16384):
                b, h = 16384 // s, 2048 // d
                q, k, v, do = (torch.randn(b, s, h, d, device=DEV, dtype=dt) for _ in range(4))
                scale = 1 / math.sqrt(d)
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                wr = 0 if causal else -1
                f = lambda: ext.fwd(q, k, v, None, None, 0, 0, s, s, scale, -1, wr, False, True)
                out, lse = f()
                g = lambda: ext.bwd(do, q, k, v, out, lse, None, None, 0, 0, s, s, scale, -1, wr,
                                    False)
                tf = flops / median_ms(f) / 1e9 if fwd else 0.0
                tb = 2.5 * flops / median_ms(g) / 1e9 if bwd else 0.0
                if not peers:
                    print(f"{d} {int(causal)} {s} | {tf:.0f} / {tb:.0f}", flush=True)
                    continue
                qt, kt, vt = (x.transpose(1, 2).requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    ff = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    o = ff()
                    dot = do.transpose(1, 2)
                    gg = lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)
                    pf = flops / median_ms(ff) / 1e9 if fwd else 0.0
                    pb = 2.5 * flops / median_ms(gg) / 1e9 if bwd else 0.0
                pairs = (("fwd", tf, pf), ("bwd", tb, pb))
                ratios = [f"{x} x{ours / peer:.2f}" for x, ours, peer in pairs if ours]
                print(f"{d} {int(causal)} {s} | {tf:.0f} / {tb:.0f} | {pf:.0f} / {pb:.0f} | "
                      + " ".join(ratios))


def long_sequence(s=131072, h=8, d=128):
    """Forward + backward at b=1, h=8, d=128, s=131072: peak memory above the inputs and time."""
    for causal in (False, True):
        _long_sequence_once(s, h, d, causal)  # its tensors are freed on return


def _long_sequence_once(s, h, d, causal):
    q, k, v, do = (torch.randn(1, s, h, d, device=DEV, dtype=torch.bfloat16) for _ in range(4))
    scale, wr = 1 / math.sqrt(d), (0 if causal else -1)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = {}

    def fwd_bwd():
        res["out"], res["lse"] = ext.fwd(q, k, v, None, None, 0, 0, s, s, scale, -1, wr, False,
                                         True)
        res["grads"] = ext.bwd(do, q, k, v, res["out"], res["lse"], None, None, 0, 0, s, s,
                               scale, -1, wr, False)

    elapsed = once_ms(fwd_bwd)
    out, (dq, dk, dv) = res["out"], res["grads"]
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    finite = all(torch.isfinite(t).all().item() for t in (out, dq, dk, dv))
    print(f"s={s} b=1 h={h} d={d} causal={causal}: fwd+bwd {elapsed:.0f} ms, "
          f"peak memory above the inputs {peak:.2f} GiB (inputs {4 * q.numel() * 2 / 2**30:.2f}"
          f" GiB), finite={finite}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128,192,256")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--long", action="store_true", help="s = 131072 forward + backward memory")
    ap.add_argument("--no-peers", action="store_true", help="time ours only")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--bwd-only", action="store_true", help="time the backward only")
    only.add_argument("--fwd-only", action="store_true", help="time the forward only")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness cases")
    args = ap.parse_args()
    dims = [int(x) for x in args.dims.split(",")]
    ok = True
    for name in ([] if args.no_check else args.dtypes.split(",")):
        dt = DT[name]
        for d in dims:
            ok &= run_case(dt, d, 2, 128, 128, 4, 4)
            ok &= run_case(dt, d, 2, 200, 333, 4, 2, mask="causal")
            ok &= run_case(dt, d, 2, 333, 200, 4, 2, mask="causal_bottom_right")
            ok &= run_case(dt, d, 1, 257, 513, 8, 1, window=(100, 30))
            ok &= run_case(dt, d, 4, 1900, 1500, 16, 4)  # several waves of tiles, GQA, sq != sk
            ok &= run_case(dt, d, 2, 300, 300, 4, 4, mask="causal", alibi=True)
            ok &= run_case(dt, d - 24 if d > 32 else d, 2, 150, 170, 4, 4)  # rounded-up head dim
            ok &= run_case(dt, d, 2, 1024, 1024, 8, 2, mask="causal", deterministic=True)
    print("ALL OK" if ok else "SOME FAILED")
    if args.long:
        long_sequence()
    if args.bench:
        bench(dims, torch.bfloat16, peers=not args.no_peers, fwd=not args.bwd_only,
              bwd=not args.fwd_only)


if __name__ == "__main__":
    main()
