"""Forward TFLOPS of transformer_fa's flash kernels (each tile variant) vs torch SDPA's
FLASH_ATTENTION backend (FlashAttention-2), on the standard grid: bf16, d 64/128, causal and
not, s 1k/4k/16k, batch*s = 16k, hidden 2048 (heads = 2048 / d).

    python benchmarks/bench_flash.py [--variants 0,1,2,3,4] [--json out.json]

FLOPs (FlashAttention convention): 4*b*h*s*s*d, halved for causal. Times: CUDA events
through triton.testing.do_bench, median, after warm-up, on random data.
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformer_fa.attention.backends import flash  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="0,1,2,3,4")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = [int(x) for x in args.variants.split(",")]
    assert flash._extension() is not None, flash._ext_error
    dev = "cuda"
    rows = []
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    for d in [int(x) for x in args.dims.split(",")]:
        for causal in (False, True):
            for s in [int(x) for x in args.seqlens.split(",")]:
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
                           for _ in range(3))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                scale = 1 / math.sqrt(d)
                row = {"d": d, "causal": causal, "s": s, "b": b, "h": h}
                qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    ms = do_bench(lambda: F.scaled_dot_product_attention(
                        qt, kt, vt, is_causal=causal), warmup=50, rep=200,
                        return_mode="median")
                row["sdpa_fa2"] = flops / ms / 1e9
                for var in variants:
                    fn = lambda: flash._fwd_impl(q, k, v, None, None, "bshd", "bshd", s, s,  # noqa
                                                 scale, -1, 0 if causal else -1, False, False,
                                                 var)
                    out = fn()[0]
                    err = (out.float() - ref.transpose(1, 2).float()).abs().max().item()
                    ms = do_bench(fn, warmup=50, rep=200, return_mode="median")
                    row[f"v{var}"] = flops / ms / 1e9
                    row[f"v{var}_maxdiff_vs_sdpa"] = err
                rows.append(row)
                cols = " ".join(f"v{var}={row[f'v{var}']:6.1f}" for var in variants)
                print(f"d={d:3d} causal={int(causal)} s={s:5d} b={b:2d} h={h:2d} "
                      f"FA2={row['sdpa_fa2']:6.1f} {cols} TFLOPS "
                      f"(max|diff| vs FA2 {max(row[f'v{v}_maxdiff_vs_sdpa'] for v in variants):.3g})",
                      flush=True)
                del q, k, v, qt, kt, vt, ref
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
