"""Host time of one DotProductAttention forward call, down each backend's Python path, on CPU.

    python benchmarks/bench_host.py                 # µs per call, ops and Python calls per call
    python benchmarks/bench_host.py --profile 15    # and the 15 costliest functions of each row

Where the call meets native code that is not here, a cheap stand-in answers (``stand_ins``):

- FlashAttention: ``StandInFlash`` is the extension (``transformer_fa_flash``): its calls
  return tensors allocated once per shape. The selection asks FlashAttention's own support
  check about the call as it would look on an H100 (device "cuda", sm90), since the tensors
  here are CPU tensors; everything else (validation, the call memo, the selection cache,
  FlashAttention's ``run`` and its wrappers) runs as on the GPU, up to the extension call.
- FusedAttention: cuDNN's support verdict is left out (only its feature reasons are asked,
  as on an H100) and plans are ``StandInPlan``s whose ``run`` does nothing: the Python side
  of ``fused.run`` runs up to ``Plan.run`` (cuDNN's stream, workspace, handle and launch are
  not reached).
- UnfusedDotProductAttention runs as it is, in float32 (its times include the CPU math).

Each backend is forced as bench_attention forces it (NVTE_*_ATTN). Rows: a decode step
(b=1, one query token, 32/8 heads, d128, sk=4096, no mask: bench_attention's decode row) and
a small prefill (b=2, s=128, 16 heads, d64, causal: its overhead row), each with inputs that do
not require grad and with inputs that do (the forward only; its graph is dropped).
Performance is measured here, never asserted: tests/test_dpa_host.py guards op and call
counts.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import os
import pstats
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Tuple
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transformer_fa as tfa  # noqa: E402
from transformer_fa.attention.backends import flash, fused  # noqa: E402
from transformer_fa.attention.constants import FLASH_HEAD_DIMS  # noqa: E402
from transformer_fa.attention.backends.fused import ops as fused_ops  # noqa: E402
from transformer_fa.attention.backends.fused import plans as fused_plans  # noqa: E402

SWITCHES = {flash.NAME: "NVTE_FLASH_ATTN", fused.NAME: "NVTE_FUSED_ATTN",
            "UnfusedDotProductAttention": "NVTE_UNFUSED_ATTN"}
BACKENDS = tuple(SWITCHES)


class StandInFlash:
    """transformer_fa_flash's entry points, answering at once with tensors allocated once per
    shape (the kernels' numbers are tests/gpu's business). ``last``: the latest call's entry
    point name and arguments."""

    HEAD_DIMS = FLASH_HEAD_DIMS
    INSTANTIATIONS = [f"{t}_hdim{d}" for t in ("fp16", "bf16") for d in FLASH_HEAD_DIMS]

    def __init__(self):
        self._buffers = {}
        self.last = None

    def _buffer(self, shape, dtype):
        key = (tuple(shape), dtype)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=dtype)
        return self._buffers[key]

    def fwd(self, q, k, v, cu_q, cu_kv, q_format, kv_format, max_seqlen_q, max_seqlen_kv,
            scale, left, right, bottom_right, return_lse, *rest):
        self.last = ("fwd", (q, k, v, cu_q, cu_kv, q_format, kv_format, max_seqlen_q,
                             max_seqlen_kv, scale, left, right, bottom_right, return_lse, *rest))
        out = self._buffer((*q.shape[:-1], v.shape[-1]), q.dtype)
        lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if return_lse else (0,)
        return [out, self._buffer(lse_shape, torch.float32)]

    def fwd_kvcache(self, q, k, v, *rest):
        self.last = ("fwd_kvcache", (q, k, v, *rest))
        return self._buffer((*q.shape[:-1], v.shape[-1]), q.dtype)

    def bwd(self, dout, q, k, v, *rest, **kwargs):
        self.last = ("bwd", (dout, q, k, v, *rest), kwargs)
        return [self._buffer(t.shape, t.dtype) for t in (q, k, v)]

    def fwd_family(self, *args):
        return ("sm90", "")

    def bwd_family(self, *args):
        return ("sm90", "")


class StandInPlan:
    """A built cuDNN plan whose launch does nothing."""

    def __init__(self, spec):
        self.spec = spec
        self.zero = spec.padding

    def run(self, pack, cu_q, cu_kv, device):
        pass


class StandInGraphCache(fused_plans.GraphCache):
    """fused's GraphCache with a StandInPlan made on a miss (no cuDNN); hits go through the
    real lookup."""

    def plan(self, table, key, make_spec, tensors):
        if key not in table:
            fused_plans._put(table, key, StandInPlan(make_spec()), self.size)
        return super().plan(table, key, make_spec, tensors)


def _as_on_h100(params):
    return dataclasses.replace(params, device_type="cuda", compute_capability=(9, 0))


@contextlib.contextmanager
def stand_ins():
    """The stand-ins of this module's docstring, for the duration of the block."""
    ext = StandInFlash()
    flash_reasons = flash.not_supported_reasons
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        enter(mock.patch.object(flash, "_ext", ext))
        enter(mock.patch.object(flash, "_extension", lambda: ext))
        enter(mock.patch.object(flash, "is_built", lambda: True))
        enter(mock.patch.object(flash, "not_supported_reasons",
                                lambda p: flash_reasons(_as_on_h100(p))))
        enter(mock.patch.object(fused, "not_supported_reasons",
                                lambda p: fused.reasons.feature_reasons(_as_on_h100(p))))
        enter(mock.patch.object(fused_ops, "CACHE", StandInGraphCache()))
        yield ext


@contextlib.contextmanager
def only_backend(name):
    """The NVTE_* switches that leave only `name` (as bench_attention.only_backend)."""
    with mock.patch.dict(os.environ, {var: "1" if other == name else "0"
                                      for other, var in SWITCHES.items()}):
        yield


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    b: int
    sq: int
    sk: int
    hq: int
    hkv: int
    d: int
    mask: str
    grad: bool  # q, k, v require grad


ROWS = (
    Row("decode", 1, 1, 4096, 32, 8, 128, "no_mask", False),
    Row("decode", 1, 1, 4096, 32, 8, 128, "no_mask", True),
    Row("prefill", 2, 128, 128, 16, 16, 64, "causal", False),
    Row("prefill", 2, 128, 128, 16, 16, 64, "causal", True),
)


def make_call(row: Row, backend: str):
    """A zero-argument DotProductAttention forward for row (bshd), and its module."""
    dtype = torch.float32 if backend == "UnfusedDotProductAttention" else torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(row.b, row.sq, row.hq, row.d, generator=gen, dtype=dtype)
    k, v = (torch.randn(row.b, row.sk, row.hkv, row.d, generator=gen, dtype=dtype)
            for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_(row.grad)
    dpa = tfa.DotProductAttention(row.hq, row.d, num_gqa_groups=row.hkv, qkv_format="bshd",
                                  attn_mask_type=row.mask)

    def call():
        return dpa(q, k, v)

    return call, dpa


class OpCounter(TorchDispatchMode):
    """Counts the torch ops (ATen calls, views included) run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def ops_per_call(call) -> Counter:
    counter = OpCounter()
    with counter:
        call()
    return counter.ops


PACKAGE = os.path.dirname(tfa.__file__)


def python_calls_per_call(call, calls: int = 10) -> Tuple[float, float]:
    """(Python function calls per call, those into transformer_fa's own code), counted with
    sys.setprofile (C functions are not counted)."""
    total = ours = 0

    def tracer(frame, event, arg):
        nonlocal total, ours
        if event == "call":
            total += 1
            ours += frame.f_code.co_filename.startswith(PACKAGE)

    sys.setprofile(tracer)
    try:
        for _ in range(calls):
            call()
    finally:
        sys.setprofile(None)
    return total / calls, ours / calls


def loop_us(call, calls: int) -> float:
    """Mean wall time per call in µs of a loop of calls."""
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def profile(call, calls: int, top: int) -> str:
    """cProfile of `calls` calls: the `top` functions by own time, µs per forward call."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
    lines = [f"    {'own µs':>8} {'cum µs':>8} {'calls':>6}  function"]
    for (path, line, func), (_, ncalls, own, cum, _) in rows:
        where = f"{Path(path).name}:{line}" if line else path
        lines.append(f"    {own / calls * 1e6:8.2f} {cum / calls * 1e6:8.2f} "
                     f"{ncalls / calls:6.1f}  {func} ({where})")
    return "\n".join(lines)


def setup(row: Row, backend: str):
    """row's call on backend, called once (its decisions made), checked to run there."""
    with only_backend(backend):
        call, dpa = make_call(row, backend)
        call()
    if dpa.last_backend != backend:
        raise RuntimeError(f"{backend} was not selected ({dpa.last_backend} ran)")
    return call


def measure(pairs, calls: int, trials: int, top: int = 0) -> list:
    """For each (row, backend): µs per call (the best of `trials` loops, the rows' loops
    interleaved so that a slow spell of the machine does not fall on one row), torch ops and
    Python calls per call, and with top a profile."""
    records = []
    with stand_ins():
        calls_of = [setup(row, backend) for row, backend in pairs]
        # The unfused rows run the math on the CPU: fewer calls per loop.
        loops = [calls if backend != "UnfusedDotProductAttention" else max(calls // 50, 2)
                 for _, backend in pairs]
        best = [float("inf")] * len(pairs)
        for _ in range(trials):
            for i, ((_, backend), call) in enumerate(zip(pairs, calls_of)):
                with only_backend(backend):
                    best[i] = min(best[i], loop_us(call, loops[i]))
        for (row, backend), call, us, n in zip(pairs, calls_of, best, loops):
            with only_backend(backend):
                py_calls, our_calls = python_calls_per_call(call)
                rec = dict(row=row.name, grad=row.grad, backend=backend, us=us,
                           ops=sum(ops_per_call(call).values()), py_calls=py_calls,
                           our_calls=our_calls)
                if top:
                    rec["profile"] = profile(call, n, top)
            records.append(rec)
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per timed loop")
    parser.add_argument("--trials", type=int, default=30, help="timed loops per row")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the N functions with the most own time per row")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} thread; µs per "
          f"DotProductAttention forward call (best of {args.trials} loops)")
    print(f"{'row':<8} {'grad':<5} {'backend':<27} {'µs/call':>8} {'ops':>4} {'py calls':>9} "
          f"{'ours':>5}")
    pairs = [(row, backend) for row in ROWS for backend in args.backends.split(",")]
    for rec in measure(pairs, args.calls, args.trials, args.profile):
        print(f"{rec['row']:<8} {str(rec['grad']):<5} {rec['backend']:<27} {rec['us']:8.1f} "
              f"{rec['ops']:4d} {rec['py_calls']:9.1f} {rec['our_calls']:5.1f}", flush=True)
        if args.profile:
            print(rec["profile"], flush=True)


if __name__ == "__main__":
    main()
