import sys, time, subprocess, torch
sys.path.insert(0, ".")
from benchmarks.bench_attention import TorchBlock, tfa_layer
def clocks():
    return subprocess.run(["nvidia-smi","--query-gpu=clocks.sm,temperature.gpu,power.draw,clocks_throttle_reasons.active","--format=csv,noheader"],capture_output=True,text=True).stdout.strip()
def run(block, steps=20):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[block(2048, 16, 8192, torch.bfloat16, "cuda") for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(2, 4096, 2048, dtype=torch.bfloat16, device="cuda")
    def step():
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()
    for _ in range(3): step()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(steps): step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e3
for rnd in range(3):
    for name, block in (("torch", TorchBlock), ("ours", tfa_layer)):
        ms = run(block)
        print(rnd, name, f"{ms:.1f} ms", clocks(), flush=True)
        torch.cuda.empty_cache()
