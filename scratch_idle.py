"""Scratch: GPU idle inside the layer benchmark's step (kernel timeline from torch.profiler)."""
import sys
import torch
from torch.autograd.profiler_util import DeviceType
sys.path.insert(0, ".")
from benchmarks.bench_attention import TorchBlock, tfa_layer
import transformer_fa as tfa

def model_step(kind):
    block = TorchBlock if kind == "torch" else tfa_layer
    model = torch.nn.Sequential(*[block(2048, 16, 8192, torch.bfloat16, "cuda") for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(2, 4096, 2048, device="cuda", dtype=torch.bfloat16)
    if kind == "fp8-graph":
        model = tfa.make_graphed_callables(model, (x,), fp8_enabled=True,
                                           fp8_recipe=tfa.common.recipe.DelayedScaling())
    def step():
        opt.zero_grad(set_to_none=True)
        with torch.profiler.record_function("STEP fwd"):
            out = model(x)
        with torch.profiler.record_function("STEP bwd"):
            out.float().square().mean().backward()
        with torch.profiler.record_function("STEP opt"):
            opt.step()
    return step

for kind in sys.argv[1:]:
    step = model_step(kind)
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    ev = prof.events()
    ks = sorted([(e.time_range.start, e.time_range.end, e.name) for e in ev
                 if e.device_type == DeviceType.CUDA], key=lambda t: t[0])
    cpu = [(e.time_range.start, e.time_range.end, e.name) for e in ev
           if e.name.startswith("STEP ")]
    span = ks[-1][1] - ks[0][0]
    busy, gaps, end, prev = 0.0, [], ks[0][0], ""
    for s, e, n in ks:
        if s > end:
            gaps.append((s - end, end - ks[0][0], prev, n))
        if e > end:
            busy += e - max(s, end)
            end = e
        prev = n
    print(f"== {kind}: 3 steps, kernels span {span/1e3:.2f} ms, busy {busy/1e3:.2f}, idle "
          f"{(span-busy)/1e3:.2f} ms; gaps > 5 us: {sum(g[0] for g in gaps if g[0] > 5)/1e3:.2f} ms in "
          f"{sum(1 for g in gaps if g[0] > 5)}", flush=True)
    for g in sorted(gaps, reverse=True)[:10]:
        print(f"   gap {g[0]:.0f} us at +{g[1]/1e3:.2f} ms: after {g[2][:60]} | before {g[3][:60]}")
    for s, e, n in cpu[:6]:
        print(f"   cpu {n}: {(e-s)/1e3:.2f} ms at +{(s-ks[0][0])/1e3:.2f}")
    step = None
    torch.cuda.empty_cache()
