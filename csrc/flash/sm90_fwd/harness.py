"""Build, test and time the sm90a forward kernel of this folder on its own.

    python harness.py build          # nvcc -> build/libsm90fwd.so (CUTLASS headers: see README)
    python harness.py test           # O and LSE against a float64 reference (error rule below)
    python harness.py bench          # TFLOPS beside torch SDPA's cuDNN and FlashAttention backends
    python harness.py small          # one small call (for compute-sanitizer)
    python harness.py all            # build (if missing), test, bench

The kernel is loaded with ctypes and fed torch tensors' data_ptr(); no torch header is involved.
Error rule (per call, O and LSE each): max |ours - ref64| <= 2 * max |torch bf16/fp16 math -
ref64| + 1e-3, where ref64 is the float64 reference and "torch math" runs the same attention
in the input dtype.
"""
from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
LIB_PATH = os.path.join(HERE, "build", "libsm90fwd.so")
HEAD_DIM = 128
BLOCK_M = 128


def cutlass_include():
    """CUTLASS/CuTe headers: $CUTLASS_INCLUDE, else an installed nvidia-cutlass wheel."""
    if os.environ.get("CUTLASS_INCLUDE"):
        return os.environ["CUTLASS_INCLUDE"]
    for base in sys.path + ["/tmp/site"]:
        path = os.path.join(base, "cutlass_library", "source", "include")
        if os.path.isdir(os.path.join(path, "cute")):
            return path
    raise FileNotFoundError("CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0 "
                            "or set CUTLASS_INCLUDE")


def build():
    os.makedirs(os.path.dirname(LIB_PATH), exist_ok=True)
    cmd = ["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
           "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC", "-shared", "-Xptxas", "-v",
           "-diag-suppress", "3357", f"-I{cutlass_include()}", "-o", LIB_PATH,
           os.path.join(HERE, "sm90_fwd_api.cu")]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


class Sm90Forward:
    """ctypes wrapper of sm90_fwd_hdim128; checks every argument before the kernel runs."""

    def __init__(self, path=LIB_PATH):
        self.lib = ctypes.CDLL(path)
        fn = self.lib.sm90_fwd_hdim128
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_void_p] + [ctypes.c_int] * 5 +
                       [ctypes.POINTER(ctypes.c_int64), ctypes.c_float, ctypes.c_int,
                        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p])
        self.fn = fn

    @staticmethod
    def check(q, k, v):
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not x.is_cuda or x.dim() != 4:
                raise ValueError(f"{name}: expected a 4-d CUDA tensor [b, s, h, d], got "
                                 f"{tuple(x.shape)} on {x.device}")
            if x.dtype not in (torch.bfloat16, torch.float16) or x.dtype != q.dtype:
                raise TypeError(f"{name}: expected bf16 or fp16 like q, got {x.dtype}")
            if x.shape[-1] != HEAD_DIM or x.stride(-1) != 1:
                raise ValueError(f"{name}: head dim must be {HEAD_DIM} and contiguous")
            if any(st % 8 for st in x.stride()[:3]) or x.data_ptr() % 16:
                raise ValueError(f"{name}: strides must be multiples of 8 elements and the "
                                 "pointer 16-byte aligned (TMA)")
        b, s, h, _ = q.shape
        if k.shape != v.shape or k.shape[0] != b:
            raise ValueError(f"k, v: expected equal shapes with batch {b}, got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[1] != s or s % BLOCK_M:
            raise ValueError(f"seqlen: q and k must have the same length, a multiple of "
                             f"{BLOCK_M}; got {s} and {k.shape[1]}")
        if h % k.shape[2]:
            raise ValueError(f"heads: q heads ({h}) must be a multiple of k/v heads "
                             f"({k.shape[2]})")

    def __call__(self, *args, **kwargs):
        """(q, k, v, causal=False, softmax_scale=None, out=None, lse=None, persistent=None,
        max_ctas=0) -> (out, lse); see prepare."""
        call, out, lse = self.prepare(*args, **kwargs)
        call()
        return out, lse

    def prepare(self, q, k, v, causal=False, softmax_scale=None, out=None, lse=None,
                persistent=None, max_ctas=0):
        """Checks the arguments and returns (call, out, lse): call() launches the kernel with
        the arguments fixed now (the benchmark times call(), without Python's checks).
        persistent: None = the kernel's default for the mask, True/False to force.
        max_ctas > 0 caps the persistent grid (each CTA then loops over more tiles)."""
        self.check(q, k, v)
        b, s, h, d = q.shape
        out = torch.empty(b, s, h, d, dtype=q.dtype, device=q.device) if out is None else out
        # lse=False: no LSE (the kernel gets a null pointer and skips it).
        skip_lse = lse is False
        lse = (torch.empty(b, h, s, dtype=torch.float32, device=q.device)
               if lse is None or skip_lse else lse)
        scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
        if lse.shape != (b, h, s) or lse.dtype != torch.float32 or lse.device != q.device:
            raise ValueError(f"lse: expected float32 [{b}, {h}, {s}] on {q.device}, got "
                             f"{lse.dtype} {tuple(lse.shape)} on {lse.device}")
        strides = []
        for x in (q, k, v, out):
            strides += [x.stride(0), x.stride(1), x.stride(2)]
        strides += [lse.stride(0), lse.stride(2), lse.stride(1)]  # (batch, row, head)
        arr = (ctypes.c_int64 * 15)(*strides)
        args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                None if skip_lse else lse.data_ptr(),
                b, s, k.shape[1], h, k.shape[2], arr, scale, int(causal),
                int(q.dtype == torch.bfloat16), -1 if persistent is None else int(persistent),
                max_ctas, torch.cuda.current_stream().cuda_stream)

        def call():
            rc = self.fn(*args)
            if rc != 0:
                raise RuntimeError(f"sm90_fwd_hdim128 failed with code {rc}")
        return call, out, None if skip_lse else lse


def reference(q, k, v, causal, scale, dtype):
    """Attention and natural-log LSE in `dtype`; returns ([b, s, h, d], [b, h, s])."""
    qd, kd, vd = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    groups = qd.shape[1] // kd.shape[1]
    kd, vd = kd.repeat_interleave(groups, dim=1), vd.repeat_interleave(groups, dim=1)
    scores = (qd @ kd.transpose(-1, -2)) * scale
    if causal:
        s = scores.shape[-1]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    lse = torch.logsumexp(scores.float() if dtype != torch.float64 else scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ vd
    return out.transpose(1, 2), lse


def max_err(x, ref):
    return (x.double() - ref).abs().max().item()


TEST_CASES = [  # (b, s, h, h_kv, layout)
    (2, 128, 2, 2, "bshd"),
    (1, 1024, 4, 4, "bshd"),
    (2, 512, 8, 2, "bshd"),      # GQA 4
    (1, 2048, 4, 1, "bshd"),     # MQA
    (2, 384, 4, 4, "packed"),    # q, k, v slices of one [b, s, 3, h, d]; LSE strided
    (1, 256, 2, 2, "bshd_x4"),   # larger logits (inputs scaled by 4)
    (4, 2048, 8, 2, "bshd"),     # 512 tiles: more than the SMs, so full persistent grids loop
]


def make_inputs(b, s, h, h_kv, layout, dtype, gen):
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    if layout == "packed":
        qkv = randn(b, s, 3, h, HEAD_DIM)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q, k, v = randn(b, s, h, HEAD_DIM), randn(b, s, h_kv, HEAD_DIM), randn(b, s, h_kv, HEAD_DIM)
    if layout == "bshd_x4":
        q, k = q * 4, k * 4
    return q, k, v


def test(fwd):
    gen = torch.Generator(device="cuda").manual_seed(0)
    failures = 0
    for dtype in (torch.bfloat16, torch.float16):
        for (b, s, h, h_kv, layout) in TEST_CASES:
            # persistent with 3 CTAs: each loops over several tiles (snake rounds, a
            # partial last round), which a full-size grid never does on these shapes.
            for causal, persistent, max_ctas in ((False, True, 0), (False, False, 0),
                                                 (False, True, 3), (True, True, 0),
                                                 (True, False, 0), (True, True, 3)):
                q, k, v = make_inputs(b, s, h, h_kv, layout, dtype, gen)
                scale = 1.0 / math.sqrt(HEAD_DIM)
                # The packed case also writes LSE through strides ([b, s, h] memory).
                lse_buf = (torch.empty(b, s, h, device="cuda").permute(0, 2, 1)
                           if layout == "packed" else None)
                out, lse = fwd(q, k, v, causal=causal, persistent=persistent, lse=lse_buf,
                               max_ctas=max_ctas)
                torch.cuda.synchronize()
                ref_o, ref_lse = reference(q, k, v, causal, scale, torch.float64)
                low_o, low_lse = reference(q, k, v, causal, scale, dtype)
                f32_o, _ = reference(q, k, v, causal, scale, torch.float32)
                errs = {"o": (max_err(out, ref_o), max_err(low_o, ref_o)),
                        "lse": (max_err(lse, ref_lse), max_err(low_lse, ref_lse))}
                ok = all(ours <= 2 * torch_err + 1e-3 for ours, torch_err in errs.values())
                ok = ok and torch.isfinite(out).all().item() and torch.isfinite(lse).all().item()
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {str(dtype)[6:]:8s} b={b} s={s:5d} h={h:2d} "
                      f"hkv={h_kv:2d} {layout:8s} causal={causal!s:5s} "
                      f"{('persistent/' + str(max_ctas or 'SMs')) if persistent else 'per-tile':14s} "
                      f"O err {errs['o'][0]:.2e} (torch {errs['o'][1]:.2e}, vs f32 "
                      f"{max_err(out, f32_o.double()):.2e})  LSE err {errs['lse'][0]:.2e} "
                      f"(torch {errs['lse'][1]:.2e})", flush=True)
    # Without LSE (null pointer): O identical, and no fault (a write through the null pointer
    # would raise at the next synchronize).
    q, k, v = make_inputs(1, 256, 2, 2, "bshd", torch.bfloat16, gen)
    out_ref, _ = fwd(q, k, v, causal=True)
    out_nolse, lse_none = fwd(q, k, v, causal=True, lse=False)
    torch.cuda.synchronize()
    ok = lse_none is None and torch.equal(out_ref, out_nolse)
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} lse=False: O identical to the run with LSE")
    # Bad input is refused before any kernel runs.
    q = torch.zeros(1, 200, 2, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    try:
        fwd(q, q, q)
        print("FAIL seqlen 200 was not refused")
        failures += 1
    except ValueError as exc:
        print(f"ok   refused: {exc}")
    print(f"{failures} failure(s)")
    return failures


def bench(fwd, seqlens=(1024, 4096, 16384), tokens=16384, hidden=2048, passes=3, alt=None):
    """alt: a second Sm90Forward (another build) timed beside, for A/B comparisons."""
    from triton.testing import do_bench
    h, d = hidden // HEAD_DIM, HEAD_DIM
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    print("causal      s     b  ours(default)  persistent  per-tile  cuDNN  FA2(torch)  "
          "default/cuDNN  default/FA2")
    for causal in (False, True):
        for s in seqlens:
            b = tokens // s
            q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda",
                                   requires_grad=True) for _ in range(3))
            out = torch.empty_like(q)
            lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
            qd, kd, vd = q.detach(), k.detach(), v.detach()
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

            def ours(persistent):
                call = fwd.prepare(qd, kd, vd, causal, out=out, lse=lse, persistent=persistent)[0]
                return lambda: do_bench(call, return_mode="median")

            def peer(backend):
                def timed():
                    with sdpa_kernel(backend):
                        return do_bench(
                            lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                            return_mode="median")
                return timed

            timers = {"ours": ours(None), "persistent": ours(True), "per-tile": ours(False),
                      "cudnn": peer(SDPBackend.CUDNN_ATTENTION),
                      "fa2": peer(SDPBackend.FLASH_ATTENTION)}
            if alt is not None:  # A/B: another build of the kernel, default grid
                call = alt.prepare(qd, kd, vd, causal, out=out, lse=lse)[0]
                timers["alt"] = lambda: do_bench(call, return_mode="median")
            # Passes interleave the backends; each keeps its median over the passes
            # (clock drift hits all alike).
            runs = {name: [] for name in timers}
            for _ in range(passes):
                for name, timer in timers.items():
                    runs[name].append(timer())
            times = {name: statistics.median(t) for name, t in runs.items()}
            tf = {n: flops / t / 1e9 for n, t in times.items()}
            print(f"{causal!s:6s} {s:6d} {b:5d}  {tf['ours']:13.0f}  {tf['persistent']:10.0f}  "
                  f"{tf['per-tile']:8.0f}  {tf['cudnn']:5.0f}  {tf['fa2']:10.0f}  "
                  f"{tf['ours'] / tf['cudnn']:13.2f}  {tf['ours'] / tf['fa2']:11.2f}" +
                  (f"  alt {tf['alt']:4.0f}" if alt is not None else ""), flush=True)


def small(fwd):
    """One small call per mask (for compute-sanitizer racecheck / memcheck)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for causal in (False, True):
        q, k, v = make_inputs(2, 512, 2, 1, "bshd", torch.bfloat16, gen)  # 16 tiles
        for persistent in (False, True):  # persistent on 3 CTAs: each loops over tiles
            out, lse = fwd(q, k, v, causal=causal, persistent=persistent, max_ctas=3)
            ref_o, _ = reference(q, k, v, causal, 1.0 / math.sqrt(HEAD_DIM), torch.float32)
            torch.cuda.synchronize()
            print(f"small causal={causal} persistent={persistent}: max err "
                  f"{max_err(out, ref_o.double()):.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("build", "test", "bench", "small", "all"))
    args = parser.parse_args()
    if args.what == "build" or (args.what == "all" and not os.path.exists(LIB_PATH)):
        build()
    if args.what == "build":
        return 0
    fwd = Sm90Forward()
    failures = 0
    if args.what in ("test", "all"):
        failures = test(fwd)
    if args.what == "small":
        small(fwd)
    if args.what in ("bench", "all"):
        alt = os.environ.get("SM90_FWD_ALT_LIB")
        bench(fwd, alt=Sm90Forward(alt) if alt else None)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
