"""FP8 GEMMs on CUDA (compute capability 8.9+): Linear and LayerNormMLP forward and backward in
bf16 against the bf16 result, for both recipes."""
import pytest
import torch

import transformer_fa as te
from transformer_fa.common.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.skipif(not te.is_fp8_available(), reason="needs CUDA with FP8")


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_fp8_close_to_bf16(recipe, module):
    torch.manual_seed(0)
    mod = getattr(te, module)(256, 512, params_dtype=torch.bfloat16, device="cuda")
    for step in range(3):  # delayed: the first step runs at scale 1 (TE's)
        x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with te.fp8_autocast(fp8_recipe=recipe):
            out = mod(x)
        out.float().square().sum().backward()
        got = [out, x.grad] + [p.grad for p in mod.parameters()]
        x.grad = None
        mod.zero_grad()
        ref = mod(x)
        ref.float().square().sum().backward()
        want = [ref, x.grad] + [p.grad for p in mod.parameters()]
        x.grad = None
        mod.zero_grad()
        assert all(g.dtype == torch.bfloat16 for g in got)
        if step > 0 or isinstance(recipe, Float8CurrentScaling):
            for g, w in zip(got, want):
                assert ((g.float() - w.float()).norm() / w.float().norm()) < 0.15
