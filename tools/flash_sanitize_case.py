"""A small varlen forward for compute-sanitizer (racecheck / memcheck): thd, ragged lengths
that are not multiples of the tiles, GQA, causal bottom-right, both head dims, every tile
variant. See tests/gpu/README.md for the commands."""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from transformer_fa.attention.backends import flash  # noqa: E402

assert flash._extension() is not None, flash._ext_error
lens_q, lens_k = [37, 130, 1, 70], [50, 129, 9, 200]
cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32,
                    device="cuda")
cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32,
                    device="cuda")
for d in (64, 128):
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(sum(lens_q), 4, d, device="cuda", dtype=dtype)
        k = torch.randn(sum(lens_k), 2, d, device="cuda", dtype=dtype)
        v = torch.randn(sum(lens_k), 2, d, device="cuda", dtype=dtype)
        for variant in range(5):
            for left, right, br in ((-1, -1, False), (-1, 0, True), (16, 0, False)):
                out, lse = flash._fwd_impl(q, k, v, cu_q, cu_k, "thd", "thd", max(lens_q),
                                           max(lens_k), 1 / math.sqrt(d), left, right, br,
                                           True, variant)
torch.cuda.synchronize()
print("sanitize case done", out.float().abs().sum().item())
