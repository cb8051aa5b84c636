"""The one timing harness of benchmarks/bench_attention.py, benchmarks/bench_fused.py and
tools/flash_kernel_check.py.

- ``median_ms``: GPU time of a callable: warm-up, then CUDA events around each run with the L2
  cache flushed before it, and the median (triton.testing.do_bench where triton is installed;
  the same procedure written out here otherwise). On CPU (smoke tests): one call's wall time.
- ``graph_median_ms``: median_ms of a CUDA-graph replay of one call: its GPU time without the
  host's time to issue it (for calls shorter than their host time, e.g. a decode step).
- ``host_us``: host time per call, best of several trials of a loop of calls.
- ``once_ms``: one run timed with CUDA events (long single runs).
- ``steps_ms``: a loop of calls (training steps): the mean wall time per call, and each call's
  span of the GPU timeline, so that one slow call (a compilation, a collection) shows.
"""
import statistics
import time

import torch

L2_FLUSH_BYTES = 256 << 20  # larger than the L2 of current GPUs (do_bench's size)


def median_ms(fn, warmup_ms=25, rep_ms=100, grad_to_none=None, device="cuda") -> float:
    """Median time of fn in ms. grad_to_none: tensors whose .grad is reset before each run
    (a backward that accumulates would otherwise time an addition too)."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    try:
        from triton.testing import do_bench
    except ImportError:
        return _events_median_ms(fn, warmup_ms, rep_ms, grad_to_none)
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                    return_mode="median")


def graph_median_ms(fn, warmup_ms=25, rep_ms=100) -> float:
    """median_ms of replays of fn captured once in a CUDA graph (a few eager calls on a side
    stream first, as capture needs). A call whose host time exceeds the L2 flush before it
    (about 80 us on an H200) would otherwise be timed by its host. Raises where fn cannot be
    captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return median_ms(graph.replay, warmup_ms, rep_ms)
    finally:
        del graph


def _events_median_ms(fn, warmup_ms, rep_ms, grad_to_none) -> float:
    """do_bench's procedure: run counts from a first estimate, L2 flushed before each run."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    estimate = once_ms(lambda: [(flush.zero_(), fn()) for _ in range(5)]) / 5
    for _ in range(max(1, int(warmup_ms / max(estimate, 1e-3)))):
        fn()
    events = []
    for _ in range(max(1, int(rep_ms / max(estimate, 1e-3)))):
        for x in grad_to_none or ():
            x.grad = None
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def once_ms(fn) -> float:
    """One run of fn, timed with CUDA events (synchronized before and after)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def host_us(fn, calls=50, trials=5, warmup=0, busy_gpu=False, device="cuda") -> float:
    """Best-of-trials mean wall time per call in µs.

    busy_gpu: hold the GPU busy (torch.cuda._sleep) while the loop only enqueues work, so the
    launch queue never fills and the GPU's own time is not measured: the Python and dispatch
    cost of a call. Else each trial is synchronized before and after: the call's full time.
    On CPU (smoke tests) a short loop."""
    cuda = device == "cuda"
    if not cuda:
        calls, trials, warmup = min(calls, 3), 1, 0
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(trials):
        if cuda:
            torch.cuda.synchronize()
            if busy_gpu:
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        stop = time.perf_counter()
        if cuda and not busy_gpu:
            torch.cuda.synchronize()
            stop = time.perf_counter()
        best = min(best, (stop - start) / calls)
    return best * 1e6


def steps_ms(fn, calls, device="cuda"):
    """(mean wall ms per call, [ms of each call]) of one loop of ``calls`` calls, synchronized
    before and after. Each call's time is its span between CUDA events recorded at the call
    boundaries (no sync inside the loop, so the loop runs as an untimed one would; where the
    host is the limit a span is the host's time for that call). On CPU each call's wall time."""
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    else:
        marks = []
    start = time.perf_counter()
    for i in range(calls):
        if cuda:
            marks[i].record()
        else:
            marks.append(time.perf_counter())
        fn()
    if cuda:
        marks[calls].record()
        torch.cuda.synchronize()
        each = [marks[i].elapsed_time(marks[i + 1]) for i in range(calls)]
    else:
        marks.append(time.perf_counter())
        each = [(marks[i + 1] - marks[i]) * 1e3 for i in range(calls)]
    return (time.perf_counter() - start) * 1e3 / calls, each
