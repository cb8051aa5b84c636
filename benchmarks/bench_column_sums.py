"""The bias-gradient column sums (transformer_fa/kernels/bias_grad.py) at the layer step's
shapes, swept over their launch settings, beside torch's sum.

    python benchmarks/bench_column_sums.py --out-dir $OUT     # on a GPU with triton, ~2 min

Shapes: the layer benchmark's bias gradients (8192 tokens: QKV 6144 and proj / FC2 2048
columns: ``column_sum``; FC1's 8192 columns with GELU's backward: ``dgelu_column_sum``), bf16.
Each setting (``ColumnSumTiles``: rows a block, warps, pipeline stages, programs per SM) is
timed with the L2 flushed (benchmarks/timing.py, median); TB/s counts the bytes read and
written once. Writes <gpu>-<date>-column-sums.json and .md to --out-dir, the best setting of
each shape and the current default (``TILES``) first.
"""
import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import timing  # noqa: E402

TOKENS = 8192
SHAPES = (("column_sum", 6144), ("column_sum", 2048), ("dgelu_column_sum", 8192))
SWEEP = dict(block_r=(32, 64), num_warps=(4, 8), stages=(1, 2, 3), programs_per_sm=(2, 4, 8))


def settings(default):
    """The default first, then every setting of SWEEP (2-byte rows a block; columns 128)."""
    yield default
    for block_r, warps, stages, per_sm in itertools.product(*SWEEP.values()):
        tiles = default._replace(block_r={**default.block_r, 2: block_r}, num_warps=warps,
                                 stages=stages, programs_per_sm=per_sm)
        if tiles != default:
            yield tiles


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_column_sums.py needs a CUDA GPU (the Triton kernels run there)")
    from transformer_fa.kernels import bias_grad

    torch.manual_seed(0)
    rows = []
    for kind, cols in SHAPES:
        g = torch.randn(TOKENS, cols, device="cuda", dtype=torch.bfloat16)
        h = torch.randn_like(g) if kind == "dgelu_column_sum" else None
        moved = g.numel() * g.element_size() * (3 if h is not None else 1)  # g (h, dh) once
        if h is None:
            peer = timing.median_ms(lambda: g.sum(0))
        else:  # torch's path: gelu_backward, then the sum
            peer = timing.median_ms(
                lambda: torch.ops.aten.gelu_backward(g, h, approximate="tanh").sum(0))
        rows.append(dict(kind=kind, cols=cols, tiles="torch", us=round(peer * 1e3, 1),
                         tb_per_s=round(moved / peer / 1e9, 2)))
        print(f"{kind} {TOKENS}x{cols}: torch {peer * 1e3:.1f} us", flush=True)
        for tiles in settings(bias_grad.TILES):
            def run():
                bias_grad._column_sums(g, h, g.dtype, tiles)
            ms = timing.median_ms(run)
            rec = dict(kind=kind, cols=cols, tiles=tiles._asdict(),
                       default=tiles == bias_grad.TILES, us=round(ms * 1e3, 1),
                       tb_per_s=round(moved / ms / 1e9, 2))
            rows.append(rec)
            print(f"  {rec['us']:7.1f} us {rec['tb_per_s']:5.2f} TB/s  "
                  f"r{tiles.block_r[2]} w{tiles.num_warps} st{tiles.stages} "
                  f"p{tiles.programs_per_sm}{'  (default)' if rec['default'] else ''}", flush=True)
        g = h = None

    name = torch.cuda.get_device_name().replace(" ", "-")
    date = datetime.date.today().isoformat()
    base = Path(args.out_dir) / f"{name}-{date}-column-sums"
    base.parent.mkdir(parents=True, exist_ok=True)
    data = dict(gpu=torch.cuda.get_device_name(), date=date, torch=torch.__version__,
                tokens=TOKENS, rows=rows)
    base.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [f"## Bias-gradient column sums: {data['gpu']}, {date}", "",
             f"torch {torch.__version__}, bf16, {TOKENS} rows; kernel time with the L2 flushed "
             "(median); TB/s of the bytes read and written once. Settings: rows a block, "
             "warps, pipeline stages, programs per SM.", "",
             "| kernel | columns | torch us | default us (TB/s) | best us (TB/s) | best setting |",
             "|---|---|---|---|---|---|"]
    for kind, cols in SHAPES:
        mine = [r for r in rows if r["kind"] == kind and r["cols"] == cols]
        peer = next(r for r in mine if r["tiles"] == "torch")
        ours = [r for r in mine if r["tiles"] != "torch"]
        default = next(r for r in ours if r["default"])
        best = min(ours, key=lambda r: r["us"])
        t = best["tiles"]
        lines.append(f"| {kind} | {cols} | {peer['us']} | {default['us']} "
                     f"({default['tb_per_s']}) | {best['us']} ({best['tb_per_s']}) | "
                     f"r{t['block_r'][2]} w{t['num_warps']} st{t['stages']} "
                     f"p{t['programs_per_sm']} |")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
