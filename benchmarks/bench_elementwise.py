"""The Triton kernels (transformer_fa/kernels) against the PyTorch paths they replace.

    python benchmarks/bench_elementwise.py      # on a GPU with triton, ~1 minute

ms per forward + backward call (median, benchmarks/timing.py) of LayerNorm and RMSNorm at
hidden 2048 and 8192 (8192 tokens, the layer benchmark's b=2 x s=4096) and of RoPE on q at the
layer benchmark's shapes (sbhd, s=4096, b=2, 16 heads, d=128), in bf16. The PyTorch path is
the same call with TRANSFORMER_FA_TRITON_KERNELS=0. Writes benchmarks/results/<gpu>-<date>-elementwise
.json and .md.
"""
import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import timing  # noqa: E402
from transformer_fa.attention.rope import (RotaryPositionEmbedding,  # noqa: E402
                                           apply_rotary_pos_emb)
from transformer_fa.module.layernorm import apply_norm  # noqa: E402

TOKENS, HEADS, HEAD_DIM, BATCH = 8192, 16, 128, 2
DTYPE = torch.bfloat16


def norm_case(normalization, hidden):
    x = torch.randn(TOKENS, hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    weight = torch.ones(hidden, device="cuda", dtype=DTYPE, requires_grad=True)
    bias = (torch.zeros(hidden, device="cuda", dtype=DTYPE, requires_grad=True)
            if normalization == "LayerNorm" else None)
    dy = torch.randn_like(x)

    def step():
        apply_norm(x, normalization, weight, bias, 1e-5, False).backward(dy)

    return step, [t for t in (x, weight, bias) if t is not None]


def rope_case(interleaved):
    s = TOKENS // BATCH
    q = torch.randn(s, BATCH, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=True)
    freqs = RotaryPositionEmbedding(HEAD_DIM, interleaved=interleaved)(s)
    dy = torch.randn_like(q)

    def step():
        apply_rotary_pos_emb(q, freqs, "sbhd", interleaved=interleaved, fused=True).backward(dy)

    return step, [q]


def time_both(step, grads):
    """The kernels at every size (TRANSFORMER_FA_FUSED_NORM=1: the norm kernel also where the
    modules keep PyTorch's), then the PyTorch path."""
    times = {}
    for path, setting in (("triton", "1"), ("pytorch", "0")):
        os.environ["TRANSFORMER_FA_TRITON_KERNELS"] = setting
        os.environ["TRANSFORMER_FA_FUSED_NORM"] = setting
        times[path] = timing.median_ms(step, grad_to_none=grads)
    os.environ.pop("TRANSFORMER_FA_TRITON_KERNELS")
    os.environ.pop("TRANSFORMER_FA_FUSED_NORM")
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_elementwise.py needs a CUDA GPU (and triton)")
    cases = [(f"{n} fwd+bwd", f"tokens={TOKENS} hidden={h}", norm_case(n, h))
             for n in ("LayerNorm", "RMSNorm") for h in (2048, 8192)]
    shape = f"sbhd s={TOKENS // BATCH} b={BATCH} h={HEADS} d={HEAD_DIM}"
    cases += [(f"RoPE{' interleaved' if i else ''} fwd+bwd", shape, rope_case(i))
              for i in (False, True)]
    rows = []
    for name, shape, (step, grads) in cases:
        times = time_both(step, grads)
        rows.append(dict(op=name, shape=shape, dtype="bf16", triton_ms=times["triton"],
                         pytorch_ms=times["pytorch"],
                         speedup=times["pytorch"] / times["triton"]))
        print(f"{name:24s} {shape:34s} triton {times['triton']:.3f} ms  "
              f"pytorch {times['pytorch']:.3f} ms  x{rows[-1]['speedup']:.2f}")
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    stem = Path(args.out_dir) / f"{gpu}-{datetime.date.today()}-elementwise"
    stem.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                torch=torch.__version__)
    stem.with_suffix(".json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    lines = [f"# Elementwise kernels, {meta['gpu']}, {meta['date']}, torch {meta['torch']}", "",
             "| op | shape | dtype | Triton ms | PyTorch ms | speedup |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['shape']} | {r['dtype']} | {r['triton_ms']:.3f} | "
              f"{r['pytorch_ms']:.3f} | {r['speedup']:.2f}x |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
