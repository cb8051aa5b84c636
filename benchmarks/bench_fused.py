"""FusedAttention vs torch's SDPA CUDNN_ATTENTION: kernel speed and host overhead.

Run on a GPU machine: ``python benchmarks/bench_fused.py``. Prints one table. Times are
medians of CUDA-event timings (benchmarks/timing.py) after warm-up, on random data.
Host overhead: wall time per call of a loop of calls at a tiny shape, without
synchronizing (the GPU work is far shorter than the host's), so it measures the Python and
dispatch cost of a cached call.
"""
import logging
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import timing  # noqa: E402
from transformer_fa.attention.backends import fused  # noqa: E402
from transformer_fa.attention.params import AttentionInputs, AttentionParams  # noqa: E402


def params_for(b, s, h, d, causal, dtype, requires_grad=True):
    return AttentionParams(
        qkv_format="bshd", q_format="bshd", kv_format="bshd", qkv_layout="bshd_bshd_bshd",
        batch_size=b, num_heads=h, num_gqa_groups=h, max_seqlen_q=s, max_seqlen_kv=s,
        head_dim_qk=d, head_dim_v=d, dtype=dtype, device_type="cuda",
        compute_capability=torch.cuda.get_device_capability(),
        attn_mask_type="causal" if causal else "no_mask",
        window_size=(-1, 0) if causal else (-1, -1), core_attention_bias_type="no_bias",
        core_attention_bias_shape=None, core_attention_bias_requires_grad=False,
        alibi_slopes_shape=None, attention_dropout=0.0, softmax_scale=1 / math.sqrt(d),
        deterministic=False, requires_grad=requires_grad)


def inputs(b, s, h, d, dtype, requires_grad=True):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g)
            .requires_grad_(requires_grad) for _ in range(3)]


def ours(q, k, v, params):
    return fused.run(AttentionInputs(q, k, v), params)


def theirs(q, k, v, causal):
    # the same bshd memory, as (b, h, s, d) views
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2), is_causal=causal)


def bench(fn):
    return timing.median_ms(fn)


def speed_rows(shapes, dtype):
    rows = []
    for b, s, h, d, causal in shapes:
        q, k, v = inputs(b, s, h, d, dtype)
        params = params_for(b, s, h, d, causal, dtype)
        assert not fused.not_supported_reasons(params), fused.not_supported_reasons(params)
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        res = {}
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for name, fn in (("fused", lambda: ours(q, k, v, params)),
                             ("torch", lambda: theirs(q, k, v, causal))):
                out = fn()
                dout = torch.randn_like(out)
                fwd = bench(lambda: fn())
                bwd = bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
                res[name] = (fwd, bwd, out)
        o1 = res["fused"][2].detach().view(b, s, h, d).float()
        o2 = res["torch"][2].detach().transpose(1, 2).float()
        diff = (o1 - o2).abs().max().item()
        for name in ("fused", "torch"):
            fwd, bwd, _ = res[name]
            rows.append((f"b{b} s{s} h{h} d{d} {'causal' if causal else 'full'}", name,
                         fwd, flops / fwd / 1e9, bwd, 2.5 * flops / bwd / 1e9))
        rows.append(("", "fused/torch", res["torch"][0] / res["fused"][0],
                     None, res["torch"][1] / res["fused"][1], f"max|diff| {diff:.2e}"))
    return rows


def host_us(fn):
    """Host time per call of a cached call (the GPU kept busy: its time is not measured)."""
    return timing.host_us(fn, calls=50, trials=7, warmup=20, busy_gpu=True)


def overhead_rows(dtype):
    b, s, h, d = 1, 64, 4, 64
    q, k, v = inputs(b, s, h, d, dtype)
    qi, ki, vi = (x.detach() for x in (q, k, v))
    p_grad = params_for(b, s, h, d, True, dtype, True)
    p_inf = params_for(b, s, h, d, True, dtype, False)
    fused.not_supported_reasons(p_grad)
    fused.not_supported_reasons(p_inf)
    call = fused.FusedCall("bshd", "bshd", s, s, "causal", -1, 0, 1 / math.sqrt(d), 0.0, False,
                           False)
    rows = []
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        with torch.no_grad():
            rows.append(("forward, no grad", host_us(lambda: ours(qi, ki, vi, p_inf)),
                         host_us(lambda: theirs(qi, ki, vi, True))))
            rows.append(("  via torch.ops (compile path)",
                         host_us(lambda: torch.ops.transformer_fa.fused_attn_fwd(
                             qi, ki, vi, None, None, None, None, *call)), None))
            fused.CACHE.fast_execute = False
            fused.clear_cache()
            fused.not_supported_reasons(p_inf)
            rows.append(("  with public pygraph.execute",
                         host_us(lambda: ours(qi, ki, vi, p_inf)), None))
            fused.CACHE.fast_execute = True
            fused.clear_cache()
            fused.not_supported_reasons(p_inf)
            fused.not_supported_reasons(p_grad)
        rows.append(("forward, grad enabled", host_us(lambda: ours(q, k, v, p_grad)),
                     host_us(lambda: theirs(q, k, v, True))))
        g = torch.ones(b, s, h * d, device="cuda", dtype=dtype)
        fb_ours = lambda: ours(q, k, v, p_grad).backward(g)  # noqa: E731
        fb_theirs = lambda: theirs(q, k, v, True).backward(  # noqa: E731
            g.view(b, s, h, d).transpose(1, 2))
        rows.append(("forward + backward", host_us(fb_ours), host_us(fb_theirs)))
        rows.append(("  (GPU time of forward + backward)", bench(fb_ours) * 1e3,
                     bench(fb_theirs) * 1e3))
    try:
        import transformer_fa as tfa
        dpa = tfa.DotProductAttention(h, d, qkv_format="bshd", attn_mask_type="causal").cuda()
        with torch.no_grad():
            dpa(qi, ki, vi)
            rows.append((f"DotProductAttention, no grad ({dpa.last_backend})",
                         host_us(lambda: dpa(qi, ki, vi)), None))
    except Exception as exc:  # the core may be in flux
        rows.append((f"DotProductAttention failed: {type(exc).__name__}: {exc}"[:100], None, None))
    return rows


def main():
    logging.basicConfig(level=logging.WARNING)
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | torch cuDNN "
          f"{torch.backends.cudnn.version()} | {fused.versions()}")
    log = logging.getLogger("DotProductAttention")
    log.setLevel(logging.DEBUG)
    handler = logging.StreamHandler(sys.stdout)
    log.addHandler(handler)
    dtype = torch.bfloat16
    shapes = [(4, 4096, 16, 128, True), (4, 4096, 16, 128, False), (16, 1024, 32, 64, False)]
    rows = speed_rows(shapes, dtype)
    log.removeHandler(handler)
    print("\n| shape | impl | fwd ms | fwd TFLOPS | bwd ms | bwd TFLOPS |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = [r[0], r[1]] + [("" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x))
                                for x in r[2:]]
        print("| " + " | ".join(cells) + " |")
    print("\n(fused/torch rows: speed ratio, > 1 means FusedAttention is faster)")
    print("\n| host time per call, b1 s64 h4 d64 bf16 causal | fused us | torch cuDNN us |")
    print("|---|---|---|")
    for name, a, b in overhead_rows(dtype):
        print(f"| {name} | {'' if a is None else f'{a:.1f}'} | {'' if b is None else f'{b:.1f}'} |")


if __name__ == "__main__":
    main()
