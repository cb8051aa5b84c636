"""FP8 under activation checkpointing (te.checkpoint, LayerNormMLP(checkpoint=True)) on CPU
(TRANSFORMER_FA_FP8_ON_CPU=1): the recomputation in the backward runs in the forward's FP8
autocast state with the scales the forward cast with, so training with checkpointing equals
training without it, bit for bit, whether the autocast is outside or inside the checkpointed
regions. tests/gpu/test_fp8_gpu.py runs train_stack on CUDA."""
import pytest
import torch

import transformer_fa as te
from transformer_fa import fp8
from transformer_fa.common.recipe import DelayedScaling, Float8CurrentScaling

RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling()]
RECIPE_IDS = ["delayed", "current"]
HIDDEN = 64


@pytest.fixture(autouse=True)
def allow_fp8_on_cpu(monkeypatch):
    monkeypatch.setenv("TRANSFORMER_FA_FP8_ON_CPU", "1")


def make_stack(checkpointed: bool, device="cpu", dtype=torch.float32, hidden=HIDDEN):
    torch.manual_seed(0)
    kwargs = dict(params_dtype=dtype, device=device)
    return torch.nn.ModuleDict(dict(
        linear=te.Linear(hidden, hidden, **kwargs),
        ln_linear=te.LayerNormLinear(hidden, hidden, **kwargs),
        mlp=te.LayerNormMLP(hidden, 2 * hidden, checkpoint=checkpointed, **kwargs),
        layer=te.TransformerLayer(hidden, 2 * hidden, 4, hidden_dropout=0.0,
                                  attention_dropout=0.0, **kwargs)))


def _forward(stack, x, recipe, checkpoint, autocast_inside):
    """Linear -> LayerNormLinear -> LayerNormMLP -> TransformerLayer, the first pair and the
    layer each one checkpointed region (when ``checkpoint`` is te.checkpoint's keywords).
    With ``autocast_inside`` each region enters the autocast itself (the MLP, checkpointing
    itself, is then inside the first region: nested checkpoints), else one autocast holds
    the whole stack."""

    def in_autocast(fn):
        def run(*args):
            with te.autocast(recipe=recipe):
                return fn(*args)
        return run if autocast_inside else fn

    def first(h):
        h = stack["ln_linear"](stack["linear"](h))
        return stack["mlp"](h) if autocast_inside else h

    regions = [in_autocast(first), in_autocast(stack["layer"])]
    if checkpoint is not None:
        regions = [lambda h, fn=fn: te.checkpoint(fn, h, **checkpoint) for fn in regions]
    if autocast_inside:
        return regions[1](regions[0](x))
    with te.autocast(recipe=recipe):
        return regions[1](stack["mlp"](regions[0](x)))


def train_stack(recipe, checkpoint=None, autocast_inside=False, steps=3, device="cpu",
                dtype=torch.float32, hidden=HIDDEN, seq=16):
    """Trains the stack ``steps`` SGD steps on [seq, 2, hidden] inputs; for each step the
    output, the gradients (input and parameters) and every module's FP8 state after the
    step. ``checkpoint``: None (no checkpointing) or te.checkpoint's keywords (the MLP then
    checkpoints itself as well)."""
    stack = make_stack(checkpoint is not None, device, dtype, hidden)
    optimizer = torch.optim.SGD(stack.parameters(), lr=0.05)
    generator = torch.Generator(device).manual_seed(1)
    trace = []
    for _ in range(steps):
        x = torch.randn(seq, 2, hidden, device=device, dtype=dtype, generator=generator,
                        requires_grad=True)
        out = _forward(stack, x, recipe, checkpoint, autocast_inside)
        # (mean: a sum's gradients make SGD diverge at the GPU test's sizes)
        out.float().square().mean().backward()
        step = [out.detach(), x.grad] + [p.grad.clone() for p in stack.parameters()]
        for module in stack.modules():
            meta = getattr(module, "fp8_meta", None)
            if meta is not None:
                step += [meta.amax_history_fwd.clone(), meta.scale_fwd.clone(),
                         meta.amax_history_bwd.clone(), meta.scale_bwd.clone()]
        trace.append(step)
        optimizer.step()
        optimizer.zero_grad()
    return trace


def assert_same_training(got, want):
    assert len(got) == len(want)
    # a diverged run (NaNs) would differ from itself: the training must stay finite
    assert all(torch.isfinite(t).all() for t in want[-1][:2]), "the reference training diverged"
    for step, (got_step, want_step) in enumerate(zip(got, want)):
        assert len(got_step) == len(want_step)
        for i, (a, b) in enumerate(zip(got_step, want_step)):
            assert torch.equal(a, b), f"step {step}, tensor {i} differs"


@pytest.mark.parametrize("autocast_inside", [False, True], ids=["autocast-outside",
                                                                "autocast-inside"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_checkpointed_training_equals_plain_training(recipe, use_reentrant, autocast_inside):
    """Outputs, all gradients, amax histories and scales after each of 3 steps. Autocast
    outside: the recomputation runs after the autocast exited and updated the forward
    scales (before the fix: CheckpointError, or high-precision recomputations). Inside:
    the recomputation's autocast exit must not update the forward scales a second time,
    and a reentrant forward (under no_grad) must update them once."""
    want = train_stack(recipe)
    got = train_stack(recipe, dict(use_reentrant=use_reentrant), autocast_inside)
    assert_same_training(got, want)
    state = fp8._STATE
    assert state.depth == 0 and not state.recording and state.replaying is None


def test_layernorm_mlp_checkpoint_recomputes_in_fp8():
    """LayerNormMLP(checkpoint=True) under an autocast that exits before the backward: the
    recomputation saves what the FP8 forward saved (today's main: CheckpointError, a
    high-precision recomputation saves a different number of tensors)."""
    for checkpointed in (True, False):
        torch.manual_seed(0)
        mlp = te.LayerNormMLP(HIDDEN, 2 * HIDDEN, checkpoint=checkpointed, device="cpu")
        x = torch.randn(32, HIDDEN, requires_grad=True)
        with te.autocast(recipe=DelayedScaling()):
            out = mlp(x)
        out.square().sum().backward()
        if checkpointed:
            got = [x.grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad]
    assert_same_training([got], [[x.grad, mlp.fc1_weight.grad, mlp.fc2_weight.grad]])


def test_retained_graph_recomputes_each_backward_with_the_forward_scales():
    """Each backward pass of a retained graph recomputes the region from its first FP8 GEMM,
    with the scales the forward cast with."""
    grads = []
    for checkpointed in (True, False):
        torch.manual_seed(0)
        mlp = te.LayerNormMLP(HIDDEN, 2 * HIDDEN, checkpoint=checkpointed, device="cpu")
        x = torch.randn(32, HIDDEN, requires_grad=True) * 3
        with te.autocast(recipe=DelayedScaling()):
            mlp(torch.randn(32, HIDDEN))  # a step: the scales are not 1 any more
            out = mlp(x)
        dy = torch.randn_like(out)
        out.backward(dy, retain_graph=True)
        out.backward(dy)
        grads.append([mlp.fc1_weight.grad, mlp.fc2_weight.grad,
                      mlp.fp8_meta.amax_history_bwd, mlp.fp8_meta.amax_history_fwd])
    assert_same_training([grads[0]], [grads[1]])


def test_calibration_is_recorded_once():
    """A calibrating autocast's recomputation re-enters calibration (high-precision GEMMs)
    without recording its amaxes into the next step's row."""
    histories = []
    for checkpointed in (True, False):
        torch.manual_seed(0)
        mlp = te.LayerNormMLP(HIDDEN, 2 * HIDDEN, checkpoint=checkpointed, device="cpu")
        with te.autocast(enabled=False, calibrating=True,
                         recipe=DelayedScaling(amax_history_len=3)):
            out = mlp(torch.randn(32, HIDDEN) * 5)
        out.sum().backward()
        histories.append(mlp.fp8_meta.amax_history_fwd)
    assert histories[1][0].eq(0).all() and histories[1].ne(0).any()
    assert torch.equal(*histories)


def test_recomputation_that_runs_other_fp8_gemms_is_an_error():
    """A checkpointed function whose recomputation runs other FP8 modules than its forward
    gets no silently mismatched scales."""
    torch.manual_seed(0)
    first, second = te.Linear(HIDDEN, HIDDEN, device="cpu"), te.Linear(HIDDEN, HIDDEN,
                                                                      device="cpu")
    calls = []

    def changes_its_mind(x):
        calls.append(1)
        return (first if len(calls) == 1 else second)(x)

    x = torch.randn(32, HIDDEN, requires_grad=True)
    with te.autocast(recipe=DelayedScaling()):
        out = te.checkpoint(changes_its_mind, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match="recomputation's FP8 GEMM number 1 is not the "
                                           "forward's"):
        out.sum().backward()
    state = fp8._STATE
    assert state.depth == 0 and state.replaying is None and not state.enabled


def test_checkpoint_core_attention_under_the_fp8_autocast():
    """TransformerLayer(checkpoint_core_attention=True) under an FP8 autocast: the core
    attention (no FP8 GEMMs) recomputes after the autocast exited; training equals the
    layer's without checkpointing."""
    traces = []
    for checkpointed in (True, False):
        torch.manual_seed(0)
        layer = te.TransformerLayer(HIDDEN, 2 * HIDDEN, 4, hidden_dropout=0.0,
                                    attention_dropout=0.0, device="cpu")
        x = torch.randn(16, 2, HIDDEN, requires_grad=True)
        trace = []
        for _ in range(2):
            with te.autocast(recipe=DelayedScaling()):
                out = layer(x, checkpoint_core_attention=checkpointed)
            out.square().sum().backward()
            trace.append([out.detach(), x.grad.clone()]
                         + [p.grad.clone() for p in layer.parameters()])
        traces.append(trace)
    assert_same_training(*traces)
