"""Where the `layer` benchmark's training step spends its time and memory, ours against PyTorch.

    python benchmarks/profile_layer.py --out-dir $OUT                    # GPU, the benchmark's shapes
    python benchmarks/profile_layer.py --preset tiny --device cpu --out-dir /tmp/p  # smoke test

Builds the two models of bench_attention.py's `layer` part (a stack of
transformer_fa.TransformerLayer and of the same block in plain PyTorch, `TorchBlock`), runs a
few warm-up steps (forward, backward, AdamW), times --steps steps, then traces --steps more
with torch.profiler. Writes `layer-profile-<device>[-tiny].json` and `.md` to --out-dir:

- per model, device (CUDA kernel) time per step in categories (GEMM, attention fwd/bwd, norm,
  elementwise/activation, copies/layout, optimizer, other), with the top kernels of each;
  on CPU, the self time of the CPU ops instead;
- the peak memory of the run (CUDA only);
- the bytes of the tensors one layer saves for the backward, measured with
  torch.autograd.graph.saved_tensors_hooks, deduplicated by storage: activations (those of
  the core attention, i.e. what it saves and its output, apart) and the parameters saved
  (which exist anyway), with every saved tensor listed by module and function.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
import time
from pathlib import Path

import torch
from torch.autograd.profiler_util import DeviceType
from torch.overrides import TorchFunctionMode

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import timing  # noqa: E402
from benchmarks.bench_attention import PRESETS, TorchBlock, gpu_name, tfa_layer  # noqa: E402
from transformer_fa.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

MODELS = {"transformer_fa.TransformerLayer": tfa_layer,
          "torch (F.scaled_dot_product_attention)": TorchBlock}
CATEGORIES = ("GEMM", "attention fwd", "attention bwd", "norm", "FP8 casts/amax",
              "elementwise/activation", "copies/layout", "optimizer", "other")
TOP_KERNELS = 5
WARMUP_STEPS = {"full": 3, "tiny": 1}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FP8_RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling}

# Matched against names lower-cased and without underscores.
_ATTENTION = re.compile(r"flash|fmha|sdpa|scaleddotproduct|dotproductattention")
_ATTENTION_BWD = re.compile(r"backward|bwd|bprop|dotdoo|convertdq")
_GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|splitk|gemv")
_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
             "aten::linear", "aten::scaledmm", "aten::addmv", "aten::mv"}
_COPY_KERNEL = re.compile(r"copy|memcpy|catarray|gather|scatter|indexkernel")
_COPY_OPS = {"aten::copy", "aten::contiguous", "aten::clone", "aten::cat", "aten::tocopy",
             "aten::to", "aten::index", "aten::indexselect", "aten::indexput", "aten::indexcopy",
             "aten::gather", "aten::scatter", "aten::stack", "aten::splitwithsizescopy",
             "aten::unsafeindex", "aten::reshape"}
_NORM = re.compile(r"layernorm|rmsnorm|normfwdkernel|normbwdkernel|fusednorm")
# FP8 GEMMs' operand casts (transformer_fa.fp8: the Triton cast kernel or the PyTorch path)
_FP8_CAST = re.compile(r"castkernel|float8|fp8|amax|abs")
# the label the profile puts on DotProductAttention's forward (its ops are no kernel names)
ATTENTION_LABEL = "DotProductAttention"


def _squash(name: str) -> str:
    return name.lower().replace("_", "")


def categorize(kernel: str, chain) -> str:
    """The category of a kernel (on CPU: an op) launched under the ops ``chain``, innermost
    first (the op that launched it, then its callers up to the step)."""
    k = _squash(kernel)
    ops = [_squash(c) for c in chain]
    joined = " ".join(ops)
    op = ops[0] if ops else ""
    if "optimizer." in joined:
        return "optimizer"
    if _ATTENTION.search(k) or _ATTENTION.search(joined):  # layout copies inside it too
        backward = _ATTENTION_BWD.search(k) or "backward" in joined
        return "attention bwd" if backward else "attention fwd"
    # the launching op first: a GEMM's template arguments may name a copy
    if op in _GEMM_OPS:
        return "GEMM"
    if op in _COPY_OPS:
        return "copies/layout"
    if _GEMM_KERNEL.search(k):
        return "GEMM"
    if _COPY_KERNEL.search(k):
        return "copies/layout"
    if _NORM.search(joined) or _NORM.search(k):
        return "norm"
    if _FP8_CAST.search(k) or "fp8matmul" in joined:
        return "FP8 casts/amax"
    if ops:
        return "elementwise/activation"
    return "other"


def _chain(event):
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def timed_items(events, device: str):
    """(name, chain, µs) of each kernel (CUDA) or each CPU op's self time (CPU)."""
    if device == "cuda":
        # each CPU op lists the kernels it launched (FunctionEvent.kernels: name, duration µs)
        for e in events:
            if e.device_type == DeviceType.CPU:
                for kernel in e.kernels:
                    yield kernel.name, _chain(e), kernel.duration
        return
    for e in events:
        if (e.device_type == DeviceType.CPU and not e.is_user_annotation
                and e.self_cpu_time_total > 0):
            yield e.name, _chain(e), e.self_cpu_time_total


def time_by_category(events, device: str, steps: int) -> dict:
    """{category: {"ms_per_step", "top": [{"name", "op", "ms_per_step", "calls_per_step"}]}}."""
    totals = collections.defaultdict(float)
    kernels = collections.defaultdict(lambda: [0.0, 0])
    for name, chain, us in timed_items(events, device):
        category = categorize(name, chain)
        totals[category] += us
        entry = kernels[(category, name, chain[0] if chain else "")]
        entry[0] += us
        entry[1] += 1
    result = {}
    for category in CATEGORIES:
        top = sorted(((us, calls, name, op) for (cat, name, op), (us, calls) in kernels.items()
                      if cat == category), reverse=True)[:TOP_KERNELS]
        result[category] = {
            "ms_per_step": round(totals[category] / steps / 1e3, 4),
            "top": [{"name": name, "op": op, "ms_per_step": round(us / steps / 1e3, 4),
                     "calls_per_step": round(calls / steps, 2)} for us, calls, name, op in top]}
    return result


# ---- saved tensors ------------------------------------------------------------------------

class _FunctionTracker(TorchFunctionMode):
    """The torch function being called (the outermost one), and the outputs of
    F.scaled_dot_product_attention."""

    def __init__(self):
        super().__init__()
        self.current = ""
        self.attention_outputs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        outer, self.current = self.current, getattr(func, "__name__", repr(func))
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.current = outer
        if self.current == "" and getattr(func, "__name__", "") == "scaled_dot_product_attention":
            self.attention_outputs.append(out)
        return out


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


def saved_tensors(block: torch.nn.Module, x: torch.Tensor) -> dict:
    """The tensors that one forward of ``block`` on ``x`` saves for its backward, one entry
    per storage. The core attention's share (what a DotProductAttention module or
    F.scaled_dot_product_attention saves, and its output) is counted apart, so that the rest
    compares between models whose attention runs different kernels."""
    params = {_storage_key(p) for p in block.parameters()}
    modules, attention_outputs = [], []
    entries, order = {}, []
    tracker = _FunctionTracker()
    pack_calls = 0

    def push(name):
        return lambda module, args: modules.append(
            (name, type(module).__name__ == ATTENTION_LABEL))

    def pop(module, args, out):
        modules.pop()
        if type(module).__name__ == ATTENTION_LABEL:
            attention_outputs.append(out)

    handles = []
    for name, module in block.named_modules():
        handles.append(module.register_forward_pre_hook(push(name or "(block)")))
        handles.append(module.register_forward_hook(pop, always_call=True))

    def pack(t):
        nonlocal pack_calls
        pack_calls += 1
        key = _storage_key(t)
        in_attention = (any(attention for _, attention in modules)
                        or tracker.current == "scaled_dot_product_attention")
        if key not in entries:
            entries[key] = dict(module=modules[-1][0] if modules else "(block)",
                                function=tracker.current, shape=list(t.shape),
                                dtype=str(t.dtype).replace("torch.", ""),
                                bytes=t.untyped_storage().nbytes(),
                                parameter=key in params, attention=in_attention, saves=0)
            order.append(key)
        entries[key]["saves"] += 1
        entries[key]["attention"] |= in_attention
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tracker:
            out = block(x)
    finally:
        for handle in handles:
            handle.remove()
    for result in attention_outputs + tracker.attention_outputs:
        for t in result if isinstance(result, tuple) else (result,):
            if isinstance(t, torch.Tensor) and _storage_key(t) in entries:
                entries[_storage_key(t)]["attention"] = True
    del out
    tensors = [entries[key] for key in order]
    activations = [e for e in tensors if not e["parameter"]]
    attention = sum(e["bytes"] for e in activations if e["attention"])
    total = sum(e["bytes"] for e in activations)
    return {"activation_bytes": total, "attention_bytes": attention,
            "rest_bytes": total - attention,
            "parameter_bytes": sum(e["bytes"] for e in tensors if e["parameter"]),
            "pack_calls": pack_calls, "storages": len(tensors), "tensors": tensors}


# ---- one model ----------------------------------------------------------------------------

class _AttentionLabels:
    """record_function(ATTENTION_LABEL) around each DotProductAttention forward, so that the
    profile files its ops under attention whatever kernels they launch."""

    def __init__(self, model):
        self.handles, self.open = [], []
        for module in model.modules():
            if type(module).__name__ == ATTENTION_LABEL:
                self.handles.append(module.register_forward_pre_hook(self.enter))
                self.handles.append(module.register_forward_hook(self.exit, always_call=True))

    def enter(self, module, args):
        label = torch.autograd.profiler.record_function(ATTENTION_LABEL)
        label.__enter__()
        self.open.append(label)

    def exit(self, module, args, out):
        self.open.pop().__exit__(None, None, None)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def profile_model(name, block, shape, device, dtype, steps, warmup, trace_path=None,
                  recipe=None) -> dict:
    """recipe: the FP8 recipe the model's steps run under (transformer_fa.autocast), or None."""
    layers, b, s, hidden, heads, ffn = shape
    cuda = device == "cuda"
    model = torch.nn.Sequential(*[block(hidden, heads, ffn, dtype, device)
                                  for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(b, s, hidden, dtype=dtype, device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        with precision():
            out = model(x)
        out.float().square().mean().backward()
        opt.step()

    def precision():
        if recipe is None:
            return contextlib.nullcontext()
        import transformer_fa
        return transformer_fa.autocast(enabled=True, recipe=recipe)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step()
    peak = round(torch.cuda.max_memory_allocated() / 1e9, 3) if cuda else None
    step_ms = timing.host_us(step, calls=steps, trials=1, device=device) / 1e3

    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    labels = _AttentionLabels(model)
    # one step traced and dropped first: the profiler's own start-up is not counted
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    try:
        with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
            for _ in range(steps + 1):
                step()
                if cuda:
                    torch.cuda.synchronize()
                prof.step()
    finally:
        labels.remove()
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    categories = time_by_category(prof.events(), device, steps)
    backend = next((m.last_backend for m in model.modules()
                    if getattr(m, "last_backend", None)), "torch SDPA")
    # one layer, its input a middle layer's (it needs a gradient)
    saved = saved_tensors(model[0], x.detach().clone().requires_grad_(True))
    return {"model": name, "attn_backend": backend, "step_ms": round(step_ms, 3),
            "tokens_per_s": round(b * s / step_ms * 1e3), "peak_mem_gb": peak,
            "total_ms_per_step": round(sum(c["ms_per_step"] for c in categories.values()), 4),
            "categories": categories, "saved_per_layer": saved}


# ---- output -------------------------------------------------------------------------------

def _mb(n):
    return f"{n / 2**20:.2f}"


def markdown(data: dict) -> str:
    models = data["models"]
    unit = data["time"]
    lines = [
        "## Layer profile", "",
        f"{data['gpu']}, torch {data['torch']}, preset `{data['preset']}`: {data['layers']} "
        f"layers, b={data['b']}, s={data['s']}, hidden {data['hidden']}, {data['heads']} heads, "
        f"ffn {data['ffn']}, {data['dtype']}, causal; {data['steps']} profiled steps of "
        f"forward + backward + AdamW after {data['warmup']} warm-up steps.", "",
        f"Run: `{data['command']}` (on a GPU: `python benchmarks/profile_layer.py "
        f"--out-dir $OUT`; `--preset tiny --device cpu` is the CPU smoke test).", "",
        f"Time: the {unit} of the profiled steps per category, divided by the steps; a "
        "kernel is filed by its name and the ops that launched it (`categorize` in "
        "benchmarks/profile_layer.py). The wall time per step is taken without the profiler. "
        "Saved for backward: one layer's forward under "
        "torch.autograd.graph.saved_tensors_hooks, each storage counted once; the core "
        "attention's share is what it saves plus its output.", "",
        f"### Time per step ({unit}, ms)", "",
        "| category | " + " | ".join(m["model"] for m in models) + " |",
        "|---|" + "---:|" * len(models)]
    for category in CATEGORIES:
        lines.append(f"| {category} | " + " | ".join(
            f"{m['categories'][category]['ms_per_step']:.3f}" for m in models) + " |")
    lines.append("| **total** | " + " | ".join(f"**{m['total_ms_per_step']:.3f}**"
                                                for m in models) + " |")
    lines.append("| step (wall, unprofiled) | " + " | ".join(f"{m['step_ms']:.3f}"
                                                             for m in models) + " |")
    lines.append("| tokens/s | " + " | ".join(str(m["tokens_per_s"]) for m in models) + " |")
    lines.append("| peak memory (GB) | " + " | ".join(str(m["peak_mem_gb"]) for m in models)
                 + " |")
    lines.append("| attention backend | " + " | ".join(m["attn_backend"] for m in models)
                 + " |")
    lines += ["", "### Saved for backward, per layer (MiB, one storage counted once)", "",
              "| | " + " | ".join(m["model"] for m in models) + " |",
              "|---|" + "---:|" * len(models)]
    for key, label in (("activation_bytes", "activations"),
                       ("attention_bytes", "of which core attention (saved, and its output)"),
                       ("rest_bytes", "of which the rest"),
                       ("parameter_bytes", "parameters saved (not extra memory)")):
        lines.append(f"| {label} | " + " | ".join(_mb(m["saved_per_layer"][key])
                                                  for m in models) + " |")
    lines.append("| save calls / storages | " + " | ".join(
        f"{m['saved_per_layer']['pack_calls']} / {m['saved_per_layer']['storages']}"
        for m in models) + " |")
    for m in models:
        lines += ["", f"### {m['model']}", "", "Top kernels per category (ms per step, calls "
                  "per step, launching op):", ""]
        for category in CATEGORIES:
            for k in m["categories"][category]["top"]:
                lines.append(f"- {category}: {k['ms_per_step']:.3f} ms, {k['calls_per_step']}x, "
                             f"`{k['op']}`: `{_short(k['name'])}`")
        lines += ["", "Saved tensors of one layer:", "",
                  "| module | function | shape | dtype | MiB | saves | kind |",
                  "|---|---|---|---|---:|---:|---|"]
        for t in m["saved_per_layer"]["tensors"]:
            kind = ("parameter" if t["parameter"] else
                    "core attention" if t["attention"] else "activation")
            lines.append(f"| {t['module']} | {t['function']} | {t['shape']} | {t['dtype']} | "
                         f"{_mb(t['bytes'])} | {t['saves']} | {kind} |")
    return "\n".join(lines) + "\n"


def _short(name, limit=140):
    return name if len(name) <= limit else name[:limit - 3] + "..."


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=("cuda", "cpu"))
    ap.add_argument("--preset", default="full", choices=("full", "tiny"),
                    help="full: the layer benchmark's shapes; tiny: small ones (CPU, seconds)")
    ap.add_argument("--steps", type=int, help="timed and profiled steps (default: the "
                    "benchmark's timed steps)")
    ap.add_argument("--dtype", choices=tuple(DTYPES),
                    help="default: bf16 on CUDA, fp32 on CPU (as the benchmark)")
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--fp8", choices=tuple(FP8_RECIPES),
                    help="also profile our layer under this FP8 recipe (a GPU with FP8)")
    ap.add_argument("--trace", action="store_true",
                    help="also write a Chrome trace per model (large for the full preset)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available on this machine; pass --device cpu")
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps: expected a positive number of steps, got {args.steps}")
    layers, b, s, hidden, heads, ffn, bench_steps = PRESETS[args.preset].layer
    steps = args.steps or bench_steps
    dtype_name = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    torch.manual_seed(0)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / f"layer-profile-{args.device}{'-tiny' if args.preset == 'tiny' else ''}"
    data = {"gpu": gpu_name(args.device), "torch": torch.__version__, "device": args.device,
            "preset": args.preset, "layers": layers, "b": b, "s": s, "hidden": hidden,
            "heads": heads, "ffn": ffn, "dtype": dtype_name, "steps": steps,
            "warmup": WARMUP_STEPS[args.preset],
            "time": "CUDA kernel time" if args.device == "cuda" else "CPU op self time",
            "command": "python benchmarks/profile_layer.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "models": []}
    models = [(name, block, None) for name, block in MODELS.items()]
    if args.fp8:
        recipe = FP8_RECIPES[args.fp8]()
        models.insert(1, (f"transformer_fa.TransformerLayer, FP8 {type(recipe).__name__}",
                          tfa_layer, recipe))
        base = base.with_name(f"{base.name}-fp8-{args.fp8}")
    for name, block, recipe in models:
        start = time.monotonic()
        trace = base.with_name(f"{base.name}-{re.sub(r'[^A-Za-z]+', '-', name)}trace.json")
        data["models"].append(profile_model(
            name, block, (layers, b, s, hidden, heads, ffn), args.device,
            DTYPES[dtype_name], steps, data["warmup"], trace if args.trace else None,
            recipe))
        m = data["models"][-1]
        print(f"{name}: {m['step_ms']} ms/step, peak {m['peak_mem_gb']} GB, saved per layer "
              f"{_mb(m['saved_per_layer']['activation_bytes'])} MiB "
              f"({time.monotonic() - start:.0f} s)", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    json_path = base.with_suffix(".json")
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    base.with_suffix(".md").write_text(markdown(data))
    print(f"wrote {json_path} and its .md")
    return json_path


if __name__ == "__main__":
    main()
