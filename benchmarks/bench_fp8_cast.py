"""The FP8 cast kernel (transformer_fa/kernels/fp8_cast.py) at the calls a TransformerLayer
step makes, against its tile choices: which tile each kind of call should take.

    python benchmarks/bench_fp8_cast.py      # on a GPU with FP8 and triton, ~1 minute

It runs one forward + backward of the layer benchmark's block (hidden 2048, 16 heads, ffn 8192,
b=2, s=4096, bf16) under each FP8 recipe with the cast launcher wrapped, so that it records
every distinct cast call (shape, dtype, orientations, activation, column sums, amax). Then it
times each recorded call alone (benchmarks/timing.py, L2 flushed) at each candidate tile and
reports GB/s (bytes read + written) and the best tile against the one the launcher chose.
Writes benchmarks/results/<gpu>-<date>-fp8-cast.json and .md.
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
from benchmarks.bench_attention import tfa_layer  # noqa: E402
import transformer_fa as tfa  # noqa: E402
from transformer_fa.kernels import fp8_cast  # noqa: E402

# (BLOCK_R, BLOCK_C, num_warps)
ROW_TILES = [(16, 512, 8), (8, 1024, 8), (32, 256, 8), (16, 1024, 16)]
SQUARE_TILES = [(128, 64, 4), (64, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4),
                (128, 32, 4), (64, 64, 2), (64, 128, 8)]


def record_calls():
    """The distinct cast launches of one FP8 layer step per recipe: {key: call kwargs}."""
    calls = {}
    real_launch = fp8_cast._launch

    def recording(x, out, out_t, scale, scale_from_amax, scale_inv, amax, fp8_max, tile,
                  dbias=False, gelu=False, dgelu_input=None):
        key = (tuple(x.shape), str(x.dtype).split(".")[-1], out is not None, out_t is not None,
               bool(scale_from_amax), scale_inv is not None, amax is not None, dbias, gelu,
               dgelu_input is not None, str((out if out is not None else out_t).dtype)
               .split(".")[-1] if (out is not None or out_t is not None) else None)
        calls.setdefault(key, dict(tile=tile, count=0))
        calls[key]["count"] += 1
        return real_launch(x, out, out_t, scale, scale_from_amax, scale_inv, amax, fp8_max,
                           tile, dbias=dbias, gelu=gelu, dgelu_input=dgelu_input)

    fp8_cast._launch = recording
    triton_only = os.environ.get("TRANSFORMER_FA_FP8_CAST")
    os.environ["TRANSFORMER_FA_FP8_CAST"] = "triton"  # every call through _launch, recorded
    try:
        for recipe in (tfa.common.recipe.DelayedScaling, tfa.common.recipe.Float8CurrentScaling):
            block = tfa_layer(2048, 16, 8192, torch.bfloat16, "cuda")
            x = torch.randn(2, 4096, 2048, device="cuda", dtype=torch.bfloat16)
            for _ in range(2):  # the second step: delayed scaling's steady state
                with tfa.autocast(enabled=True, recipe=recipe()):
                    y = block(x)
                y.float().square().mean().backward()
            torch.cuda.synchronize()
    finally:
        fp8_cast._launch = real_launch
        if triton_only is None:
            del os.environ["TRANSFORMER_FA_FP8_CAST"]
        else:
            os.environ["TRANSFORMER_FA_FP8_CAST"] = triton_only
    return calls


def time_call(key, tile, two_pass=False):
    """(ms, GB/s) of the call at ``tile``; with ``two_pass`` (a call with both orientations)
    as the launcher's two passes instead: the row-major output on the row tile, then the
    transposed one alone on ``tile`` (Triton transposes 16-bit data cheaply in a kernel that
    stores only the transpose, FP8 bytes slowly in one that stores both); with ``tile`` "cuda"
    on the CUDA kernels (csrc/fp8/: cast-transpose, or amax for an amax pass; None where they
    do not serve the call)."""
    shape, dtype, rowwise, columnwise, from_amax, scale_inv, amax, dbias, gelu, dgelu, fp8 = key
    dt = getattr(torch, dtype)
    x = torch.randn(shape, device="cuda", dtype=dt)
    h = torch.randn(shape, device="cuda", dtype=dt) if dgelu else None
    f8 = getattr(torch, fp8) if fp8 else torch.float8_e4m3fn
    out = torch.empty(shape, device="cuda", dtype=f8) if rowwise else None
    out_t = torch.empty(shape[::-1], device="cuda", dtype=f8) if columnwise else None
    scalar = torch.ones((), device="cuda", dtype=torch.float32)
    amax_slot = torch.zeros(1, device="cuda", dtype=torch.float32) if amax else None
    s_inv = torch.empty((), device="cuda", dtype=torch.float32) if scale_inv else None

    def run():
        fp8_cast._launch(x, out, out_t, scalar, from_amax, s_inv, amax_slot, 448.0, tile,
                         dbias=dbias, gelu=gelu, dgelu_input=h)

    if tile == "cuda" and not (rowwise or columnwise or dbias):  # an amax pass
        kernel = fp8_cast._cuda_fp8_kernel("fp8_amax", x, h)
        if kernel is None:
            return None

        def run():  # noqa: F811 (the CUDA kernel instead)
            kernel(x, h, amax_slot, gelu)
    elif tile == "cuda":
        fp8_max = torch.finfo(f8).max
        kernel = fp8_cast._cuda_cast_transpose(x, h, columnwise, f8, fp8_max)
        if kernel is None:
            return None
        sums = (torch.empty((-(-shape[0] // fp8_cast._CUDA_TILE_ROWS), shape[1]),
                            device="cuda") if dbias else None)

        def run():  # noqa: F811 (the CUDA kernel instead)
            kernel(x, h, out, out_t, scalar, from_amax, fp8_max, s_inv, amax_slot, sums, gelu)

    def run_two_passes():
        fp8_cast._launch(x, out, None, scalar, from_amax, s_inv, amax_slot, 448.0,
                         fp8_cast._ROW_TILE, gelu=gelu, dgelu_input=h)
        fp8_cast._launch(x, None, out_t, scalar, from_amax, None, None, 448.0, tile,
                         dbias=dbias, gelu=gelu, dgelu_input=h)

    ms = timing.median_ms(run_two_passes if two_pass else run)
    n = x.numel()
    moved = n * x.element_size() * (2 if dgelu else 1) + n * (int(rowwise) + int(columnwise))
    return ms, moved / ms / 1e6  # GB/s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    if not tfa.is_fp8_available():
        sys.exit("bench_fp8_cast.py needs a GPU with FP8 (and triton): "
                 + tfa.is_fp8_available(return_reason=True)[1])
    calls = record_calls()
    gpu = torch.cuda.get_device_name()
    rows = []
    for key, info in calls.items():
        results = {}
        transposed_or_sums = key[3] or key[7]
        for tile in SQUARE_TILES if transposed_or_sums else ROW_TILES + SQUARE_TILES[:3]:
            try:
                results[str(tile)] = time_call(key, tile)
            except Exception as exc:  # a tile too large for the shared memory
                results[str(tile)] = (None, repr(exc)[:80])
        if key[2] and key[3]:  # both orientations: also as two passes
            for tile in SQUARE_TILES[:4]:
                results[f"two passes {tile}"] = time_call(key, tile, two_pass=True)
        cuda = time_call(key, "cuda")
        if cuda is not None:
            results["cuda"] = cuda
        timed = {t: r for t, r in results.items() if r[0] is not None}
        best = min(timed, key=lambda t: timed[t][0])
        chosen = "cuda" if cuda is not None else str(info["tile"])
        rows.append(dict(call=key, count=info["count"], chosen=chosen,
                         chosen_us=round(timed[chosen][0] * 1e3, 1) if chosen in timed else None,
                         best=best, best_us=round(timed[best][0] * 1e3, 1),
                         best_gbs=round(timed[best][1]),
                         all_us={t: round(r[0] * 1e3, 1) for t, r in timed.items()}))
        print(rows[-1], flush=True)
    data = dict(gpu=gpu, date=datetime.date.today().isoformat(), torch=torch.__version__,
                rows=rows)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"{gpu.replace(' ', '-')}-{data['date']}-fp8-cast"
    base.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    lines = [f"## FP8 cast kernel tiles ({gpu}, {data['date']}, torch {torch.__version__})", "",
             "Each distinct cast call of one FP8 TransformerLayer step (both recipes), timed "
             "alone with L2 flushed (\"two passes\": the row-major output, then the transposed one "
             "alone on that tile; \"cuda\": the CUDA cast-transpose kernel, which the launcher "
             "takes where it serves the call). Key: shape, dtype, rowwise, columnwise, scale "
             "from amax, "
             "writes scale_inv, records amax, dbias, gelu, dgelu, FP8 dtype.", "",
             "| call | calls in 4 steps | chosen tile | µs | best tile | µs | GB/s |",
             "|---|---:|---|---:|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['call']} | {r['count']} | {r['chosen']} | {r['chosen_us']} | "
                     f"{r['best']} | {r['best_us']} | {r['best_gbs']} |")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("wrote", base.with_suffix(".json"))


if __name__ == "__main__":
    main()
