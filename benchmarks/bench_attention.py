"""Attention benchmarks: transformer_fa's backends against PyTorch SDPA's, in one run.

    python benchmarks/bench_attention.py            # full grid, ~8 minutes on an H100
    python benchmarks/bench_attention.py --quick    # a few shapes of each part
    python benchmarks/bench_attention.py --tiny --device cpu   # smoke test (CI)

Writes benchmarks/results/<gpu>-<date>.json and .md (and .png when matplotlib is there;
otherwise run benchmarks/report.py on the JSON). FLOPs follow the FlashAttention convention:
forward 4*b*h*sq*sk*d, halved for causal; backward 2.5x forward.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import report, timing  # noqa: E402

# our backend names -> the env switch that enables each
OURS = dict(zip(report.OURS, ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")))
BACKENDS = report.BACKENDS
FLASH = report.OURS[0]  # our flash kernels' backend name
DECODE_PAGE_SIZES = (16, 64)  # the decode part's paged rows (ours only: the peers have none)
# Warm-up of each decode measurement: after the b = 32 128k row (seconds of the unfused
# backend's GEMMs) the next row's first backend read ~11% slow with the preset's 10 ms and at
# full speed after ~100 ms of calls (H200, 2026-12-01: b = 128 4k, whichever backend came
# first). The part's first calls need more (Bench.decode's untimed first pass).
DECODE_WARMUP_MS = 100
NO_BACKEND = "No dot product attention backend is available for the provided inputs"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# torch.optim.AdamW's implementations; the layer part gives both models the same one:
# "foreach" (torch's default on CUDA, which every earlier run of the part used) or "fused" (one
# kernel per group of tensors, as TE's FusedAdam)
LAYER_OPTIMIZERS = {"foreach": dict(foreach=True), "fused": dict(fused=True)}
RECORD_KEYS = ("backend", "dtype", "d", "causal", "s", "b", "h", "fwd_tflops", "bwd_tflops",
               "fwd_ms", "bwd_ms", "peak_mem_gb")


@dataclasses.dataclass(frozen=True)
class Preset:
    seqlens: tuple  # grid: sequence lengths
    head_dims: tuple
    tokens: int  # grid: batch * seqlen
    hidden: int  # grid: heads * head_dim
    gqa: tuple  # (q heads, kv heads, head_dim, seqlens)
    varlen: tuple  # (batch, max seqlen, heads, head_dim)
    decode: tuple  # (q heads, kv heads, head_dim, batches, kv seqlens)
    overhead: tuple  # (batch, seqlen, heads, head_dim)
    layer: tuple  # (layers, batch, seqlen, hidden, heads, ffn, timed steps)
    warmup_ms: int
    rep_ms: int
    budget_s: int  # rows not started by then are recorded as skipped
    layer_optimizer: str = "foreach"  # the layer part's AdamW for both models (LAYER_OPTIMIZERS)


K = 1024
PRESETS = {
    "full": Preset((512, K, 2 * K, 4 * K, 8 * K, 16 * K), (64, 128, 256), 16 * K, 2048,
                   (32, 8, 128, (K, 4 * K, 16 * K)), (16, 4 * K, 16, 128),
                   (32, 8, 128, (1, 8, 32, 128), (4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K)),
                   (2, 128, 16, 64), (8, 2, 4 * K, 2048, 16, 8192, 10), 10, 30, 450),
    "quick": Preset((K, 4 * K), (64, 128), 16 * K, 2048,
                    (32, 8, 128, (4 * K,)), (16, 4 * K, 16, 128),
                    (32, 8, 128, (1, 8), (4 * K, 32 * K)),
                    (2, 128, 16, 64), (4, 2, 4 * K, 2048, 16, 8192, 5), 5, 15, 240),
    "tiny": Preset((32, 64), (16,), 128, 64,
                   (4, 2, 16, (64,)), (3, 64, 4, 16),
                   (4, 2, 16, (1, 2), (64, 128)),
                   (1, 16, 2, 16), (2, 2, 32, 64, 4, 128, 2), 1, 3, 60),
}


class Unavailable(Exception):
    """A backend cannot serve this row; the message is the reason recorded."""


def attn_flops(b, h, sq, sk, d, causal):
    """Forward FLOPs, FlashAttention convention (backward is 2.5x this)."""
    flops = 4 * b * h * sq * sk * d
    return flops / 2 if causal else flops


def describe(exc, caught=(), name=None):
    """One reason string for a failed row: for ours, the asked backend's part of the selection
    error; for peers, the error and SDPA's 'why not' warnings."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        tried = re.search(r"Tried to allocate [\d.]+ \w+", str(exc))
        return "out of memory" + (f" ({tried.group(0)})" if tried else "")
    text = str(exc).strip()
    others = "|".join(OURS)
    mine = re.search(rf"(?:^|[.;] ){name}: (.*?)(?=; (?:{others}): |$)", text, re.S)
    if mine and NO_BACKEND in text:
        return f"{name} {mine.group(1)}"
    if not isinstance(exc, (Unavailable, ValueError)):
        text = f"{type(exc).__name__}: {text}"
    notes = report.sdpa_notes(str(w.message) for w in caught)
    return " | ".join([text] + notes)[:1000]


def gpu_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine() or "cpu"


def cudnn_version():
    v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return f"{v // 10000}.{v % 10000 // 100}.{v % 100}" if v and v >= 10000 else str(v)


def import_tfa():
    try:
        import transformer_fa
    except Exception as exc:  # the library is missing or broken: every row of ours says so
        raise Unavailable(f"import transformer_fa failed: {describe(exc)}") from exc
    return transformer_fa


@contextlib.contextmanager
def only_backend(name):
    """Enable exactly one of our backends through the NVTE_* switches (peers: one SDPA kernel)."""
    if name not in OURS:
        with sdpa_kernel(getattr(SDPBackend, name.split(":", 1)[1])):
            yield
        return
    with mock.patch.dict(os.environ,
                         {var: "1" if other == name else "0" for other, var in OURS.items()}):
        yield


def ours_fn(name, q, k, v, mask_type, qkv_format="bshd", **call_kwargs):
    """DotProductAttention forced to `name`; raises Unavailable if selection went elsewhere."""
    dpa = import_tfa().DotProductAttention(
        num_attention_heads=q.shape[-2], kv_channels=q.shape[-1], num_gqa_groups=k.shape[-2],
        qkv_format=qkv_format, attn_mask_type=mask_type, attention_dropout=0.0)

    def fn():
        return dpa(q, k, v, **call_kwargs)

    fn()
    if dpa.last_backend != name:
        raise Unavailable(f"DotProductAttention selected {dpa.last_backend} instead")
    fn.module = dpa
    return fn


def peer_fn(q, k, v, causal):
    """F.scaled_dot_product_attention on [b, h, s, d] views of bshd tensors."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = {"enable_gqa": True} if q.shape[-2] != k.shape[-2] else {}

    def fn():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa)

    fn()
    return fn


def shuffled_page_pools(k, v, page_size):
    """k, v [b, sk, h, d] viewed as page pools [b * sk / page_size, page_size, h, d], and a
    block table (int32 [b, pages]) that gives each sequence its pages in a shuffled order."""
    b, sk = k.shape[:2]
    pools = [t.view(b * sk // page_size, page_size, *t.shape[2:]) for t in (k, v)]
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(b * sk // page_size, generator=gen).view(b, -1).to(
        device=k.device, dtype=torch.int32)
    return pools, table


def attention_fn(name, q, k, v, causal, mask_type=None, **ours_kwargs):
    if name in OURS:
        return ours_fn(name, q, k, v, mask_type or ("causal" if causal else "no_mask"),
                       **ours_kwargs)
    return peer_fn(q, k, v, causal)


class Bench:
    def __init__(self, preset, device, out_base, backends=BACKENDS):
        self.p, self.device, self.out_base = preset, device, out_base
        self.backends = backends  # the ones measured; the others are left out of the records
        self.deadline = time.monotonic() + preset.budget_s
        self.data = {"gpu": gpu_name(device), "date": datetime.date.today().isoformat(),
                     "torch": torch.__version__, "cudnn": cudnn_version(), "grid_repeats": 1,
                     "flash_family": os.environ.get("TRANSFORMER_FA_FLASH_FAMILY", "auto"),
                     "flash_bwd_family": os.environ.get("TRANSFORMER_FA_FLASH_BWD_FAMILY",
                                                        "auto"),
                     "records": [], "decode": [], "layer": []}

    def randn(self, *shape, dtype, grad=False):
        return torch.randn(*shape, dtype=dtype, device=self.device, requires_grad=grad)

    def time_ms(self, fn, grad_to_none=None, warmup_ms=None, graphed=False):
        """Median time of fn in ms (timing.median_ms; graphed: of its CUDA-graph replays,
        timing.graph_median_ms, on CUDA); warmup_ms: the preset's by default."""
        if graphed and self.device == "cuda":
            return timing.graph_median_ms(fn, warmup_ms or self.p.warmup_ms, self.p.rep_ms)
        return timing.median_ms(fn, warmup_ms or self.p.warmup_ms, self.p.rep_ms, grad_to_none,
                                self.device)

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def free(self):
        """Releases what the last measurement held before the next one starts: tensors in
        reference cycles (modules, closures) wait for the garbage collector otherwise (a
        decode row's K/V stayed allocated into the next row's first measurement, whose peak
        memory then read 70.9 GB at b = 128 4k), and a collection can land inside a timing
        loop."""
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.synchronize()

    def check_memory(self, name, score_elems):
        """Skip the unfused backend when its score matrices would not fit (~24 B per element
        for scores, probabilities and their gradients, measured on an H100)."""
        if name != "UnfusedDotProductAttention" or self.device != "cuda":
            return
        need, free = 24 * score_elems, torch.cuda.mem_get_info()[0]
        if need > 0.9 * free:
            raise Unavailable(f"skipped: needs about {need / 1e9:.0f} GB for the score "
                              f"matrices, {free / 1e9:.0f} GB free")

    def measure(self, name, make_fn, inputs, backward=True, warmup_ms=None, graphed=False):
        """fwd_ms, bwd_ms, peak_mem_gb and reason for one backend on one set of inputs.
        graphed (forward only): the forward timed as CUDA-graph replays, or eagerly where it
        cannot be captured; ``timing`` says which."""
        res = {"fwd_ms": None, "bwd_ms": None, "peak_mem_gb": None, "reason": None}
        if time.monotonic() > self.deadline:
            res["reason"] = f"skipped: time budget of {self.p.budget_s} s used up"
            return res
        caught = []
        try:
            with only_backend(name), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn = make_fn()
                caught.clear()
                if self.device == "cuda":  # one pass (forward, backward) for the peak
                    self.sync()
                    torch.cuda.reset_peak_memory_stats()
                out = fn()
                if backward:
                    out.backward(torch.randn_like(out))
                if self.device == "cuda":
                    self.sync()
                    res["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
                if graphed:
                    res["fwd_ms"], res["timing"] = self.graphed_ms(fn, warmup_ms)
                else:
                    res["fwd_ms"] = self.time_ms(fn, warmup_ms=warmup_ms)
                if backward:
                    out = fn()
                    dout = torch.randn_like(out)
                    res["bwd_ms"] = self.time_ms(
                        lambda: out.backward(dout, retain_graph=True), grad_to_none=inputs)
        except Exception as exc:  # a backend that cannot run the row records why
            res["reason"] = describe(exc, caught, name)
        finally:
            for x in inputs:
                x.grad = None
            fn = out = dout = None
            self.free()
        return res

    def graphed_ms(self, fn, warmup_ms):
        """(ms, how it was timed): CUDA-graph replays of fn, or eager calls where fn cannot be
        captured (the reason kept)."""
        if self.device != "cuda":
            return self.time_ms(fn, warmup_ms=warmup_ms), "eager (CPU)"
        try:
            return self.time_ms(fn, warmup_ms=warmup_ms, graphed=True), "cuda graph"
        except Exception as exc:  # not capturable: its eager time, and why
            torch.cuda.synchronize()
            return (self.time_ms(fn, warmup_ms=warmup_ms),
                    f"eager (capture failed: {type(exc).__name__}: {str(exc)[:120]})")

    def chosen(self, names):
        """names, less the backends this run leaves out (--backends)."""
        return [n for n in names if n in self.backends]

    def attention_rows(self, base, names, q, k, v, causal, flops, **ours_kwargs):
        """Measure each backend on (q, k, v); append one record each."""
        for name in self.chosen(names):
            rec = dict.fromkeys(RECORD_KEYS)
            rec.update(base, backend=name)
            try:
                self.check_memory(name, base["b"] * base["h"] * base["s"] ** 2)
                res = self.measure(name, lambda: attention_fn(name, q, k, v, causal, **ours_kwargs),
                                   [q, k, v])
            except Unavailable as exc:
                res = {"reason": str(exc)}
            rec.update(res)
            set_tflops(rec, flops)
            self.data["records"].append(rec)
            log_row(rec)

    # ---- parts -------------------------------------------------------------------------

    def grid(self, dtypes, repeats=1):
        """The standard grid. With repeats > 1 the whole grid runs that many passes (the
        backends of a row side by side in each) and each record keeps the median time over the
        passes, the times of each pass in fwd_ms_runs / bwd_ms_runs."""
        records = self.data["records"]
        first = len(records)
        for _ in range(repeats):
            self.grid_pass(dtypes)
        if repeats > 1:
            records[first:] = median_over_passes(records[first:], repeats)
        self.data["grid_repeats"] = repeats

    def grid_pass(self, dtypes):
        p = self.p
        for dt in dtypes:
            for d in p.head_dims:
                for causal in (False, True):
                    for s in p.seqlens:
                        b, h = max(1, p.tokens // s), p.hidden // d
                        q, k, v = (self.randn(b, s, h, d, dtype=DTYPES[dt], grad=True)
                                   for _ in range(3))
                        base = dict(case="grid", dtype=dt, d=d, causal=causal, s=s, b=b, h=h)
                        self.attention_rows(base, BACKENDS, q, k, v, causal,
                                            attn_flops(b, h, s, s, d, causal))

    def gqa(self):
        hq, hkv, d, seqlens = self.p.gqa
        for causal in (False, True):
            for s in seqlens:
                b = max(1, self.p.tokens // s)
                q = self.randn(b, s, hq, d, dtype=torch.bfloat16, grad=True)
                k, v = (self.randn(b, s, hkv, d, dtype=torch.bfloat16, grad=True)
                        for _ in range(2))
                base = dict(case="gqa", dtype="bf16", d=d, causal=causal, s=s, b=b, h=hq, hkv=hkv)
                self.attention_rows(base, BACKENDS, q, k, v, causal,
                                    attn_flops(b, hq, s, s, d, causal))

    def varlen(self):
        """thd with random lengths against the same batch padded to the longest (padding mask).
        TFLOPS count only the real tokens in both, so they compare directly."""
        b, max_s, h, d = self.p.varlen
        gen = torch.Generator().manual_seed(0)
        lens = torch.randint(max_s // 8, max_s + 1, (b,), generator=gen)
        lens[0] = max_s
        cu = F.pad(lens.cumsum(0), (1, 0)).to(torch.int32).to(self.device)
        t = int(lens.sum())
        pad_mask = (torch.arange(max_s)[None, :] >= lens[:, None]).view(b, 1, 1, max_s)
        pad_mask = pad_mask.to(self.device)
        for causal in (False, True):
            flops = sum(attn_flops(1, h, n, n, d, causal) for n in lens.tolist())
            mask_type = "padding_causal" if causal else "padding"
            base = dict(dtype="bf16", d=d, causal=causal, s=max_s, b=b, h=h, tokens=t)
            thd = [self.randn(t, h, d, dtype=torch.bfloat16, grad=True) for _ in range(3)]
            self.attention_rows(dict(base, case="varlen"), OURS, *thd, causal, flops,
                                mask_type=mask_type, qkv_format="thd", cu_seqlens_q=cu,
                                cu_seqlens_kv=cu, max_seqlen_q=max_s, max_seqlen_kv=max_s)
            padded = [self.randn(b, max_s, h, d, dtype=torch.bfloat16, grad=True)
                      for _ in range(3)]
            self.attention_rows(dict(base, case="padded"), OURS, *padded, causal, flops,
                                mask_type=mask_type, attention_mask=pad_mask)

    def decode(self):
        """One query token against a long KV cache; reported as K+V bytes read per second.
        Each call is timed as CUDA-graph replays (as a server replays its decode step): at
        b = 1 a call's host time (~20-60 us through DotProductAttention or torch's SDPA on
        the H200's host) is as long as its kernels and the 80 us L2 flush before each timed
        call, so eager timings read the host, differently from one measurement to the next
        (ours at b = 1 4k: 15 and 65 us in two of them, H200, 2026-12-01). The host's cost of
        a call is the overhead part's."""
        hq, hkv, d, batches, seqlens = self.p.decode
        # Each backend measured once, untimed, first: the part's first row otherwise pays the
        # process's first decode calls (b = 1 4k read at 0.3-0.5x of its later speed; with this
        # pass dropped and only the 100 ms warm-up, 0.78x, and 8k 0.95x: decode-warm, H200,
        # 2026-12-01).
        q = self.randn(1, 1, hq, d, dtype=torch.bfloat16)
        k, v = (self.randn(1, seqlens[0], hkv, d, dtype=torch.bfloat16) for _ in range(2))
        for name in self.chosen(BACKENDS):
            self.measure(name, lambda: attention_fn(name, q, k, v, False), [q, k, v],
                         backward=False)
        for b in batches:
            for sk in seqlens:
                kv_bytes = 2 * b * sk * hkv * d * 2  # bf16 K and V
                if self.device == "cuda" and kv_bytes > torch.cuda.mem_get_info()[0] / 2:
                    print(f"  decode b={b} sk={sk}: skipped, K+V ({kv_bytes / 1e9:.0f} GB) "
                          "would not leave room for the backends", flush=True)
                    continue
                q = self.randn(b, 1, hq, d, dtype=torch.bfloat16)
                k, v = (self.randn(b, sk, hkv, d, dtype=torch.bfloat16) for _ in range(2))
                for name in self.chosen(BACKENDS):
                    res = self.measure(name, lambda: attention_fn(name, q, k, v, False),
                                       [q, k, v], backward=False, warmup_ms=DECODE_WARMUP_MS,
                                       graphed=True)
                    ms = res.pop("fwd_ms")
                    res.pop("bwd_ms")
                    rec = dict(backend=name, dtype="bf16", b=b, sk=sk, hq=hq, hkv=hkv, d=d,
                               ms=ms, kv_tb_per_s=round(kv_bytes / ms / 1e9, 3) if ms else None,
                               **res)
                    self.data["decode"].append(rec)
                    log_row(rec)
                if FLASH in self.backends and self.device == "cuda":
                    for page_size in DECODE_PAGE_SIZES:
                        rec = self.paged_decode_row(q, k, v, page_size)
                        rec.update(dtype="bf16", b=b, sk=sk, hq=hq, hkv=hkv, d=d,
                                   kv_tb_per_s=round(kv_bytes / rec["ms"] / 1e9, 3)
                                   if rec.get("ms") else None)
                        self.data["decode"].append(rec)
                        log_row(rec)
                q = k = v = None  # freed before the next size (the lambdas above hold names)
                self.free()

    def paged_decode_row(self, q, k, v, page_size):
        """Our decode kernel reading the same K/V as pages through a block table: k and v
        viewed as page pools, each sequence's pages in a shuffled order (the table's reads
        are what is measured; the values do not matter)."""
        b, sk = k.shape[:2]
        name = f"{FLASH} (paged {page_size})"
        if sk % page_size:
            return dict(backend=name, ms=None, reason=f"sk not a multiple of {page_size}")
        pools, table = shuffled_page_pools(k, v, page_size)
        lens = torch.full((b,), sk, dtype=torch.int32, device=q.device)
        tfa = import_tfa()
        res = self.measure(FLASH, lambda: lambda: tfa.flash_attn_with_kvcache(
            q, *pools, cache_seqlens=lens, block_table=table), [q, k, v], backward=False,
            warmup_ms=DECODE_WARMUP_MS, graphed=True)
        res.pop("bwd_ms")
        return dict(backend=name, ms=res.pop("fwd_ms"), **res)

    def overhead(self):
        """Host time of a DotProductAttention call against the selected backend's bare `run`."""
        b, s, h, d = self.p.overhead
        q, k, v = (self.randn(b, s, h, d, dtype=torch.bfloat16 if self.device == "cuda"
                              else torch.float32, grad=True) for _ in range(3))
        for name in self.chosen(OURS):
            rec = dict.fromkeys(RECORD_KEYS)
            rec.update(case="overhead", backend=name, dtype=str(q.dtype).split(".")[-1],
                       d=d, causal=True, s=s, b=b, h=h, call_us=None, bare_us=None,
                       overhead_us=None, reason=None)
            try:
                with only_backend(name):
                    call = attention_fn(name, q, k, v, True)
                    bare = capture_backend_call(name, call)
                    rec["call_us"], rec["bare_us"] = self.host_us(call), self.host_us(bare)
                rec["overhead_us"] = round(rec["call_us"] - rec["bare_us"], 1)
            except Exception as exc:
                rec["reason"] = describe(exc, name=name)
            self.data["records"].append(rec)
            log_row(rec)

    def host_us(self, fn, calls=50, trials=5):
        """Best-of-trials mean wall time per call (µs), synchronizing once per trial."""
        return round(timing.host_us(fn, calls, trials, device=self.device), 1)

    def layer(self):
        """Training step (forward, backward, AdamW) of a GPT-style stack, ours vs plain PyTorch."""
        layers, b, s, hidden, heads, ffn, steps = self.p.layer
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        tfa = import_tfa()
        recipes = {"FP8 DelayedScaling": tfa.common.recipe.DelayedScaling,
                   "FP8 Float8CurrentScaling": tfa.common.recipe.Float8CurrentScaling}
        # (model, its block, the FP8 recipe its step runs under or None, whether the model's
        # forward and backward run as CUDA graphs: te.make_graphed_callables)
        blocks = [("transformer_fa.TransformerLayer", tfa_layer, None, False)]
        blocks += [(f"transformer_fa.TransformerLayer, {name}", tfa_layer, recipe, False)
                   for name, recipe in recipes.items()]
        blocks.append(("torch (F.scaled_dot_product_attention)", TorchBlock, None, False))
        if self.device == "cuda":  # last: a graph's memory pool may outlive its row
            blocks += [(f"transformer_fa.TransformerLayer, {name}, CUDA graph", tfa_layer,
                        recipe, True) for name, recipe in recipes.items()]
        for model_name, block, recipe, graphed in blocks:
            rec = dict(model=model_name, dtype=str(dtype).split(".")[-1], layers=layers, b=b,
                       s=s, hidden=hidden, heads=heads, ffn=ffn,
                       optimizer=f"AdamW ({self.p.layer_optimizer})", step_ms=None,
                       step_ms_each=None,
                       tokens_per_s=None, peak_mem_gb=None, attn_backend=None, reason=None)
            try:
                if time.monotonic() > self.deadline:
                    raise Unavailable(f"skipped: time budget of {self.p.budget_s} s used up")
                if recipe is not None and not tfa.is_fp8_available():
                    raise Unavailable(tfa.is_fp8_available(return_reason=True)[1])
                precision = (tfa.autocast(enabled=True, recipe=recipe()) if recipe is not None
                             and not graphed else contextlib.nullcontext())
                model = torch.nn.Sequential(*[block(hidden, heads, ffn, dtype, self.device)
                                              for _ in range(layers)])
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4,
                                        **(LAYER_OPTIMIZERS[self.p.layer_optimizer]
                                           if self.device == "cuda" else {}))
                x = self.randn(b, s, hidden, dtype=dtype)
                if graphed:  # the FP8 autocast is inside the graphs
                    model = tfa.make_graphed_callables(model, (x,), fp8_enabled=True,
                                                       fp8_recipe=recipe())

                def step():
                    opt.zero_grad(set_to_none=True)
                    with precision:
                        out = model(x)
                    out.float().square().mean().backward()
                    opt.step()

                if self.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                for _ in range(2):
                    step()
                ms, each = timing.steps_ms(step, steps, self.device)
                rec.update(step_ms=round(ms, 2), tokens_per_s=round(b * s / ms * 1e3),
                           step_ms_each=[round(t, 2) for t in each])
                if self.device == "cuda":
                    rec["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
                rec["attn_backend"] = next((m.last_backend for m in model.modules()
                                            if getattr(m, "last_backend", None)), "torch SDPA")
            except Exception as exc:
                rec["reason"] = describe(exc)
            finally:
                model = opt = x = None
                self.free()
            self.data["layer"].append(rec)
            log_row(rec)

    def save(self):
        path = self.out_base.with_suffix(".json")
        path.write_text(json.dumps(self.data, indent=1) + "\n")
        return path


def capture_backend_call(name, call):
    """A zero-argument function that calls the selected backend's `run` exactly as
    DotProductAttention did in `call`, captured by wrapping the backend module's `run`."""
    from transformer_fa.attention import backends

    module = next(m for m in backends.ALL_BACKENDS if m.NAME == name)
    seen, run = [], module.run

    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return run(*args, **kwargs)

    module.run = spy
    try:
        call()
    finally:
        module.run = run
    if not seen:
        raise Unavailable(f"DotProductAttention did not call {module.__name__}.run")
    args, kwargs = seen[-1]
    return lambda: run(*args, **kwargs)


def tfa_layer(hidden, heads, ffn, dtype, device):
    return import_tfa().TransformerLayer(
        hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
        self_attn_mask_type="causal", attn_input_format="bshd", params_dtype=dtype, device=device)


class TorchBlock(torch.nn.Module):
    """The same pre-LayerNorm block as TransformerLayer's defaults, in plain PyTorch."""

    def __init__(self, hidden, heads, ffn, dtype, device):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.heads = heads
        self.ln1, self.ln2 = (torch.nn.LayerNorm(hidden, eps=1e-5, **kw) for _ in range(2))
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, **kw)
        self.proj = torch.nn.Linear(hidden, hidden, **kw)
        self.fc1 = torch.nn.Linear(hidden, ffn, **kw)
        self.fc2 = torch.nn.Linear(ffn, hidden, **kw)

    def forward(self, x):  # [b, s, hidden]
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def set_tflops(rec, flops):
    """fwd_tflops / bwd_tflops of a record from its times (backward FLOPs: 2.5x forward)."""
    for x, scale in (("fwd", 1.0), ("bwd", 2.5)):
        if rec[f"{x}_ms"]:
            rec[f"{x}_tflops"] = round(scale * flops / rec[f"{x}_ms"] / 1e9, 2)


def median_over_passes(records, passes):
    """Grid records of several passes, in pass order, merged into one record per row and
    backend: the median time of the passes, and each pass's time in fwd_ms_runs / bwd_ms_runs."""
    per_pass = len(records) // passes
    merged = []
    for i, rec in enumerate(records[:per_pass]):
        runs = records[i::per_pass]
        rec = dict(rec)
        for x in ("fwd", "bwd"):
            times = [r[f"{x}_ms"] for r in runs if r[f"{x}_ms"] is not None]
            rec[f"{x}_ms_runs"] = times
            rec[f"{x}_ms"] = statistics.median(times) if times else None
        set_tflops(rec, attn_flops(rec["b"], rec["h"], rec["s"], rec["s"], rec["d"],
                                   rec["causal"]))
        merged.append(rec)
    return merged


def log_row(rec):
    keys = ("case", "backend", "model", "d", "causal", "s", "b", "sk", "fwd_tflops",
            "bwd_tflops", "kv_tb_per_s", "overhead_us", "tokens_per_s", "peak_mem_gb")
    parts = [f"{key}={rec[key]}" for key in keys if rec.get(key) is not None]
    if rec.get("reason"):
        parts.append("null: " + rec["reason"][:120])
    print("  " + " ".join(parts), flush=True)


PARTS = ("grid", "gqa", "varlen", "decode", "overhead", "layer")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a few shapes of each part")
    mode.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--fp16", action="store_true", help="run the grid in fp16 too")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma list of " + ",".join(PARTS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--budget-s", type=int, help="stop starting rows after this many seconds")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="comma list of the backends to measure (default: all)")
    ap.add_argument("--tag", default="", help="suffix of the result files' name")
    ap.add_argument("--head-dims", help="comma list: the grid's head dims (default: the "
                    "preset's)")
    ap.add_argument("--layer-optimizer", choices=tuple(LAYER_OPTIMIZERS), default="foreach",
                    help="the layer part's AdamW implementation, the same for both models "
                    "(default foreach)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="passes over the grid; each row records the median over the passes")
    args = ap.parse_args(argv)
    backends = tuple(args.backends.split(","))
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        ap.error(f"--backends: unknown {unknown}; expected names from {', '.join(BACKENDS)}")
    if args.repeats < 1:
        ap.error(f"--repeats: expected a positive number of passes, got {args.repeats}")

    preset = PRESETS["quick" if args.quick else "tiny" if args.tiny else "full"]
    if args.budget_s:
        preset = dataclasses.replace(preset, budget_s=args.budget_s)
    preset = dataclasses.replace(preset, layer_optimizer=args.layer_optimizer)
    if args.head_dims:
        preset = dataclasses.replace(preset, head_dims=tuple(int(d) for d in
                                                             args.head_dims.split(",")))
    torch.manual_seed(0)
    start = time.monotonic()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name(args.device)).strip("-")
    tag = f"-{args.tag}" if args.tag else ""
    bench = Bench(preset, args.device,
                  out_dir / f"{name}-{datetime.date.today().isoformat()}{tag}", backends)
    print(f"{bench.data['gpu']}  torch {bench.data['torch']}  cuDNN {bench.data['cudnn']}",
          flush=True)

    for part in args.parts.split(","):
        print(f"== {part} ({time.monotonic() - start:.0f} s)", flush=True)
        if part == "grid":
            bench.grid(["bf16", "fp16"] if args.fp16 else ["bf16"], args.repeats)
        else:
            getattr(bench, part)()
        bench.save()  # after each part, so a run cut short keeps what it measured

    path = bench.save()
    print(report.write(path))
    print(f"wrote {path} and its .md ({time.monotonic() - start:.0f} s)")
    return path


if __name__ == "__main__":
    main()
