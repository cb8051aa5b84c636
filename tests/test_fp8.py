"""FP8 training with TE's API on CPU: torch._scaled_mm runs FP8 GEMMs on CPU, which
TRANSFORMER_FA_FP8_ON_CPU=1 allows (the recipes' bookkeeping and the GEMM numerics are the
same as on a GPU)."""
import math

import pytest
import torch

import transformer_fa as te
from transformer_fa import fp8
from transformer_fa.common.recipe import (DelayedScaling, Float8CurrentScaling, Format, MMParams,
                                          QParams)

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


@pytest.fixture(autouse=True)
def allow_fp8_on_cpu(monkeypatch):
    monkeypatch.setenv("TRANSFORMER_FA_FP8_ON_CPU", "1")


def _linear(inp=32, out=48, **kwargs):
    torch.manual_seed(0)
    return te.Linear(inp, out, device="cpu", **kwargs)


def _dequantized(t, scale):
    """What an E4M3 cast with this scale keeps of t (TE's saturating cast)."""
    return (t * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() / scale


def test_cpu_needs_the_opt_in(monkeypatch):
    monkeypatch.delenv("TRANSFORMER_FA_FP8_ON_CPU")
    if torch.cuda.is_available():
        pytest.skip("checks the answer without CUDA")
    assert te.is_fp8_available(return_reason=True)[0] is False
    with pytest.raises(ValueError, match="fp8_autocast.*compute capability 8.9"), \
            pytest.deprecated_call():
        te.fp8_autocast(enabled=True)


def test_delayed_scaling_bookkeeping_follows_te_formulas():
    """First step at scale 1; after it the amax is taken from the history, the scale is
    (fp8_max / amax) / 2**margin and the history rolls with row 0 cleared."""
    lin = _linear()
    recipe = DelayedScaling(margin=1, amax_history_len=3, amax_compute_algo="max")
    meta = lin.fp8_meta
    amaxes = []
    for step, gain in enumerate((4.0, 1.0)):
        x = torch.randn(16, 32) * gain
        with te.autocast(recipe=recipe):
            if step == 0:
                out = lin(x)
                w_amax = lin.weight.abs().max()
                # scale 1 in the first step: the output is the plain E4M3 cast's GEMM
                ref = _dequantized(x, 1.0) @ _dequantized(lin.weight.detach(), 1.0).T
                torch.testing.assert_close(out, ref + lin.bias, atol=1e-5, rtol=1e-5)
            else:
                lin(x)
        amaxes.append(x.abs().max())
        # history rolled: the newest amax is the last row, row 0 cleared
        torch.testing.assert_close(meta.amax_history_fwd[-1, 0], amaxes[-1])
        assert meta.amax_history_fwd[0].eq(0).all()
        expected = E4M3_MAX / max(amaxes) / 2
        torch.testing.assert_close(meta.scale_fwd[0], expected)
        torch.testing.assert_close(meta.scale_fwd[1], E4M3_MAX / w_amax / 2)
    # "most_recent" takes the newest amax only
    history = torch.tensor([[3.0], [0.0], [8.0]])
    scale = torch.ones(1)
    fp8.update_amax_history(history, scale, E4M3_MAX,
                            DelayedScaling(amax_compute_algo="most_recent"))
    torch.testing.assert_close(scale, torch.tensor([E4M3_MAX / 3]))
    torch.testing.assert_close(history, torch.tensor([[0.0], [8.0], [3.0]]))


def test_scale_keeps_the_old_value_for_zero_or_inf_amax():
    old = torch.tensor([2.0, 2.0, 2.0, 2.0])
    amax = torch.tensor([0.0, float("inf"), 1e-45, 4.0])
    new = fp8.compute_scale(amax, old, E4M3_MAX, margin=0)
    assert new.tolist()[:2] == [2.0, 2.0]
    assert new[2] == torch.finfo(torch.float32).max and new[3] == E4M3_MAX / 4


def test_scale_is_the_ieee_quotient():
    """(fp8_max / amax) / 2**margin with one rounding per division (TE's kernel's), not the
    reciprocal times fp8_max that a Python float over a tensor computes."""
    amax = torch.rand(10000) * 100 + 1e-3
    new = fp8.compute_scale(amax, torch.ones_like(amax), E4M3_MAX, margin=2)
    assert torch.equal(new, torch.full_like(amax, E4M3_MAX) / amax / 4)
    assert not torch.equal(new, amax.reciprocal() * E4M3_MAX / 4)


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_linear_forward_backward_close_to_high_precision(recipe):
    """Within FP8's precision of the fp32 result: E4M3 keeps 3 mantissa bits (rounding up to
    6% per operand, TE's tests allow rtol 0.125), E5M2 gradients 2 bits (TE: rtol 0.25). The delayed recipe's first step runs at scale 1 (TE's), where the small weights
    fall into E4M3's subnormals; from the second step its scales come from the amaxes."""
    lin = _linear()
    for step in range(3):
        x = torch.randn(2, 16, 32, requires_grad=True)
        dy = torch.randn(2, 16, 48)
        with te.autocast(recipe=recipe):
            out = lin(x)
        out.backward(dy)
        grads = (x.grad, lin.weight.grad, lin.bias.grad)
        x.grad = None
        lin.zero_grad()
        ref = lin(x)
        ref.backward(dy)
        wants = (ref, x.grad, lin.weight.grad, lin.bias.grad)
        for got, want, tol in zip((out,) + grads, wants, (0.1, 0.15, 0.15, 1e-6)):
            assert got.dtype == want.dtype
            if step > 0 or isinstance(recipe, Float8CurrentScaling):
                assert (got - want).norm() / want.norm() < tol
        x.grad = None
        lin.zero_grad()


def test_current_scaling_forward_is_the_scaled_e4m3_gemm():
    lin = _linear()
    x = torch.randn(16, 32)
    with te.autocast(recipe=Float8CurrentScaling()):
        out = lin(x)
    w = lin.weight.detach()
    ref = _dequantized(x, E4M3_MAX / x.abs().max()) @ _dequantized(w, E4M3_MAX / w.abs().max()).T
    torch.testing.assert_close(out, ref + lin.bias, atol=1e-5, rtol=1e-5)


def _scaled_mm_spy(monkeypatch, record):
    """record(a, b, split_accumulation, bias) of each FP8 GEMM, in order (a list)."""
    calls = []
    real = fp8._scaled_mm

    def spy(a, b, scale_a, scale_b, out_dtype, split_accumulation, bias=None):
        calls.append(record(a, b, split_accumulation, bias))
        return real(a, b, scale_a, scale_b, out_dtype, split_accumulation, bias)

    monkeypatch.setattr(fp8, "_scaled_mm", spy)
    return calls


def _scaled_mm_calls(monkeypatch):
    """(a's dtype, b's dtype, split_accumulation, bias) of each FP8 GEMM."""
    return _scaled_mm_spy(monkeypatch, lambda a, b, split, bias: (a.dtype, b.dtype, split, bias))


@pytest.mark.parametrize("fmt, grad_dtype", [(Format.HYBRID, torch.float8_e5m2),
                                             (Format.E4M3, torch.float8_e4m3fn)])
def test_gradient_format_follows_the_recipe(monkeypatch, fmt, grad_dtype):
    calls = _scaled_mm_calls(monkeypatch)
    lin = _linear()
    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast(recipe=DelayedScaling(fp8_format=fmt)):
        out = lin(x)
    out.sum().backward()
    e4m3 = torch.float8_e4m3fn
    assert [c[:2] for c in calls] == [(e4m3, e4m3), (grad_dtype, e4m3), (grad_dtype, e4m3)]


@pytest.mark.parametrize("recipe, expected", [
    (DelayedScaling(), [False, True, True]),  # TE's modules: fast accumulation forward only
    (Float8CurrentScaling(), [False, True, True]),  # its fp8_gemm_* defaults say the same
    (Float8CurrentScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=True)),
     [True, True, True]),
    (Float8CurrentScaling(fp8_gemm_dgrad=MMParams(False), fp8_gemm_wgrad=MMParams(False)),
     [False, False, False]),
], ids=["delayed", "current", "current-split-fprop", "current-fast-backward"])
def test_gemm_accumulation_follows_the_recipe(monkeypatch, recipe, expected):
    """The forward, dgrad and wgrad GEMMs (in that order) split their accumulation as the
    recipe's MMParams say (TE's fp8_gemm_fprop / _dgrad / _wgrad; delayed scaling has no such
    fields and takes TE's module constants)."""
    calls = _scaled_mm_calls(monkeypatch)
    lin = _linear()
    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast(recipe=recipe):
        out = lin(x)
    out.sum().backward()
    assert [c[2] for c in calls] == expected


def test_current_scaling_quantization_params_are_tes():
    recipe = Float8CurrentScaling()
    assert recipe.fp8_quant_fwd_inp == recipe.fp8_quant_fwd_weight == \
        recipe.fp8_quant_bwd_grad == QParams(power_2_scale=False, amax_epsilon=0.0)
    assert recipe.fp8_gemm_fprop == MMParams(use_split_accumulator=False)
    assert recipe.fp8_gemm_dgrad == recipe.fp8_gemm_wgrad == MMParams()
    for field, value in (("fp8_quant_fwd_inp", QParams(power_2_scale=True)),
                         ("fp8_quant_bwd_grad", QParams(amax_epsilon=1e-6))):
        with pytest.raises(ValueError, match=rf"Float8CurrentScaling\({field}=.*not supported"):
            Float8CurrentScaling(**{field: value})
    with pytest.raises(TypeError, match="fp8_gemm_wgrad must be a recipe.MMParams"):
        Float8CurrentScaling(fp8_gemm_wgrad=True)
    with pytest.raises(TypeError, match="fp8_quant_fwd_weight must be a recipe.QParams"):
        Float8CurrentScaling(fp8_quant_fwd_weight=None)


def test_weight_is_cast_once_per_version(monkeypatch):
    casts = []
    real = fp8._quantize

    def spy(tensor, *args, **kwargs):
        casts.append(tensor.shape)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(fp8, "_quantize", spy)
    lin = _linear()
    x = torch.randn(16, 32)
    with te.autocast(recipe=Float8CurrentScaling()):
        lin(x)
        lin(x)
        assert casts.count(lin.weight.shape) == 1
        with torch.no_grad():
            lin.weight.mul_(2)  # an optimizer step bumps the version
        lin(x)
    assert casts.count(lin.weight.shape) == 2


def test_nested_autocast_takes_the_inner_settings():
    lin = _linear()
    x = torch.randn(16, 32)
    with te.autocast(recipe=Float8CurrentScaling()):
        fp8_out = lin(x)
        with te.autocast(enabled=False):
            assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        assert torch.equal(lin(x), fp8_out)
    assert not fp8.fp8_enabled()


def test_calibration_records_amaxes_in_high_precision():
    lin = _linear()
    x = torch.randn(16, 32) * 3
    with te.autocast(enabled=False, calibrating=True,
                     recipe=DelayedScaling(amax_history_len=2)):
        out = lin(x)
    assert torch.equal(out, torch.nn.functional.linear(x, lin.weight, lin.bias))
    torch.testing.assert_close(lin.fp8_meta.scale_fwd[0], E4M3_MAX / x.abs().max())


@pytest.mark.parametrize("module", ["LayerNormLinear", "LayerNormMLP"])
def test_fused_modules_run_their_gemms_in_fp8(monkeypatch, module):
    calls = []
    real = fp8._scaled_mm
    monkeypatch.setattr(fp8, "_scaled_mm", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    mod = getattr(te, module)(32, 64, device="cpu")
    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast():
        out = mod(x)
    out.sum().backward()
    gemms = 2 if module == "LayerNormMLP" else 1
    assert len(calls) == 3 * gemms
    assert mod.fp8_meta.scale_fwd.shape == (2 * gemms,)
    assert (mod.fp8_meta.scale_bwd != 1).all()  # the backward updated its delayed scales
    ref = mod(x)
    assert (out - ref).norm() / ref.norm() < 0.06


def test_extra_state_round_trip():
    lin = _linear()
    with te.autocast(recipe=DelayedScaling(amax_history_len=4)):
        lin(torch.randn(16, 32, requires_grad=True)).sum().backward()
    state = lin.state_dict()
    assert "_extra_state" in state
    fresh = _linear()
    fresh.load_state_dict(state)
    for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert torch.equal(getattr(fresh.fp8_meta, key), getattr(lin.fp8_meta, key))
    assert fresh.fp8_meta.recipe == lin.fp8_meta.recipe
    # a module that never ran FP8 (or current scaling) has empty extra state, as TE's
    assert _linear().state_dict()["_extra_state"].numel() == 0
    mlp = te.LayerNormMLP(32, 64, device="cpu")
    with pytest.raises(ValueError, match="this module has 2"):
        mlp.set_extra_state(state["_extra_state"])


def test_bad_recipes_and_shapes_are_named():
    with pytest.raises(TypeError, match="fp8_recipe must be"), pytest.deprecated_call():
        te.fp8_autocast(fp8_recipe="delayed")
    with pytest.raises(ValueError, match="E5M2"):
        DelayedScaling(fp8_format=Format.E5M2)
    lin = _linear(32, 40)
    with te.autocast(), pytest.raises(ValueError, match=r"Linear: FP8 GEMMs need features"):
        lin(torch.randn(16, 32))
    with te.autocast(), pytest.raises(ValueError, match="tokens"):
        _linear()(torch.randn(3, 32))


@pytest.mark.parametrize("field", ["fp8_dpa", "fp8_mha"])
@pytest.mark.parametrize("recipe", [DelayedScaling, Float8CurrentScaling])
def test_fp8_attention_recipes_are_refused_by_name(recipe, field):
    """No FP8 attention: a recipe asking for it is an error in the attention (TE refuses
    where no backend serves it), not a silent bf16 attention; the same recipe without it
    runs the layer."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                device="cpu")
    x = torch.randn(16, 2, 32)
    with te.autocast(recipe=recipe(**{field: True})):
        with pytest.raises(ValueError, match=rf"{recipe.__name__}\({field}=True\).*not "
                                             rf"supported.*{field}=False"):
            layer(x)
    with te.autocast(recipe=recipe()):
        assert layer(x).shape == x.shape
    # outside an autocast the recipe's fields do not matter
    assert te.DotProductAttention(2, 16)(x.view(16, 2, 2, 16), x.view(16, 2, 2, 16),
                                         x.view(16, 2, 2, 16)).shape == (16, 2, 32)


def test_transformer_layer_trains_close_to_high_precision():
    def train(recipe):
        torch.manual_seed(0)
        layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                    device="cpu")
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
        torch.manual_seed(1)
        x = torch.randn(16, 2, 64)
        target = torch.randn(16, 2, 64)
        losses = []
        for _ in range(6):
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                out = layer(x)
            loss = torch.nn.functional.mse_loss(out, target)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    high = train(None)
    for recipe in (DelayedScaling(), Float8CurrentScaling()):
        low = train(recipe)
        assert low[-1] < low[0]
        for a, b in zip(low, high):
            assert abs(a - b) / b < 0.02


def _fp8_gemm(x, weight, recipe):
    """fp8_matmul under an autocast: its output, its backward node (for the tensors it saved)
    and the weight's cached cast (a delayed recipe clears the cache at the autocast's exit)."""
    meta = fp8.FP8Meta()
    with te.autocast(recipe=recipe):
        out = fp8.fp8_matmul(x, weight, meta)
        cached = meta.weight_cache[0][1]
    assert out.grad_fn is None or type(out.grad_fn).__name__ == "_FP8MatmulBackward"
    return out, out.grad_fn, cached


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_gemm_operands_are_cast_in_the_orientations_the_gemms_need(recipe):
    """The forward saves the input's FP8 transpose (for the wgrad) and the weight's (for the
    dgrad), each the transpose of the forward's operand; a gradient nobody needs saves none,
    and under no_grad the weight cache holds no transpose."""
    torch.manual_seed(0)
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    _, node, (w_fp8, cached_w_t, _) = _fp8_gemm(x, w, recipe)
    x_t, _, w_t, _ = node.saved_tensors
    assert x_t.shape == (32, 16) and x_t.is_contiguous() and x_t.dtype == torch.float8_e4m3fn
    assert w_t is cached_w_t and w_t.is_contiguous()
    assert torch.equal(w_t.view(torch.uint8), w_fp8.t().view(torch.uint8))
    x_fp8, x_t_again, _ = fp8._quantize(x, Format.E4M3, E4M3_MAX, Float8CurrentScaling(),
                                        torch.zeros(1, 1), torch.ones(1), 0, columnwise=True)
    assert torch.equal(x_t_again.view(torch.uint8), x_fp8.t().view(torch.uint8))
    if isinstance(recipe, Float8CurrentScaling):
        assert torch.equal(x_t.view(torch.uint8), x_t_again.view(torch.uint8))

    frozen_w = w.detach()
    x_t, _, w_t, _ = _fp8_gemm(x, frozen_w, recipe)[1].saved_tensors
    assert x_t is None and w_t is not None
    x_t, _, w_t, _ = _fp8_gemm(x.detach(), w, recipe)[1].saved_tensors
    assert x_t is not None and w_t is None
    with torch.no_grad():
        out, node, (_, w_t, _) = _fp8_gemm(x, w, recipe)
    assert node is None and w_t is None


def test_gradient_is_cast_once_in_the_orientations_needed(monkeypatch):
    asked = []
    real = fp8._quantize

    def spy(tensor, *args, rowwise=True, columnwise=False, **options):
        asked.append((tuple(tensor.shape), rowwise, columnwise))
        return real(tensor, *args, rowwise=rowwise, columnwise=columnwise, **options)

    monkeypatch.setattr(fp8, "_quantize", spy)
    x = torch.randn(16, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    for inputs, dgrad, wgrad in (((x, w), True, True), ((x, w.detach()), True, False),
                                 ((x.detach(), w), False, True)):
        asked.clear()
        out, _, _ = _fp8_gemm(*inputs, DelayedScaling())
        out.backward(torch.randn_like(out))
        assert asked[-1] == ((16, 48), dgrad, wgrad)  # the gradient's cast, in the backward


def test_2d_inputs_skip_the_reshapes():
    x = torch.randn(16, 32, requires_grad=True)
    out, node, _ = _fp8_gemm(x, torch.randn(48, 32), DelayedScaling())
    assert out.shape == (16, 48) and node is out.grad_fn
    with te.autocast(recipe=DelayedScaling()):
        out = fp8.fp8_matmul(x.reshape(2, 8, 32), torch.randn(48, 32), fp8.FP8Meta())
    assert out.shape == (2, 8, 48) and "View" in type(out.grad_fn).__name__


def test_a_meta_joins_the_update_queue_once_per_autocast():
    lin = _linear()
    x = torch.randn(16, 32)
    with te.autocast(recipe=DelayedScaling()):
        lin(x)
        lin(x)
        assert list(fp8._STATE.metas_to_update) == [lin.fp8_meta]
    assert not fp8._STATE.metas_to_update


def test_backward_update_acts_on_loaded_state():
    """The end-of-backward update reads the module's state when it runs: after a state load,
    the loaded history (its newest amax 7) decides the gradient's scale."""
    lin = _linear()
    recipe = DelayedScaling(amax_history_len=2)
    with te.autocast(recipe=recipe):
        lin(torch.randn(16, 32, requires_grad=True)).sum().backward()
    meta = lin.fp8_meta
    meta.amax_history_bwd[-1] = 7.0
    meta.set_extra_state(meta.get_extra_state(), torch.device("cpu"))
    dy = torch.full((16, 48), 0.5)
    with te.autocast(recipe=recipe):
        out = lin(torch.randn(16, 32, requires_grad=True))
    out.backward(dy)
    assert meta.amax_history_bwd.tolist() == [[0.0], [0.5]]  # rolled: 7 went to row 0
    torch.testing.assert_close(meta.scale_bwd, torch.tensor([E5M2_MAX / 7]))


def test_a_cached_weight_cast_gains_its_transpose_once_needed():
    """A no_grad forward caches the weight without its transpose; the next forward that needs
    the dgrad casts it again with the transpose, to the same FP8 bytes."""
    torch.manual_seed(0)
    lin = _linear()
    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast(recipe=Float8CurrentScaling()):
        with torch.no_grad():
            lin(x)
        w_fp8, w_t, _ = lin.fp8_meta.weight_cache[0][1]
        assert w_t is None
        lin(x).sum().backward()
    w_fp8_again, w_t, _ = lin.fp8_meta.weight_cache[0][1]
    assert torch.equal(w_fp8.view(torch.uint8), w_fp8_again.view(torch.uint8))
    assert torch.equal(w_t.view(torch.uint8), w_fp8.t().view(torch.uint8))


def _gemm_biases(monkeypatch):
    """The bias each FP8 GEMM got in its epilogue (None: none)."""
    return _scaled_mm_spy(monkeypatch, lambda a, b, split, bias: bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_bias_is_added_in_the_fp8_gemms_epilogue(monkeypatch, dtype, recipe):
    """A 16-bit Linear's bias goes into the forward GEMM (one rounding instead of two): the
    output within one rounding of the separate add's, the gradients (the bias's from the
    backward's sum over the tokens) equal to the separate add's."""
    biases = _gemm_biases(monkeypatch)
    torch.manual_seed(1)
    x = (torch.randn(2, 16, 32) * 3).to(dtype)
    dy = torch.randn(2, 16, 48).to(dtype)
    results = []
    for epilogue in (True, False):
        monkeypatch.setattr(fp8, "_bias_fits_epilogue",
                            (lambda bias, out_dtype: True) if epilogue else (lambda *a: False))
        lin = _linear(params_dtype=dtype)
        with torch.no_grad():
            lin.bias.copy_(torch.randn(48) * 5)
        biases.clear()
        for _ in range(2):  # the delayed recipe's second step runs on the recorded scales
            inp = x.clone().requires_grad_()
            with te.autocast(recipe=recipe):
                out = lin(inp)
            out.backward(dy)
        assert [b is lin.bias for b in biases] == [epilogue, False, False] * 2
        results.append((out, inp.grad, lin.weight.grad, lin.bias.grad))
    (out, *grads), (want, *want_grads) = results
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), want.float(), rtol=eps, atol=eps)
    assert not torch.equal(out, want)  # the epilogue rounds once, the add twice
    for got, expected in zip(grads, want_grads, strict=True):
        assert torch.equal(got, expected)


def test_bias_outside_the_epilogue_where_scaled_mm_takes_none(monkeypatch):
    """A float32 output (torch._scaled_mm takes no bias there) and a bias of another dtype get
    the add after the GEMM; a frozen bias gets no gradient."""
    biases = _gemm_biases(monkeypatch)
    x = torch.randn(16, 32, requires_grad=True)
    for params_dtype, bias_dtype in ((torch.float32, torch.float32),
                                     (torch.bfloat16, torch.float32)):
        lin = _linear(params_dtype=params_dtype)
        bias = lin.bias.detach().to(bias_dtype).requires_grad_()
        biases.clear()
        with te.autocast(recipe=Float8CurrentScaling()):
            out = fp8.fp8_matmul(x.to(params_dtype), lin.weight, lin.fp8_meta, bias=bias)
            ref = fp8.fp8_matmul(x.to(params_dtype), lin.weight, lin.fp8_meta)
        assert biases == [None, None]
        assert torch.equal(out, ref + bias)
        out.sum().backward()
        torch.testing.assert_close(bias.grad, torch.full_like(bias, 16.0))
    lin = _linear(params_dtype=torch.bfloat16)
    lin.bias.requires_grad_(False)
    with te.autocast(recipe=Float8CurrentScaling()):
        out = lin(x.to(torch.bfloat16))
    out.sum().backward()
    assert lin.bias.grad is None and lin.weight.grad is not None


def test_returned_and_row_parallel_biases_stay_out_of_the_gemm(monkeypatch):
    """parallel_linear hands the bias to the FP8 GEMM only where it is added right there: a
    returned bias is not added, a row-parallel one is added after the sum over the ranks."""
    from transformer_fa import parallel
    from transformer_fa.module.linear import parallel_linear

    biases = _gemm_biases(monkeypatch)
    monkeypatch.setattr(parallel, "row_parallel_output", lambda out, group, sp: out * 2)
    lin = _linear(params_dtype=torch.bfloat16)
    x = torch.randn(16, 32).to(torch.bfloat16)
    with te.autocast(recipe=Float8CurrentScaling()):
        gemm = fp8.fp8_matmul(x, lin.weight, lin.fp8_meta)
        out, bias = parallel_linear(x, lin.weight, lin.bias, return_bias=True,
                                    fp8_meta=lin.fp8_meta)
        assert torch.equal(out, gemm) and torch.equal(bias, lin.bias)
        out, _ = parallel_linear(x, lin.weight, lin.bias, row_group=object(),
                                 fp8_meta=lin.fp8_meta)
        assert torch.equal(out, gemm * 2 + lin.bias)
        assert all(b is None for b in biases)
        parallel_linear(x, lin.weight, lin.bias, fp8_meta=lin.fp8_meta)
        assert biases[-1] is lin.bias


def _chain(n=2, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[te.Linear(32, 32, device="cpu") for _ in range(n)])


def test_delayed_backward_bookkeeping_follows_te_formulas():
    """The output gradient's amax goes into the backward history; at the end of each backward
    pass the scale is (E5M2's max / amax) / 2**margin with the amax from the history, and
    the history rolls with row 0 cleared."""
    lin = _linear()
    recipe = DelayedScaling(margin=1, amax_history_len=3)
    amaxes = []
    for gain in (4.0, 1.0, 0.5):
        with te.autocast(recipe=recipe):
            out = lin(torch.randn(16, 32, requires_grad=True))
        dy = torch.randn(16, 48) * gain
        out.backward(dy)
        amaxes.append(dy.abs().max())
        meta = lin.fp8_meta
        newest = ([torch.tensor(0.0)] * 2 + amaxes)[-2:]  # the last row the newest
        torch.testing.assert_close(meta.amax_history_bwd[:, 0],
                                   torch.stack([torch.tensor(0.0)] + newest))
        torch.testing.assert_close(meta.scale_bwd[0], E5M2_MAX / max(amaxes[-3:]) / 2)


def test_backward_scales_update_at_the_end_of_the_pass():
    """TE's timing: no module's backward scales change during the backward pass (the
    second Linear's backward runs first; when the first one's is done, the second's amax
    waits in row 0); all are updated once the pass ends."""
    stack = _chain()
    seen = {}

    def snapshot(grad):
        for i, lin in enumerate(stack):
            seen[i] = (lin.fp8_meta.amax_history_bwd.clone(), lin.fp8_meta.scale_bwd.clone())

    x = torch.randn(16, 32, requires_grad=True)
    x.register_hook(snapshot)  # runs after the first Linear's backward
    with te.autocast(recipe=DelayedScaling(amax_history_len=2)):
        out = stack(x)
    out.sum().backward()
    for i, lin in enumerate(stack):
        history, scale = seen[i]
        assert history[0, 0] > 0 and history[1, 0] == 0 and scale[0] == 1
        meta = lin.fp8_meta
        assert meta.amax_history_bwd[0, 0] == 0
        assert meta.amax_history_bwd[1, 0] == history[0, 0]
        torch.testing.assert_close(meta.scale_bwd[0], E5M2_MAX / history[0, 0])


def test_one_update_per_pass_for_all_modules(monkeypatch):
    """A TransformerLayer stack: one update of all its modules' forward scales at the
    autocast's exit and one of all their backward scales at the end of the backward pass."""
    calls = []
    real = fp8.update_delayed_scales
    monkeypatch.setattr(fp8, "update_delayed_scales",
                        lambda metas, forward: calls.append((len(metas), forward))
                        or real(metas, forward))
    torch.manual_seed(0)
    stack = torch.nn.Sequential(*[te.TransformerLayer(64, 128, 4, hidden_dropout=0.0,
                                                      attention_dropout=0.0, device="cpu")
                                  for _ in range(2)])
    for _ in range(2):
        with te.autocast(recipe=DelayedScaling()):
            out = stack(torch.randn(16, 2, 64))
        assert calls[-1] == (6, True)  # three FP8 modules per layer
        out.sum().backward()
        assert calls[-1] == (6, False)
    assert len(calls) == 4
    assert not fp8._STATE.metas_after_backward and not fp8._STATE.backward_passes


def test_weight_sharing_updates_the_backward_scales_once_per_pass():
    """A Linear applied twice: both of its GEMM backwards record into row 0 and cast with the
    step's scale; one update at the end of the pass (TE's), not one per GEMM."""
    torch.manual_seed(0)
    lin = te.Linear(32, 32, device="cpu")
    recipe = DelayedScaling(amax_history_len=4, margin=1)
    for step in range(2):
        x = torch.randn(16, 32, requires_grad=True)
        with te.autocast(recipe=recipe):
            inner = lin(x)
            inner.retain_grad()
            out = lin(inner)
        dy = torch.randn(16, 32) * 3
        out.backward(dy)
        amax = torch.maximum(dy.abs().max(), inner.grad.abs().max())
        history = lin.fp8_meta.amax_history_bwd[:, 0]
        assert history[-1] == amax and history[0] == 0
        assert (history[1:-1] != 0).sum() == step  # one roll per pass
        torch.testing.assert_close(lin.fp8_meta.scale_bwd[0],
                                   E5M2_MAX / history.max() / 2)


def _train_chain(stack, backward, steps=2):
    recipe = DelayedScaling(amax_history_len=3)
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 32, requires_grad=True)
        with te.autocast(recipe=recipe):
            out = stack(x)
        backward(_loss(out), [x, *stack.parameters()])
    return [t for lin in stack for t in (lin.fp8_meta.amax_history_fwd, lin.fp8_meta.scale_fwd,
                                         lin.fp8_meta.amax_history_bwd,
                                         lin.fp8_meta.scale_bwd)]


def _loss(out):
    return out.square().sum()


def test_backward_update_through_autograd_grad_and_retain_graph():
    """torch.autograd.grad updates as .backward() does; a retained graph's second backward is
    a second pass, with its own update."""
    want = _train_chain(_chain(), lambda loss, inputs: loss.backward())
    got = _train_chain(_chain(), torch.autograd.grad)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    stack = _chain()
    with te.autocast(recipe=DelayedScaling(amax_history_len=3)):
        out = stack(torch.randn(16, 32))
    dy = torch.randn(16, 32)
    out.backward(dy, retain_graph=True)
    out.backward(dy)
    history = stack[-1].fp8_meta.amax_history_bwd[:, 0]
    assert history.tolist() == [0.0, dy.abs().max().item(), dy.abs().max().item()]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_backward_update_with_activation_checkpointing(use_reentrant):
    """A checkpointed FP8 region (recomputed in the backward: with reentrant checkpointing
    in a backward pass of its own) and one after it: each module's backward scales updated
    once per step, as without checkpointing."""
    recipe = DelayedScaling(amax_history_len=3)

    def fp8_region(module, x):
        with te.autocast(recipe=recipe):
            return module(x)

    states = []
    for checkpointed in (True, False):
        stack = _chain()
        torch.manual_seed(1)
        for _ in range(3):
            x = torch.randn(16, 32, requires_grad=True)
            if checkpointed:
                hidden = te.checkpoint(fp8_region, stack[0], x, use_reentrant=use_reentrant)
            else:
                hidden = fp8_region(stack[0], x)
            _loss(fp8_region(stack[1], hidden)).backward()
        states.append([t for lin in stack for t in (lin.fp8_meta.amax_history_bwd,
                                                    lin.fp8_meta.scale_bwd)])
    for a, b in zip(*states, strict=True):
        assert torch.equal(a, b)
    assert (states[0][0] != 0).sum() == 2  # rolled once per step: two amaxes kept, row 0 clear


# GELU in FC2's FP8 input cast (LayerNormMLP, activation "gelu"): the cast reads FC1's output h
# and casts gelu(h) computed in float32. The rule: the FP8 values are those of torch's float32
# GELU, bit for bit except where the float32 GELU lies within its implementation slack of an
# FP8 rounding boundary: tanh's last bits differ between implementations (the kernels'
# exp-based one, torch's CUDA and CPU ones), and the formula's 1 + tanh cancels for negative
# h, so the slack is |h| 2**-21 absolute plus a few float32 ulps; such elements are rare. And
# within one FP8 step of the unfused path's, which rounds gelu(h) to 16 bits before the cast.
GELU_CAST_RTOL = 2.0 ** -20  # a few float32 ulps
GELU_TANH_SLACK = 2.0 ** -21  # times |h|


def assert_fp8_of_gelu(got: torch.Tensor, h: torch.Tensor, scale: torch.Tensor,
                       fp8_max: float) -> None:
    """``got`` (FP8) is fp8(clamp(gelu(h) * scale)) of torch's float32 tanh GELU by the rule:
    between the casts of the product moved by the slack either way, equal but for a few
    elements; NaNs where the product is NaN."""
    gelu = fp8._gelu_float32(h)
    slack = torch.where(h.isfinite(), h.float().abs() * GELU_TANH_SLACK
                        + gelu.abs() * GELU_CAST_RTOL, 0.0)
    _assert_fp8_within_slack(got, gelu, slack, scale, fp8_max)


def dgelu_slack(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The backward's slack: gelu'(h) moves by (0.5 + beta |h| (1 + 3 kappa h^2)) per unit
    of tanh's error (the derivative's derivative in tanh), times |dy|; a few float32 ulps."""
    h, dy = h.float(), dy.float()
    dgelu = fp8._cast_source(dy, False, h)
    per_tanh = 0.5 + 0.8 * h.abs() * (1 + 0.135 * h * h)
    return torch.where(h.isfinite() & dy.isfinite(), (dy.abs() * per_tanh) * GELU_TANH_SLACK
                       + dgelu.abs() * GELU_CAST_RTOL, 0.0)


def assert_fp8_of_dgelu(got: torch.Tensor, dy: torch.Tensor, h: torch.Tensor,
                        scale: torch.Tensor, fp8_max: float) -> None:
    """``got`` is the FP8 cast of torch's float32 gelu_backward(dy, h) by the rule."""
    dgelu = fp8._cast_source(dy, False, h)
    _assert_fp8_within_slack(got, dgelu, dgelu_slack(dy, h), scale, fp8_max,
                             accurate=_dgelu_float64(dy, h))


def _dgelu_float64(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """dy * gelu'(h) in float64 without 1 + tanh's and 1 - tanh^2's cancellation:
    s = 1 / (1 + exp(-2y)), gelu'(h) = s + h s (1 - s) 2 beta (1 + 3 kappa h^2)."""
    h, dy = h.double(), dy.double()
    beta, kappa = math.sqrt(2.0 / math.pi), 0.044715
    e = torch.exp(-2.0 * beta * (h + kappa * h ** 3))
    s = 1.0 / (1.0 + e)
    one_minus_s = torch.where(e.isinf(), 1.0, e * s)
    return dy * (s + h * s * one_minus_s * 2.0 * beta * (1.0 + 3.0 * kappa * h * h))


def assert_dgelu_column_sums(got: torch.Tensor, dy: torch.Tensor, h: torch.Tensor) -> None:
    """``got`` (dy's dtype) is the column sums of the float32 gelu_backward(dy, h) values,
    rounded once: within the slack's sum, a float32 sum's error in any order and the final
    rounding of the float64 sum (relative, or one subnormal step of got's dtype: float16's
    spacing below 6.1e-5 is 6e-8)."""
    dgelu = fp8._cast_source(dy, False, h).double()
    exact = dgelu.sum(0)
    n = dgelu.shape[0]
    info = torch.finfo(got.dtype)
    bound = (2 * info.eps * exact.abs() + info.smallest_normal * info.eps
             + dgelu_slack(dy, h).double().sum(0) + 4 * n ** 0.5 * 2.0 ** -24 * dgelu.abs().sum(0))
    assert got.dtype == dy.dtype
    assert ((got.double() - exact).abs() <= bound).all()


def assert_amax_of_dgelu(amax: torch.Tensor, dy: torch.Tensor, h: torch.Tensor) -> None:
    """An amax of gelu_backward(dy, h) within the slack of torch's float32 one."""
    dgelu, slack = fp8._cast_source(dy, False, h).abs(), dgelu_slack(dy, h)
    assert (dgelu - slack).max() <= amax <= (dgelu + slack).max()


def gelu_cast_scale(x, recipe, scales, fp8_max):
    """The scale a cast of gelu(x) in slot 1 casts with: the delayed scale, or (current
    scaling) the scale from the float32 GELU's amax (the PyTorch path's)."""
    if isinstance(recipe, DelayedScaling):
        return scales[1]
    amax = fp8._gelu_float32(x).abs().amax()
    return fp8.compute_scale(amax, torch.ones_like(amax), fp8_max)


def dgelu_cast_scale(dy, h, recipe, scales, fold_amax, fp8_max):
    """The scale a cast of gelu_backward(dy, h) in slot 1 casts with: the delayed scale, or
    (current scaling) the scale from the amax kernel's amax (checked against torch's)."""
    if isinstance(recipe, DelayedScaling):
        return scales[1]
    amax = torch.zeros(1, device=dy.device)
    fold_amax(dy, amax, dgelu_input=h)
    assert_amax_of_dgelu(amax[0], dy, h)
    return fp8.compute_scale(amax[0], torch.ones((), device=dy.device), fp8_max)


def assert_dgelu_cast(got, dy, h, scale, fp8_max, rowwise, columnwise) -> None:
    """_quantize(dy, ..., dbias=True, dgelu_input=h)'s result by the rule: the orientations
    asked for (the transpose the row-major cast's, bit for bit) and the column sums."""
    if rowwise:
        assert_fp8_of_dgelu(got[0], dy, h, scale, fp8_max)
    if columnwise:
        assert got[1].is_contiguous()
        assert_fp8_of_dgelu(got[1].t(), dy, h, scale, fp8_max)
    if rowwise and columnwise:
        assert torch.equal(got[1].view(torch.uint8), got[0].t().contiguous().view(torch.uint8))
    assert (got[0] is None) != rowwise and (got[1] is None) != columnwise
    assert_dgelu_column_sums(got[3], dy, h)


def _assert_fp8_within_slack(got, values, slack, scale, fp8_max, accurate=None):
    """Within the slack's bounds, and equal to the casts of ``values`` (torch's float32) or of
    ``accurate`` (a float64 value without torch's cancellation) but for 1% of the elements:
    a formula that does not cancel differs from torch's float32 one where that one does."""
    exact = values * scale
    slack = slack * scale

    def cast(values):
        return values.clamp(-fp8_max, fp8_max).to(got.dtype).float()

    low, high = cast(exact - slack), cast(exact + slack)
    values = got.float()
    nan = exact.isnan()
    assert torch.equal(values.isnan(), nan)
    assert ((low <= values) & (values <= high))[~nan].all()
    references = [exact]
    if accurate is not None:
        references.append((accurate * torch.as_tensor(scale).double()).float())
    assert min((values != cast(r))[~nan].sum() for r in references) <= 2 + exact.numel() // 100


def assert_within_one_fp8_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """FP8 tensors of one dtype whose values differ by at most one FP8 step (a rounding to 16
    bits before the cast moves the value by less than one), with the same NaNs and signs."""
    nan = got.float().isnan()
    assert got.dtype == want.dtype and torch.equal(nan, want.float().isnan())
    a, b = got.view(torch.uint8)[~nan].int(), want.view(torch.uint8)[~nan].int()
    magnitude_a, magnitude_b = a & 0x7F, b & 0x7F
    assert ((magnitude_a - magnitude_b).abs() <= 1).all()
    nonzero = (magnitude_a > 0) & (magnitude_b > 0)
    assert torch.equal((a >> 7)[nonzero], (b >> 7)[nonzero])


def _gelu_input(shape, dtype, seed=0):
    """GELU's interesting range (its minimum near -0.75, tails), a few large values, +-inf and
    NaN (gelu(-inf) is NaN, torch's)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3
    flat = x.view(-1)
    flat[:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e4, -1e4, 0.0])
    return x.to(dtype)


def _quantize_e4m3(tensor, recipe, **options):
    """(FP8, transpose, inverse scale) of _quantize in slot 1 (scale 4), and the history."""
    history, scales = torch.zeros(1, 2), torch.tensor([0.5, 4.0])
    return fp8._quantize(tensor, Format.E4M3, E4M3_MAX, recipe, history, scales, 1,
                         columnwise=True, **options), history


def _gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_gelu_cast_casts_the_float32_gelu(dtype, recipe):
    """The PyTorch path of _quantize(gelu=True) is the cast of the float32 GELU (casts,
    inverse scale and amax bit for bit), within one FP8 step of the cast of gelu(h) rounded
    to h's dtype (the unfused path), with infs and NaNs and without."""
    h = _gelu_input((48, 40), dtype)
    for finite in (False, True):
        if finite:
            h = h.nan_to_num(0.0, 0.0, 0.0)
        fused, fused_history = _quantize_e4m3(h, recipe, gelu=True)
        float32, float32_history = _quantize_e4m3(fp8._gelu_float32(h), recipe)
        unfused, _ = _quantize_e4m3(_gelu_tanh(h), recipe)
        for a, b, c in zip(fused[:2], float32[:2], unfused[:2]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            assert_within_one_fp8_step(a, c)
        torch.testing.assert_close(fused[2], float32[2], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(fused_history, float32_history, rtol=0, atol=0,
                                   equal_nan=True)
        if isinstance(recipe, DelayedScaling):
            assert fused_history[0, 1].isnan() != finite  # gelu(-inf) is NaN
    scale = (torch.tensor(4.0) if isinstance(recipe, DelayedScaling) else
             fp8.compute_scale(fp8._gelu_float32(h).abs().max(), torch.ones(()), E4M3_MAX))
    assert_fp8_of_gelu(fused[0], h, scale, E4M3_MAX)


def test_the_gelu_rule_can_fail():
    """The rule's helpers refuse a cast of plain h, and values two FP8 steps apart."""
    h = _gelu_input((48, 40), torch.bfloat16).nan_to_num(0.0, 0.0, 0.0)
    plain = _quantize_e4m3(h, DelayedScaling())[0][0]
    with pytest.raises(AssertionError):
        assert_fp8_of_gelu(plain, h, torch.tensor(4.0), E4M3_MAX)
    fused = _quantize_e4m3(h, DelayedScaling(), gelu=True)[0][0]
    two_up = (fused.view(torch.uint8) + 2).view(torch.float8_e4m3fn)
    with pytest.raises(AssertionError):
        assert_within_one_fp8_step(two_up[10:20], fused[10:20])


def unfuse_fp8_gelu(patch) -> None:
    """LayerNormMLP's FP8 path without the fusion: FC1's FP8 GEMM, torch's GELU, FC2's."""
    patch.setattr(te.LayerNormMLP, "_fuses_fp8_gelu", lambda self: False)


def with_and_without_fp8_gelu_fusion(run):
    """[run() with LayerNormMLP's FP8 GELU fusion, run() without it]."""
    results = []
    for fused in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            if not fused:
                unfuse_fp8_gelu(patch)
            results.append(run())
    return results


def _train_fp8(make, recipe, dtype, steps=3):
    """(each step's output, [each step's input and parameter gradients, then the FP8
    state]) of a few training steps."""
    torch.manual_seed(0)
    module = make().to(dtype)
    opt = torch.optim.SGD(module.parameters(), lr=1e-4)
    torch.manual_seed(1)
    outputs, got = [], []
    for _ in range(steps):
        x = torch.randn(16, 2, 64, dtype=dtype, requires_grad=True)
        with te.autocast(recipe=recipe):
            out = module(x)
        out.float().square().sum().backward()
        outputs.append(out)
        got += [x.grad] + [p.grad.clone() for p in module.parameters()]
        opt.step()
        opt.zero_grad()
    metas = [m.fp8_meta for m in module.modules() if hasattr(m, "fp8_meta")]
    return outputs, got + [t for m in metas for t in (m.amax_history_fwd, m.scale_fwd,
                                              m.amax_history_bwd, m.scale_bwd)
                  if t is not None]


_GELU_MODULES = {
    "LayerNormMLP": lambda: te.LayerNormMLP(64, 128, device="cpu"),
    "TransformerLayer": lambda: te.TransformerLayer(64, 128, 4, hidden_dropout=0.0,
                                                    attention_dropout=0.0, device="cpu"),
}


@pytest.mark.parametrize("module", list(_GELU_MODULES))
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fused_gelu_trains_as_the_unfused_path(module, recipe, monkeypatch):
    """float32 (torch's GELU is the cast's float32 GELU): outputs, gradients and FP8 state of
    three steps bit for bit as with torch's GELU before the cast; bfloat16 (the unfused path
    rounds gelu(h) to bfloat16 first, which moves some FC2 inputs by one FP8 step): the
    outputs close (the gradients differ by FP8 noise: one step of an E5M2 gradient is 25%)."""
    make = _GELU_MODULES[module]
    fused = {dtype: _train_fp8(make, recipe, dtype) for dtype in (torch.float32,
                                                                  torch.bfloat16)}
    unfuse_fp8_gelu(monkeypatch)
    unfused = {dtype: _train_fp8(make, recipe, dtype) for dtype in (torch.float32,
                                                                    torch.bfloat16)}
    for got, want in zip(fused[torch.float32], unfused[torch.float32], strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(fused[torch.bfloat16][0], unfused[torch.bfloat16][0], strict=True):
        assert (a.float() - b.float()).norm() <= 0.03 * b.float().norm()


def aten_ops(fn):
    """(the aten ops fn() runs, as (name, dtype of the first argument), fn's result)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append((func.overloadpacket.__name__, getattr(args[0], "dtype", None)
                               if args else None))
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        result = fn()
    return ops.names, result


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_mlp_applies_gelu_in_its_casts(recipe, monkeypatch):
    """Inside an FP8 autocast FC2's input cast applies the GELU to FC1's output and FC1's
    gradient cast its backward to FC2's input gradient: no GELU nor gelu_backward of
    bfloat16 runs in the MLP (the PyTorch path's casts compute them in float32; the kernels'
    in their casts, tests/test_triton_kernels.py); outside, torch's GELU of bfloat16."""
    casts = []
    real = fp8._quantize

    def spy(tensor, *args, gelu=False, dgelu_input=None, **options):
        casts.append((tuple(tensor.shape), gelu, dgelu_input))
        return real(tensor, *args, gelu=gelu, dgelu_input=dgelu_input, **options)

    monkeypatch.setattr(fp8, "_quantize", spy)
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(32, 64, device="cpu", params_dtype=torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=recipe):
        forward_ops, out = aten_ops(lambda: mlp(x))
    assert ("gelu", torch.bfloat16) not in forward_ops
    assert forward_ops.count(("gelu", torch.float32)) == 1
    assert [shape for shape, gelu, _ in casts if gelu] == [(16, 64)]  # FC1's output
    casts.clear()
    backward_ops, _ = aten_ops(lambda: out.float().sum().backward())
    assert ("gelu_backward", torch.bfloat16) not in backward_ops
    assert backward_ops.count(("gelu_backward", torch.float32)) == 1
    # FC1's output gradient cast, with FC1's output h
    dgelu_casts = [(shape, h) for shape, _, h in casts if h is not None]
    assert len(dgelu_casts) == 1 and dgelu_casts[0][0] == dgelu_casts[0][1].shape == (16, 64)
    assert mlp.fc1_weight.grad is not None and x.grad is not None
    forward_ops, _ = aten_ops(lambda: mlp(x))
    assert [op for op in forward_ops if op[0] == "gelu"] == [("gelu", torch.bfloat16)]


@pytest.mark.parametrize("options", [dict(params_dtype=torch.float32),
                                     dict(params_dtype=torch.bfloat16, return_bias=True),
                                     dict(params_dtype=torch.bfloat16, bias=False)],
                         ids=["float32", "return-bias", "no-bias"])
@pytest.mark.parametrize("frozen", ["none", "input", "fc1", "fc2", "all-but-fc2-bias"])
def test_fp8_gelu_mlp_gradients_where_needed(options, frozen, monkeypatch):
    """The fused Function gives the gradients autograd asks for, the unfused path's: biases
    outside the epilogue (float32 activations: FC1's bias added to h in the Function, FC2's
    after it), a returned bias, no bias; frozen inputs and weights (no gradient computed)."""
    if frozen == "all-but-fc2-bias" and options.get("bias") is False:
        pytest.skip("nothing would need a gradient")
    dtype = options["params_dtype"]

    def run():
        torch.manual_seed(0)
        mlp = te.LayerNormMLP(32, 64, device="cpu", **options)
        x = torch.randn(16, 32, dtype=dtype, requires_grad=frozen != "input")
        frozen_names = {"fc1": ["fc1_weight", "fc1_bias"], "fc2": ["fc2_weight"],
                        "all-but-fc2-bias": [n for n, _ in mlp.named_parameters()
                                             if n != "fc2_bias"]}.get(frozen, [])
        for name in frozen_names:
            if getattr(mlp, name, None) is not None:
                getattr(mlp, name).requires_grad_(False)
        if frozen == "all-but-fc2-bias":
            x.requires_grad_(False)
        with te.autocast():
            out = mlp(x)
        if options.get("return_bias"):
            out, bias = out
            out = out + bias
        out.float().square().sum().backward()
        return [out, x.grad] + [p.grad for p in mlp.parameters()]

    fused, unfused = with_and_without_fp8_gelu_fusion(run)
    for a, b in zip(fused, unfused, strict=True):
        assert (a is None) == (b is None)
        if a is not None and dtype == torch.float32:
            assert torch.equal(a, b)
        elif a is not None:
            assert (a.float() - b.float()).norm() <= 0.1 * b.float().norm() + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_dgelu_cast_casts_the_float32_dgelu(dtype, recipe):
    """The PyTorch path of _quantize(dgelu_input=h): the cast of torch's gelu_backward in
    float32 (casts, inverse scale, amax bit for bit), its column sums rounded once to dy's
    dtype; within one FP8 step of the cast of gelu_backward in dy's dtype (the unfused
    path)."""
    h = _gelu_input((48, 40), dtype, seed=1).nan_to_num(0.0, 0.0, 0.0)
    dy = _gelu_input((48, 40), dtype, seed=2).nan_to_num(0.0, 0.0, 0.0)
    dgelu = fp8._cast_source(dy, False, h)
    (fused, fused_history), (float32, float32_history), (unfused, _) = (
        _quantize_e4m3(dy, recipe, dgelu_input=h, dbias=True),
        _quantize_e4m3(dgelu, recipe, dbias=True),
        _quantize_e4m3(torch.ops.aten.gelu_backward(dy, h, approximate="tanh"), recipe,
                       dbias=True))
    for a, b, c in zip(fused[:2], float32[:2], unfused[:2]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert_within_one_fp8_step(a, c)
    assert torch.equal(fused[2], float32[2]) and torch.equal(fused_history, float32_history)
    assert fused[3].dtype == dtype and torch.equal(fused[3], dgelu.sum(0).to(dtype))
    assert_dgelu_column_sums(fused[3], dy, h)
