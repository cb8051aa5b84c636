"""make_graphed_callables on CUDA: a graphed TransformerLayer stack trains step for step as
the same stack run eagerly (bf16; FP8 with DelayedScaling and Float8CurrentScaling, whose
casts, amax records and scale updates are inside the graphs)."""
import copy

import pytest
import torch

import transformer_fa as te
from transformer_fa.common.recipe import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

RECIPES = {"bf16": None, "delayed": DelayedScaling, "current": Float8CurrentScaling}


def make_stack():
    return torch.nn.Sequential(*[
        te.TransformerLayer(256, 1024, 4, hidden_dropout=0.0, attention_dropout=0.0,
                            self_attn_mask_type="causal", attn_input_format="bshd",
                            params_dtype=torch.bfloat16, device="cuda")
        for _ in range(2)])


@pytest.mark.parametrize("name", list(RECIPES))
def test_graphed_stack_trains_as_the_eager_one(name):
    recipe = RECIPES[name]
    if recipe is not None and not te.is_fp8_available():
        pytest.skip(te.is_fp8_available(return_reason=True)[1])
    torch.manual_seed(0)
    model = make_stack()
    eager = copy.deepcopy(model)
    sample = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fp8_args = dict(fp8_enabled=True, fp8_recipe=recipe()) if recipe is not None else {}
    graphed = te.make_graphed_callables(model, (sample,), **fp8_args)
    # the capture's warm-up steps moved the FP8 state: start the eager stack from it
    eager.load_state_dict(model.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, eager)]
    for step in range(4):
        x = torch.randn_like(sample).requires_grad_()
        results = []
        for run, opt in ((graphed, opts[0]), (eager, opts[1])):
            xi = x.detach().clone().requires_grad_()
            opt.zero_grad(set_to_none=True)
            if run is eager and recipe is not None:
                with te.autocast(enabled=True, recipe=recipe()):
                    out = run(xi)
            else:
                out = run(xi)
            out.float().square().mean().backward()
            grads = [p.grad.clone() for p in (model if run is graphed else eager).parameters()]
            opt.step()
            results.append((out.detach().clone(), xi.grad.clone(), grads))
        (out_g, dx_g, grads_g), (out_e, dx_e, grads_e) = results
        assert torch.equal(out_g, out_e), f"step {step}: outputs differ"
        assert torch.equal(dx_g, dx_e), f"step {step}: input gradients differ"
        for i, (a, b) in enumerate(zip(grads_g, grads_e)):
            assert torch.equal(a, b), f"step {step}: parameter {i}'s gradient differs"
    for (name, a), b in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(a, b), f"{name} differs after 4 steps"
    metas = [(name, m.fp8_meta, e.fp8_meta) for (name, m), e in
             zip(model.named_modules(), eager.modules()) if getattr(m, "fp8_meta", None)]
    assert recipe is None or metas
    for name, a, b in metas:
        for field in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
            if isinstance(getattr(a, field, None), torch.Tensor):
                assert torch.equal(getattr(a, field), getattr(b, field)), f"{name}.{field}"


def test_graphed_backward_holds_the_end_of_pass_scale_update():
    """The backward's delayed update (an autograd callback at the end of the pass) is in the
    captured backward: each replayed step rolls every module's backward history once, and no
    update waits for a callback."""
    from transformer_fa import fp8
    if not te.is_fp8_available():
        pytest.skip(te.is_fp8_available(return_reason=True)[1])
    torch.manual_seed(0)
    model = make_stack()
    sample = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(model, (sample,), fp8_enabled=True,
                                        fp8_recipe=DelayedScaling())
    metas = [m.fp8_meta for m in model.modules() if getattr(m, "fp8_meta", None)]
    assert len(metas) == 6
    for _ in range(3):
        before = [meta.amax_history_bwd.clone() for meta in metas]
        graphed(torch.randn_like(sample).requires_grad_()).float().square().mean().backward()
        assert not fp8._STATE.metas_after_backward
        for meta, old in zip(metas, before):
            history = meta.amax_history_bwd
            assert torch.equal(history[1:-1], old[2:]) and (history[0] == 0).all()
            assert (history[-1] > 0).all()
