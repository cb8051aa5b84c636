"""Distributed benchmarks: context-parallel attention and a tensor-parallel TransformerLayer stack.

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py        # NCCL, one GPU per rank
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --parts cp --seqlens 32768
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --tiny --device cpu   # smoke test

- ``cp``: causal attention forward and forward+backward (DotProductAttention, bshd, bf16) at
  each sequence length, on one GPU without CP (every rank runs it alone on its own GPU; the
  slowest counts) and with CP over all ranks for each --comm-types (TE's load-balanced parts).
- ``tp``: a TransformerLayer stack's training step (forward, backward, AdamW) on one GPU and
  with TP over all ranks (with and without sequence parallelism), at the same global batch.

Times are medians of fixed repetition counts (every rank runs the same number of collective
calls), taken as the slowest rank's; peak memory is the largest over the ranks. CP rows whose
attention scores would not fit the free memory (where CP's blocks run the PyTorch math, not
the flash kernels) are skipped with the estimate as the reason (a rank that runs out of memory
inside a collective would leave the others waiting). Rank 0
writes benchmarks/results/<gpu>-x<ranks>-<date>-distributed.json and .md.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

# NVLink SHARP (multicast) stays off unless the caller asks for it: see the device notes.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import report, timing  # noqa: E402
from benchmarks.bench_attention import (attn_flops, cudnn_version, describe,  # noqa: E402
                                        gpu_name, import_tfa, log_row)

K = 1024


@dataclasses.dataclass(frozen=True)
class Preset:
    seqlens: tuple  # cp: sequence lengths
    attn: tuple  # cp: (batch, q heads, kv heads, head dim)
    layer: tuple  # tp: (layers, batch, seqlen, hidden, heads, kv heads, ffn)
    warmup: int  # untimed runs before each measurement
    reps: int  # timed runs (the median counts)


PRESETS = {
    "full": Preset((32 * K, 64 * K, 128 * K, 256 * K), (1, 8, 8, 128),
                   (4, 2, 4 * K, 4096, 32, 8, 16384), 2, 5),
    "tiny": Preset((16, 32), (1, 4, 2, 8), (2, 2, 16, 32, 4, 2, 64), 1, 2),
}
# Where CP's blocks run the PyTorch math (not the flash kernels), float32 scores and their
# temporaries, forward and backward, take about this many bytes per score of the largest block.
BYTES_PER_SCORE = 24


class Skip(Exception):
    """A row that is not run; the message is the reason recorded."""


def init(device: str):
    """The process group (torchrun's environment; one that the caller started is used as it
    is) and this rank's device."""
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=10))
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else \
        torch.device("cpu")


def all_max(value: float, device) -> float:
    """The largest of every rank's value (every rank gets it)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def step_ms(fn, preset, device) -> float:
    """Median time of fn in ms over a fixed number of runs, the slowest rank's (timing.once_ms
    on CUDA; wall time on CPU)."""
    for _ in range(preset.warmup):
        fn()
    times = []
    for _ in range(preset.reps):
        if device.type == "cuda":
            times.append(timing.once_ms(fn))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return all_max(statistics.median(times), device)


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device):
    """Peak memory of the row, the largest over the ranks (None on CPU)."""
    if device.type != "cuda":
        return None
    return round(all_max(torch.cuda.max_memory_allocated(), device) / 1e9, 3)


def free_bytes(device) -> float:
    """The least free memory over the ranks (unbounded on CPU)."""
    if device.type != "cuda":
        return float("inf")
    return -all_max(-float(torch.cuda.mem_get_info()[0]), device)


def check_scores_fit(comm, ranks, b, h, s, d, dtype, device):
    """Skip a CP row whose largest block of scores cannot fit (see BYTES_PER_SCORE): p2p's
    own causal block has (s / ranks)^2 scores per head; a2a attends over all s for h / ranks
    heads. One GPU without CP runs a fused backend, and CP blocks on the flash kernels keep
    memory linear in s: no check."""
    from transformer_fa.attention import context_parallel
    if comm is None or context_parallel.blocks_run_on_kernels(dtype, d, device):
        return
    heads, rows = (h, s // ranks) if comm == "p2p" else (h // ranks, s)
    need = BYTES_PER_SCORE * b * heads * rows * rows
    free = free_bytes(device)
    if need > 0.95 * free:
        raise Skip(f"skipped: CP runs the unfused math, whose scores need about "
                   f"{need / 1e9:.0f} GB per GPU; {free / 1e9:.0f} GB free")


def load_balanced_part(x, dim, ranks, rank):
    """TE's CP input: chunks rank and 2*ranks-1-rank of the sequence cut into 2*ranks."""
    chunks = x.chunk(2 * ranks, dim)
    return torch.cat([chunks[rank], chunks[2 * ranks - 1 - rank]], dim)


class Bench:
    def __init__(self, preset, device, dtype):
        self.p, self.device, self.dtype = preset, device, dtype
        self.ranks, self.rank = dist.get_world_size(), dist.get_rank()
        self.group = dist.new_group(list(range(self.ranks)))
        self.data = {"gpu": gpu_name(device.type), "ranks": self.ranks,
                     "backend": dist.get_backend(), "date": datetime.date.today().isoformat(),
                     "torch": torch.__version__, "cudnn": cudnn_version(),
                     "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
                     "cp": [], "tp": []}

    def randn(self, *shape, grad=False):
        return torch.randn(*shape, dtype=self.dtype, device=self.device, requires_grad=grad)

    def run_row(self, part, rec, measure):
        """Fills rec by measure() or records why not; every rank takes the same path (the
        decision to skip is made on values all ranks share)."""
        try:
            reset_peak(self.device)
            measure(rec)
            rec["peak_mem_gb"] = peak_gb(self.device)
        except Exception as exc:  # noqa: BLE001 - recorded as the row's reason (Skip too)
            rec["reason"] = str(exc) if isinstance(exc, Skip) else describe(exc)
        reset_peak(self.device)
        self.data[part].append(rec)
        if self.rank == 0:
            log_row(rec)

    # ------------------------------------------------------------------ context parallelism

    def cp(self, comm_types):
        b, h, hkv, d = self.p.attn
        for s in self.p.seqlens:
            configs = [(None, 1)] + [(comm, self.ranks) for comm in comm_types]
            for comm, ranks in configs:
                rec = dict(case="cp", config=f"CP {comm}" if comm else "1 GPU, no CP",
                           cp_comm_type=comm, gpus=ranks, s=s, b=b, h=h, hkv=hkv, d=d,
                           dtype=str(self.dtype).split(".")[-1], causal=True, backend=None,
                           fwd_ms=None, fwd_bwd_ms=None, tokens_per_s=None,
                           tflops_per_gpu=None, scaling_efficiency=None, peak_mem_gb=None,
                           reason=None)
                self.run_row("cp", rec, lambda r, c=comm, n=ranks: self.measure_cp(r, c, n))
            self.add_efficiency(s)

    def measure_cp(self, rec, comm, ranks):
        b, h, hkv, d, s = rec["b"], rec["h"], rec["hkv"], rec["d"], rec["s"]
        check_scores_fit(comm, ranks, b, h, s, d, self.dtype, self.device)
        te = import_tfa()
        cp = dict(cp_group=self.group, cp_global_ranks=list(range(ranks)),
                  cp_comm_type=comm) if comm else {}
        dpa = te.DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format="bshd",
                                     attn_mask_type="causal", attention_dropout=0.0, **cp)
        local = s // ranks
        torch.manual_seed(0)  # the same full tensors on every rank; each keeps its part
        q, k, v = (self.randn(b, local, heads, d, grad=True) for heads in (h, hkv, hkv))
        dout = self.randn(b, local, h * d)

        def forward():
            return dpa(q, k, v)

        def forward_backward():
            for t in (q, k, v):
                t.grad = None
            forward().backward(dout)

        rec["fwd_ms"] = round(step_ms(forward, self.p, self.device), 3)
        rec["fwd_bwd_ms"] = round(step_ms(forward_backward, self.p, self.device), 3)
        rec["backend"] = dpa.last_backend
        rec["tokens_per_s"] = round(b * s / rec["fwd_bwd_ms"] * 1e3)
        flops = attn_flops(b, h, s, s, d, causal=True) * 3.5  # forward + backward (2.5x)
        rec["tflops_per_gpu"] = round(flops / rec["fwd_bwd_ms"] / 1e9 / ranks, 2)

    def add_efficiency(self, s):
        """tokens/s on N GPUs / (N * tokens/s on one GPU) of the rows at s."""
        rows = [r for r in self.data["cp"] if r["s"] == s]
        one = next((r["tokens_per_s"] for r in rows if r["gpus"] == 1), None)
        for r in rows:
            if one and r["tokens_per_s"] and r["gpus"] > 1:
                r["scaling_efficiency"] = round(r["tokens_per_s"] / (r["gpus"] * one), 3)

    # ------------------------------------------------------------------- tensor parallelism

    def tp(self):
        layers, b, s, hidden, heads, kv_heads, ffn = self.p.layer
        configs = [("1 GPU", 1, False), (f"TP {self.ranks}", self.ranks, False),
                   (f"TP {self.ranks} + SP", self.ranks, True)]
        for name, ranks, sp in configs:
            rec = dict(case="tp", config=name, gpus=ranks, sequence_parallel=sp,
                       layers=layers, b=b, s=s, hidden=hidden, heads=heads, kv_heads=kv_heads,
                       ffn=ffn, dtype=str(self.dtype).split(".")[-1], step_ms=None,
                       tokens_per_s=None, speedup=None, peak_mem_gb=None, attn_backend=None,
                       reason=None)
            self.run_row("tp", rec, lambda r, n=ranks, q=sp: self.measure_tp(r, n, q))
        rows = self.data["tp"][-len(configs):]
        for r in rows[1:]:
            one = rows[0]["tokens_per_s"]
            if one and r["tokens_per_s"]:
                r["speedup"] = round(r["tokens_per_s"] / one, 3)

    def measure_tp(self, rec, ranks, sequence_parallel):
        te = import_tfa()
        from transformer_fa import parallel

        tp = dict(set_parallel_mode=True, tp_group=self.group,
                  sequence_parallel=sequence_parallel) if ranks > 1 else {}
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[
            te.TransformerLayer(rec["hidden"], rec["ffn"], rec["heads"],
                                num_gqa_groups=rec["kv_heads"], hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="causal",
                                attn_input_format="sbhd", params_dtype=self.dtype,
                                device=self.device, **tp)
            for _ in range(rec["layers"])])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # the same global batch: every TP rank holds it (with SP: its part of the sequence)
        s = rec["s"] // ranks if sequence_parallel else rec["s"]
        x = self.randn(s, rec["b"], rec["hidden"])
        def step():
            opt.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()
            if sequence_parallel:
                parallel.allreduce_sequence_parallel_grads(model, self.group)
            opt.step()

        rec["step_ms"] = round(step_ms(step, self.p, self.device), 2)
        rec["tokens_per_s"] = round(rec["b"] * rec["s"] / rec["step_ms"] * 1e3)
        rec["attn_backend"] = next((m.last_backend for m in model.modules()
                                    if getattr(m, "last_backend", None)), None)

    def save(self, out_base):
        path = out_base.with_suffix(".json")
        path.write_text(json.dumps(self.data, indent=1) + "\n")
        path.with_suffix(".md").write_text(markdown(self.data))
        return path


# ------------------------------------------------------------------------------- report

def markdown(data) -> str:
    fmt = report.fmt
    parts = [f"## Distributed benchmarks: {data['ranks']} x {data['gpu']}, {data['date']}",
             f"torch {data['torch']}, cuDNN {data['cudnn']}, {data['backend']} "
             f"(NCCL_NVLS_ENABLE={data['nccl_nvls_enable']}). Times are medians, the slowest "
             "rank's; peak memory is per GPU, the largest over the ranks."]
    cp = data["cp"]
    if cp:
        x = cp[0]
        rows = [[r["s"], r["config"], r["gpus"], r["backend"] or "–", fmt(r["fwd_ms"], 1),
                 fmt(r["fwd_bwd_ms"], 1), fmt(r["tokens_per_s"]), fmt(r["tflops_per_gpu"], 1),
                 fmt(r["scaling_efficiency"], 2), fmt(r["peak_mem_gb"], 1)] for r in cp]
        parts.append(report.section(
            f"Context parallelism: causal attention, b={x['b']}, {x['h']} / {x['hkv']} heads, "
            f"d={x['d']}, {x['dtype']}",
            "tokens/s and TFLOPS per GPU count forward + backward (backward 2.5x forward); "
            "scaling efficiency = tokens/s / (GPUs x tokens/s of one GPU without CP).",
            report.table(["s", "config", "GPUs", "attention", "fwd ms", "fwd+bwd ms",
                          "tokens/s", "TFLOPS/GPU", "efficiency", "peak GB"], rows),
            cp, label="config"))
    tp = data["tp"]
    if tp:
        x = tp[0]
        rows = [[r["config"], r["gpus"], r["attn_backend"] or "–", fmt(r["step_ms"], 1),
                 fmt(r["tokens_per_s"]), fmt(r["speedup"], 2), fmt(r["peak_mem_gb"], 1)]
                for r in tp]
        parts.append(report.section(
            f"Tensor parallelism: {x['layers']} TransformerLayers, hidden {x['hidden']}, "
            f"{x['heads']} / {x['kv_heads']} heads, ffn {x['ffn']}, b={x['b']}, s={x['s']}, "
            f"{x['dtype']}",
            "Forward + backward + AdamW at the same global batch; speedup against one GPU.",
            report.table(["config", "GPUs", "attention", "step ms", "tokens/s", "speedup",
                          "peak GB"], rows), tp, label="config"))
    return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------------- main

PARTS = ("cp", "tp")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma list of " + ",".join(PARTS))
    ap.add_argument("--comm-types", default="p2p,a2a",
                    help="comma list of the cp_comm_type values to measure")
    ap.add_argument("--seqlens", help="comma list: the CP sequence lengths (default: the "
                    "preset's)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--tag", default="", help="suffix of the result files' name")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    comm_types = args.comm_types.split(",")
    if set(parts) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; expected {PARTS}")
    if set(comm_types) - {"p2p", "all_gather", "a2a"}:
        ap.error(f"--comm-types: expected p2p, all_gather or a2a, got {args.comm_types}")
    preset = PRESETS["tiny" if args.tiny else "full"]
    if args.seqlens:
        preset = dataclasses.replace(preset, seqlens=tuple(int(s) for s in
                                                           args.seqlens.split(",")))
    device = init(args.device)
    ranks = dist.get_world_size()
    for s in preset.seqlens:
        if s % (2 * ranks):
            ap.error(f"--seqlens: {s} is not divisible by 2 * ranks = {2 * ranks}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bench = Bench(preset, device, dtype)
    name = re.sub(r"[^A-Za-z0-9]+", "-", bench.data["gpu"]).strip("-")
    tag = f"-{args.tag}" if args.tag else ""
    out_dir = Path(args.out_dir)
    out_base = out_dir / f"{name}-x{ranks}-{bench.data['date']}-distributed{tag}"
    start = time.monotonic()
    path = None
    for part in parts:
        if bench.rank == 0:
            print(f"== {part} ({time.monotonic() - start:.0f} s)", flush=True)
        bench.cp(comm_types) if part == "cp" else bench.tp()
        if bench.rank == 0:  # after each part, so a run cut short keeps what it measured
            out_dir.mkdir(parents=True, exist_ok=True)
            path = bench.save(out_base)
    if bench.rank == 0:
        print(path.with_suffix(".md").read_text())
        print(f"wrote {path} and its .md ({time.monotonic() - start:.0f} s)")
    return path


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
