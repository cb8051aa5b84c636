"""A/B of a temporary environment switch in the flash kernels' launch code, in one process:
every row is timed once per switch value in each pass (the order reversed on every other pass,
so that neither value always runs first), beside torch's CUDNN_ATTENTION on the same row. For
kernel work on the GPU machine (docs/flash_kernel_notes.md has the runs it made):

    python tools/flash_switch_ab.py bwd VAR 0 1 [--dims 64,128] [--seqs 1024,4096,16384]
    python tools/flash_switch_ab.py fwd VAR 0 1 [--passes 3]
    python tools/flash_switch_ab.py decode VAR 0 1

The launch code must read the switch at each call (std::getenv in the launch): setting
os.environ between calls then picks the variant. Rows: bwd / fwd the benchmark grid's (bf16,
batch * s = 16384, hidden 2048, causal and not), the extension called directly (as
tools/flash_kernel_check.py does), TFLOPS by the FlashAttention convention; decode one query
token against a contiguous cache and the same cache through a shuffled block table of
--page-size keys (32 query / 8 KV heads, d128, cache_seqlens given), CUDA-graph timed, K + V
TB/s. Each row also prints the largest difference of each value's outputs from the first
value's (0 where a switch must not change results). Last, the best of the passes per row and
its ratio to cuDNN; --json writes every measurement.
"""
import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("bwd", "fwd", "decode"))
    ap.add_argument("var", help="the environment variable the launch code reads")
    ap.add_argument("values", nargs="+", help="its values, the first the reference")
    ap.add_argument("--dims", default="64,128", help="bwd / fwd head dims")
    ap.add_argument("--seqs", default="1024,4096,16384", help="bwd / fwd sequence lengths")
    ap.add_argument("--decode-rows", default="1:4096,1:32768,8:32768,32:16384,128:4096",
                    help="decode rows as batch:cache_len, comma separated")
    ap.add_argument("--page-size", type=int, default=64, help="decode's paged rows")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args(argv)
    if args.passes < 1:
        ap.error("--passes must be at least 1")
    return args


def pass_order(values, pass_index):
    """The values in the order a pass times them: as given, reversed on every other pass."""
    return list(values) if pass_index % 2 == 0 else list(reversed(values))


def summarize(results, values, unit):
    """Lines of the best of the passes per row (results: {row label: {variant: [measurements]}},
    the variants the switch values and "cudnn") with each value's ratio to cuDNN's best."""
    lines = [f"best of passes ({unit}), ratio to cuDNN"]
    for row, by_variant in results.items():
        peer = max(by_variant["cudnn"])
        cells = []
        for value in values:
            for variant in sorted(v for v in by_variant if v.split(" ")[0] == value):
                best = max(by_variant[variant])
                cells.append(f"{variant}: {best:.3g} ({best / peer:.3f}x)")
        lines.append(f"{row} | " + " | ".join(cells) + f" | cudnn: {peer:.3g}")
    return lines


def _grid_rows(args):
    for d in map(int, args.dims.split(",")):
        for causal in (False, True):
            for s in map(int, args.seqs.split(",")):
                yield d, causal, s


def _max_diff(ref, other):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(ref, other))


def run_attention(args, record):
    """bwd / fwd rows: the extension's call per switch value, then torch's cuDNN."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import transformer_fa_flash as ext
    from benchmarks.timing import median_ms

    for p in range(args.passes):
        for d, causal, s in _grid_rows(args):
            b, h = 16384 // s, 2048 // d
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(4))
            scale, right = 1 / math.sqrt(d), (0 if causal else -1)
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            fwd = lambda: ext.fwd(q, k, v, None, None, 0, 0, s, s, scale, -1, right, False, True)
            out, lse = fwd()
            bwd = lambda: ext.bwd(do, q, k, v, out, lse, None, None, 0, 0, s, s, scale, -1,
                                  right, False)
            call, flops = (bwd, 2.5 * flops) if args.kind == "bwd" else (fwd, flops)
            row = f"d{d} causal={int(causal)} s{s}"
            outputs = {}
            for value in pass_order(args.values, p):
                os.environ[args.var] = value
                outputs[value] = call()
                record(row, value, flops / median_ms(call) / 1e9)
            qt, kt, vt = (x.transpose(1, 2).requires_grad_() for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                peer = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                if args.kind == "bwd":
                    o = peer()
                    peer_bwd = lambda: torch.autograd.grad(o, (qt, kt, vt), do.transpose(1, 2),
                                                           retain_graph=True)
                    record(row, "cudnn", flops / median_ms(peer_bwd) / 1e9)
                else:
                    record(row, "cudnn", flops / median_ms(peer) / 1e9)
            diffs = [_max_diff(outputs[args.values[0]], outputs[v]) for v in args.values[1:]]
            print(f"pass {p} {row} max diff from {args.values[0]}: {diffs}", flush=True)


def run_decode(args, record):
    """decode rows: flash_attn_with_kvcache contiguous and paged per switch value, then cuDNN."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import transformer_fa as tfa
    from benchmarks.bench_attention import shuffled_page_pools
    from benchmarks.timing import graph_median_ms

    hq, hkv, d = 32, 8, 128
    for p in range(args.passes):
        for spec in args.decode_rows.split(","):
            b, sk = map(int, spec.split(":"))
            q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            tb = 2 * b * sk * hkv * d * 2 / 1e12
            lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
            pools, table = shuffled_page_pools(k, v, args.page_size)
            calls = {"contiguous": lambda: tfa.flash_attn_with_kvcache(
                         q, k, v, cache_seqlens=lens),
                     f"paged{args.page_size}": lambda: tfa.flash_attn_with_kvcache(
                         q, *pools, cache_seqlens=lens, block_table=table)}
            row = f"b{b} sk{sk}"
            outputs = {}
            for value in pass_order(args.values, p):
                os.environ[args.var] = value
                outputs[value] = [fn() for fn in calls.values()]
                for name, fn in calls.items():
                    record(row, f"{value} {name}", tb / graph_median_ms(fn) * 1e3)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                peer = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
                record(row, "cudnn", tb / graph_median_ms(peer) * 1e3)
            diffs = [_max_diff(outputs[args.values[0]], outputs[v]) for v in args.values[1:]]
            print(f"pass {p} {row} max diff from {args.values[0]}: {diffs}", flush=True)
            q = k = v = pools = table = outputs = None  # freed before the next row's cache
            torch.cuda.empty_cache()


def main(argv=None):
    args = parse_args(argv)
    sys.path[:0] = [str(ROOT)]
    results = {}

    def record(row, variant, value):
        results.setdefault(row, {}).setdefault(variant, []).append(value)
        print(f"  {row} {variant}: {value:.4g}", flush=True)

    (run_decode if args.kind == "decode" else run_attention)(args, record)
    unit = "TB/s" if args.kind == "decode" else "TFLOPS"
    print("\n".join(summarize(results, args.values, unit)))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(kind=args.kind, var=args.var,
                                                   values=args.values, unit=unit,
                                                   results=results), indent=1))


if __name__ == "__main__":
    main()
