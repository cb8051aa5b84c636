"""The FP8 Linear's bias gradient: the column sums of its output gradient, which the backward's
FP8 cast gives (fp8._quantize(..., dbias=True)): on CUDA the Triton cast kernel sums while it
casts (tested in test_triton_kernels.py and tests/gpu/test_fp8_gpu.py with the rule below),
the PyTorch path takes ``grad.sum(0)``."""
import math

import pytest
import torch

import transformer_fa as te
from transformer_fa import fp8
from transformer_fa.common.recipe import DelayedScaling, Float8CurrentScaling, Format


def assert_bias_grad_close(got: torch.Tensor, grad: torch.Tensor) -> None:
    """``got`` is ``grad.sum(0)`` (over all leading dims) up to summation order.

    torch's ``sum(0)`` of a 16-bit tensor accumulates in float32 and rounds once; the cast
    kernel does the same in another order (row blocks, then the blocks), so against the exact
    (float64) sum its error may exceed torch's by the float32 accumulation error of another
    order and one final rounding to the other neighbour. The rule, per column j with n rows:

        |got - exact| <= 2 |torch - exact| + 2 eps(dtype) |exact| + 2 sqrt(n) u sum_i |x_ij|

    where u = 2**-24 is float32's unit roundoff and 2 sqrt(n) u sum|x| the probabilistic bound
    of a float32 sum of n terms in any order (Higham and Mary, 2019; the worst case is
    (n - 1) u sum|x|), which holds for all but a vanishing fraction of columns. It still
    fails a sum that loses or repeats a row (an error of |x_ij| ~ sum|x| / n > 2 sqrt(n) u
    sum|x| for n < 10**4) or accumulates in the 16-bit dtype. A sum rounded to +-inf
    (overflow) counts as the overflow threshold, the least magnitude that rounds to inf, so
    sums near it may overflow in one order and not in the other. Where the column holds an inf
    or a NaN, ``got`` must be torch's inf or NaN."""
    grad = grad.reshape(-1, grad.shape[-1])
    want = grad.sum(0)
    assert got.dtype == grad.dtype and got.shape == want.shape and got.device == grad.device
    exact = grad.double().sum(0)
    finite = torch.isfinite(exact)
    torch.testing.assert_close(got[~finite], want[~finite], rtol=0, atol=0, equal_nan=True)
    finfo = torch.finfo(grad.dtype)
    threshold = finfo.max * (1 + finfo.eps / 4)  # max + half its ulp: rounds to inf

    def overflow_as_threshold(sums):
        sums = sums.double()
        return torch.where(sums.isinf(), sums.sign() * threshold, sums)

    u = torch.finfo(torch.float32).eps / 2
    allowed = (2 * (overflow_as_threshold(want) - exact).abs() + 2 * finfo.eps * exact.abs()
               + 2 * math.sqrt(grad.shape[0]) * u * grad.double().abs().sum(0))
    error = (overflow_as_threshold(got) - exact).abs()
    bad = finite & ~(error <= allowed)  # a NaN where the sum is finite is bad too
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} column sums off: got "
                           f"{got[bad][:4].tolist()}, exact {exact[bad][:4].tolist()}, "
                           f"allowed error {allowed[bad][:4].tolist()}")


def _gradient(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.logspace(-2, 2, shape[-1])).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bias_grad_rule_takes_other_orders_and_fails_wrong_sums(dtype):
    """The rule passes float32 sums in other orders and fails a sum without one row, with a
    row twice, or accumulated in the tensor's dtype (bfloat16, float16)."""
    grad = _gradient((300, 64), dtype)
    for order in (torch.arange(300).flip(0), torch.randperm(300)):
        assert_bias_grad_close(grad[order].float().cumsum(0)[-1].to(dtype), grad)
    wrong = [grad[1:].sum(0), grad.sum(0) + grad[7]]
    if dtype != torch.float32:
        low = torch.zeros(64, dtype=dtype)
        for row in grad:
            low += row
        wrong.append(low)
    for got in wrong:
        with pytest.raises(AssertionError, match="column sums off"):
            assert_bias_grad_close(got, grad)


def test_bias_grad_rule_takes_an_overflow_only_at_the_threshold():
    """float16 sums near its max may round to inf in one order and not in another; far
    below it an inf is wrong."""
    grad = torch.full((4, 3), 16376.0, dtype=torch.float16)  # exact sums 65504
    grad[0, 1] = 16384.0  # 65512: rounds to 65504, 8 below the overflow threshold
    grad[:, 2] = 1000.0
    assert grad.sum(0)[1] == 65504
    got = grad.sum(0)
    got[1] = float("inf")
    assert_bias_grad_close(got, grad)
    got[2] = float("inf")
    with pytest.raises(AssertionError, match="column sums off"):
        assert_bias_grad_close(got, grad)


def test_bias_grad_rule_needs_the_same_infs_and_nans():
    grad = _gradient((40, 8), torch.bfloat16)
    grad[3, 2], grad[5, 4], grad[6, 4] = float("nan"), float("inf"), float("-inf")
    grad[9, 6] = float("inf")
    assert_bias_grad_close(grad.sum(0), grad)
    for column, value in ((2, 0.0), (6, float("nan")), (1, float("nan"))):
        got = grad.sum(0)
        got[column] = value
        with pytest.raises(AssertionError):
            assert_bias_grad_close(got, grad)


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_pytorch_path_quantize_gives_the_column_sums(recipe):
    """Without the kernels, _quantize(..., dbias=True) is the same cast and history with
    ``grad.sum(0)`` as a fourth item."""
    grad = _gradient((48, 40), torch.bfloat16)
    results = []
    for dbias in (False, True):
        history, scales = torch.zeros(1, 2), torch.full((2,), 0.5)
        results.append((fp8._quantize(grad, Format.E5M2, 57344.0, recipe, history, scales, 1,
                                      columnwise=True, dbias=dbias), history))
    (plain, plain_history), (summed, summed_history) = results
    assert len(plain) == 3 and len(summed) == 4
    for a, b in zip(plain[:2], summed[:2]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(plain[2], summed[2]) and torch.equal(plain_history, summed_history)
    assert torch.equal(summed[3], grad.sum(0))


def test_fp8_linear_bias_grad_alone(monkeypatch):
    """Only the bias needs a gradient (frozen weight, input without grad): the backward casts
    the output gradient for the bias gradient alone."""
    monkeypatch.setenv("TRANSFORMER_FA_FP8_ON_CPU", "1")
    torch.manual_seed(0)
    lin = te.Linear(32, 48, device="cpu", params_dtype=torch.bfloat16)
    lin.weight.requires_grad_(False)
    x = torch.randn(2, 16, 32).to(torch.bfloat16)
    dy = torch.randn(2, 16, 48).to(torch.bfloat16)
    with te.autocast(recipe=DelayedScaling()):
        out = lin(x)
    out.backward(dy)
    assert lin.weight.grad is None
    assert torch.equal(lin.bias.grad, dy.reshape(-1, 48).sum(0))
