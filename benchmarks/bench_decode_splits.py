"""The split-KV decode kernel at each number of splits, beside the split count it chooses and
torch's cuDNN attention: where the choice (csrc/flash/sm80/decode_launch.cuh,
choose_decode_splits) leaves streaming rate on the table.

    python benchmarks/bench_decode_splits.py --out-dir $OUT     # on a GPU, ~1-2 min

Rows: bench_attention.py's decode grid (one query token, 32 / 8 heads, d128, bf16, a
contiguous cache; ``--page-size`` reads it as shuffled pages), through
``flash_attn_with_kvcache`` (no DotProductAttention host path: the kernels' time). Cells: K+V
TB read per second, median of CUDA-event timings with the L2 flushed (benchmarks/timing.py).
Writes <gpu>-<date>-decode-splits.json and .md to --out-dir.
"""
import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import timing  # noqa: E402
from benchmarks.bench_attention import PRESETS, peer_fn, shuffled_page_pools  # noqa: E402

SPLITS = (1, 2, 4, 8, 16, 32, 64, 128)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--page-size", type=int, default=0, help="read the cache as pages of this "
                    "many tokens in a shuffled order (0: contiguous)")
    ap.add_argument("--batches", help="comma list (default: the full preset's)")
    ap.add_argument("--seqlens", help="comma list (default: the full preset's)")
    ap.add_argument("--splits", default=",".join(map(str, SPLITS)),
                    help="comma list of forced split counts (empty: the chosen one only)")
    ap.add_argument("--tag", default="", help="suffix of the result files' name")
    args = ap.parse_args(argv)
    splits = tuple(int(x) for x in args.splits.split(",") if x.strip())
    if not torch.cuda.is_available():
        sys.exit("bench_decode_splits.py needs a CUDA GPU")
    import transformer_fa as tfa
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv, d, batches, seqlens = PRESETS["full"].decode
    batches = [int(x) for x in args.batches.split(",")] if args.batches else batches
    seqlens = [int(x) for x in args.seqlens.split(",")] if args.seqlens else seqlens
    torch.manual_seed(0)
    rows = []
    for b in batches:
        for sk in seqlens:
            kv_bytes = 2 * b * sk * hkv * d * 2
            if kv_bytes > torch.cuda.mem_get_info()[0] / 2:
                continue
            q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))
            caches, table = ((k, v), None) if not args.page_size else \
                shuffled_page_pools(k, v, args.page_size)
            lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
            row = dict(b=b, sk=sk, page_size=args.page_size)

            def tb_per_s(fn):
                return round(kv_bytes / timing.median_ms(fn) / 1e9, 3)

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                row["cudnn"] = tb_per_s(peer_fn(q, k, v, False))
            row["chosen"] = tb_per_s(lambda: tfa.flash_attn_with_kvcache(
                q, *caches, cache_seqlens=lens, block_table=table))
            for s in splits:
                if s * 16 * 4 <= sk:  # at least one chunk a warp
                    row[s] = tb_per_s(lambda: tfa.flash_attn_with_kvcache(
                        q, *caches, cache_seqlens=lens, block_table=table, num_splits=s))
            rows.append(row)
            print(f"b={b} sk={sk}: cudnn {row['cudnn']}, chosen {row['chosen']} "
                  f"({row['chosen'] / row['cudnn']:.3f}x); " +
                  " ".join(f"{s}:{row[s]}" for s in splits if s in row), flush=True)
            q = k = v = caches = None
            torch.cuda.empty_cache()

    name = torch.cuda.get_device_name().replace(" ", "-")
    date = datetime.date.today().isoformat()
    tag = (f"-paged{args.page_size}" if args.page_size else "") + \
        (f"-{args.tag}" if args.tag else "")
    base = Path(args.out_dir) / f"{name}-{date}-decode-splits{tag}"
    base.parent.mkdir(parents=True, exist_ok=True)
    data = dict(gpu=torch.cuda.get_device_name(), date=date, torch=torch.__version__,
                hq=hq, hkv=hkv, d=d, rows=rows)
    base.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    layout = f"pages of {args.page_size}, shuffled" if args.page_size else "contiguous"
    lines = [f"## Decode split counts: {data['gpu']}, {date}", "",
             f"torch {torch.__version__}; one query token, {hq} / {hkv} heads, d{d}, bf16, "
             f"{layout} cache; K+V TB/s (median, L2 flushed).", "",
             "| " + " | ".join(["b", "sk", "torch cuDNN", "chosen"] +
                               [f"{s} splits" for s in splits]) + " |",
             "|---" * (4 + len(splits)) + "|"]
    for r in rows:
        cells = [r["b"], r["sk"], r["cudnn"], r["chosen"]] + [r.get(s, "") for s in splits]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
