"""Quick check of the flash extension's fwd/bwd against float32 torch math, and a timing of the
standard-grid rows against torch's FLASH_ATTENTION, calling the extension directly (no
transformer_fa backend code). For kernel development on the GPU machine:

    python tools/flash_kernel_check.py [--dims 64,128] [--dtypes bf16] [--bench]

The full test suite is tests/gpu/test_flash.py; this is the short loop.
"""
import argparse
import math

import torch
import torch.nn.functional as F

import transformer_fa_flash as ext

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reference(q, k, v, causal, bottom_right, window, slopes, upcast):
    """[b, s, h, d] math; GQA by repeat; windows as flash.h defines them."""
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k).float() / math.sqrt(d)
    i = torch.arange(sq, device=q.device).view(-1, 1)
    j = torch.arange(sk, device=q.device).view(1, -1)
    off = sk - sq if bottom_right else 0
    left, right = window
    if causal:
        right = 0
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        keep &= j <= i + off + right
    if left >= 0:
        keep &= j >= i + off - left
    if slopes is not None:
        s = s - slopes.view(1, -1, 1, 1) * (i + off - j).abs().float()
    s = s.masked_fill(~keep, float("-inf"))
    mx = s.amax(-1, keepdim=True).detach()
    e = torch.exp(s - torch.where(torch.isinf(mx), torch.zeros_like(mx), mx))
    p = e / e.sum(-1, keepdim=True).clamp_min(1e-30)  # rows with no key: 0
    o = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return o


def run_case(dt, d, b, sq, sk, h, hk, causal=False, bottom_right=False, window=(-1, -1),
             alibi=False, deterministic=False):
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(b, sq, h, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device=dev, dtype=dt, requires_grad=True)
    do = torch.randn(b, sq, h, d, device=dev, dtype=dt)
    slopes = torch.rand(h, device=dev) if alibi else None
    scale = 1 / math.sqrt(d)
    left, right = window
    if causal:
        right = 0
    out, lse = ext.fwd(q.detach(), k.detach(), v.detach(), None, None, 0, 0, sq, sk, scale,
                       left, right, bottom_right, True, 0.0, None, slopes)
    dq, dk, dv = ext.bwd(do, q.detach(), k.detach(), v.detach(), out, lse, None, None, 0, 0,
                         sq, sk, scale, left, right, bottom_right, 0.0, None, slopes,
                         deterministic)
    errs = {}
    grads = {}
    for upcast in (True, False):
        for t in (q, k, v):
            t.grad = None
        o = reference(q, k, v, causal, bottom_right, window, slopes, upcast)
        o.backward(do)
        grads[upcast] = (o.detach().float(), q.grad.float(), k.grad.float(), v.grad.float())
    ok = True
    for name, got, ref, low in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), grads[True],
                                   grads[False]):
        err = (got.float() - ref).abs().max().item()
        base = (low - ref).abs().max().item()
        atol = 2e-3 if dt == torch.float16 else 8e-3
        errs[name] = (err, base)
        if not err <= 2 * base + atol or not math.isfinite(err):
            ok = False
    if deterministic:
        again = ext.bwd(do, q.detach(), k.detach(), v.detach(), out, lse, None, None, 0, 0, sq,
                        sk, scale, left, right, bottom_right, 0.0, None, slopes, True)
        ok = ok and all(torch.equal(a, b2) for a, b2 in zip((dq, dk, dv), again))
    tag = (f"{str(dt)[6:]} d{d} b{b} sq{sq} sk{sk} h{h}/{hk} causal={causal} br={bottom_right} "
           f"win={window} alibi={alibi} det={deterministic}")
    print(("ok  " if ok else "FAIL"), tag, " ".join(f"{n}={e:.2e}/{b_:.2e}"
                                                    for n, (e, b_) in errs.items()))
    return ok


def bench(dims, dt, peers=True, fwd=True):
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    print("d causal s | ours fwd/bwd TFLOPS | FA2 fwd/bwd")
    for d in dims:
        for causal in (False, True):
            for s in (1024, 4096, 16384):
                b, h = 16384 // s, 2048 // d
                q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=dt) for _ in range(4))
                scale = 1 / math.sqrt(d)
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                wr = 0 if causal else -1
                f = lambda: ext.fwd(q, k, v, None, None, 0, 0, s, s, scale, -1, wr, False, True)
                out, lse = f()
                g = lambda: ext.bwd(do, q, k, v, out, lse, None, None, 0, 0, s, s, scale, -1, wr,
                                    False)
                tf = flops / do_bench(f, return_mode="median") / 1e9 if fwd else 0.0
                tb = 2.5 * flops / do_bench(g, return_mode="median") / 1e9
                if not peers:
                    print(f"{d} {int(causal)} {s} | {tf:.0f} / {tb:.0f}", flush=True)
                    continue
                qt, kt, vt = (x.transpose(1, 2).requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    ff = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    o = ff()
                    dot = do.transpose(1, 2)
                    gg = lambda: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True)
                    pf = flops / do_bench(ff, return_mode="median") / 1e9
                    pb = 2.5 * flops / do_bench(gg, return_mode="median") / 1e9
                print(f"{d} {int(causal)} {s} | {tf:.0f} / {tb:.0f} | {pf:.0f} / {pb:.0f}"
                      f" | bwd x{tb / pb:.2f}")


def long_sequence(s=131072, h=8, d=128):
    """Forward + backward at b=1, h=8, d=128, s=131072: peak memory above the inputs and time."""
    for causal in (False, True):
        q, k, v, do = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        scale, wr = 1 / math.sqrt(d), (0 if causal else -1)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out, lse = ext.fwd(q, k, v, None, None, 0, 0, s, s, scale, -1, wr, False, True)
        dq, dk, dv = ext.bwd(do, q, k, v, out, lse, None, None, 0, 0, s, s, scale, -1, wr, False)
        end.record()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        finite = all(torch.isfinite(t).all().item() for t in (out, dq, dk, dv))
        print(f"s={s} b=1 h={h} d={d} causal={causal}: fwd+bwd {start.elapsed_time(end):.0f} ms, "
              f"peak memory above the inputs {peak:.2f} GiB (inputs {4 * q.numel() * 2 / 2**30:.2f}"
              f" GiB), finite={finite}")
        del q, k, v, do, out, lse, dq, dk, dv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128,192,256")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--long", action="store_true", help="s = 131072 forward + backward memory")
    ap.add_argument("--no-peers", action="store_true", help="time ours only")
    ap.add_argument("--bwd-only", action="store_true", help="time the backward only")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness cases")
    args = ap.parse_args()
    dims = [int(x) for x in args.dims.split(",")]
    ok = True
    for name in ([] if args.no_check else args.dtypes.split(",")):
        dt = DT[name]
        for d in dims:
            ok &= run_case(dt, d, 2, 128, 128, 4, 4)
            ok &= run_case(dt, d, 2, 200, 333, 4, 2, causal=True)
            ok &= run_case(dt, d, 2, 333, 200, 4, 2, causal=True, bottom_right=True)
            ok &= run_case(dt, d, 1, 257, 513, 8, 1, window=(100, 30))
            ok &= run_case(dt, d, 2, 300, 300, 4, 4, causal=True, alibi=True)
            ok &= run_case(dt, d - 24 if d > 32 else d, 2, 150, 170, 4, 4)  # rounded-up head dim
            ok &= run_case(dt, d, 2, 1024, 1024, 8, 2, causal=True, deterministic=True)
    print("ALL OK" if ok else "SOME FAILED")
    if args.long:
        long_sequence()
    if args.bench:
        bench(dims, torch.bfloat16, peers=not args.no_peers, fwd=not args.bwd_only)


if __name__ == "__main__":
    main()
