"""The Triton kernels (transformer_fa/kernels) against the PyTorch code they replace, on CPU
through Triton's interpreter.

Triton picks the interpreter when a kernel is decorated (at import), for triton's own helpers
too, so the cases run in a child pytest with TRITON_INTERPRET=1 set from its start: the rest
of the suite (and a GPU run of the same process) never sees the interpreter. The dispatch
tests make ``kernels_enabled`` say yes for CPU tensors.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import transformer_fa as te
from transformer_fa import fp8, kernels
from transformer_fa.attention.rope import apply_rotary_pos_emb
from transformer_fa.common.recipe import DelayedScaling, Float8CurrentScaling, Format
from transformer_fa.module import linear as linear_module
from transformer_fa.module.layernorm import apply_norm
from test_fp8 import (
    GELU_CAST_RTOL,
    assert_amax_of_dgelu,
    assert_dgelu_cast,
    assert_fp8_of_gelu,
    assert_within_one_fp8_step,
    aten_ops,
    dgelu_cast_scale,
    gelu_cast_scale,
)
from test_fp8_bias_grad import assert_bias_grad_close

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if not kernels.triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)
if INTERPRETED:
    from transformer_fa.kernels import bias_grad
    from transformer_fa.kernels import norm as norm_kernels
    from transformer_fa.kernels import rope as rope_kernels  # noqa: F401
interpreter_only = pytest.mark.skipif(not INTERPRETED,
                                      reason="runs in the TRITON_INTERPRET=1 child")


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_kernels_under_the_triton_interpreter():
    """Runs this file's cases in a child pytest with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
        cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    assert " passed" in child.stdout, child.stdout[-2000:]


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The modules' dispatch takes the (interpreted) kernels for CPU tensors, at every hidden
    size (the modules prefer the norm kernel only from NORM_KERNEL_FASTER_FROM on)."""
    monkeypatch.setattr(kernels, "kernels_enabled", lambda *tensors: True)
    monkeypatch.setattr(kernels, "prefer_fused_norm", lambda hidden: True)


def test_modules_prefer_the_norm_kernel_only_where_it_was_faster(monkeypatch):
    monkeypatch.delenv("TRANSFORMER_FA_FUSED_NORM", raising=False)
    assert not kernels.prefer_fused_norm(1024) and kernels.prefer_fused_norm(2048)


@pytest.mark.parametrize("setting, expected", [
    (None, {1024: False, 2048: True}),
    ("1", {1024: True, 2048: True}),
    ("0", {1024: False, 2048: False}),
    ("yes", {1024: False, 2048: True}),  # not 0 or 1: the measured rule
])
def test_fused_norm_switch(setting, expected, monkeypatch):
    """TRANSFORMER_FA_FUSED_NORM forces either path, read on every call."""
    if setting is None:
        monkeypatch.delenv("TRANSFORMER_FA_FUSED_NORM", raising=False)
    else:
        monkeypatch.setenv("TRANSFORMER_FA_FUSED_NORM", setting)
    assert {h: kernels.prefer_fused_norm(h) for h in expected} == expected


def test_fused_norm_switch_reaches_the_modules(monkeypatch):
    """apply_norm takes the kernel at hidden 64 with the switch at 1 (kernels enabled for CPU
    tensors, the kernel stubbed: this process has no interpreter), PyTorch's at 0 and unset."""
    monkeypatch.setattr(kernels, "kernels_enabled", lambda *tensors: True)
    import transformer_fa.kernels.norm as norm_module
    calls = []
    monkeypatch.setattr(norm_module, "fused_norm", lambda x, *a: calls.append(1) or x)
    x, weight = torch.randn(3, 64), torch.ones(64)
    for setting, expected in (("1", 1), ("0", 0), (None, 0)):
        calls.clear()
        if setting is None:
            monkeypatch.delenv("TRANSFORMER_FA_FUSED_NORM", raising=False)
        else:
            monkeypatch.setenv("TRANSFORMER_FA_FUSED_NORM", setting)
        apply_norm(x, "RMSNorm", weight, None, 1e-5, False)
        assert len(calls) == expected, setting


def _tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)


def _run(fn, inputs, grad_out):
    """fn's output and the gradients of its floating inputs that require grad."""
    out = fn(*inputs)
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    return [out, *torch.autograd.grad(out, wrt, grad_out)]


def _assert_close(fused, reference, dtype):
    for a, b in zip(fused, reference, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **_tol(dtype))


def _norm_inputs(normalization, hidden, dtype, zero_centered, shape=(3, 5), with_bias=None):
    """[x, weight, bias], dy; a bias for LayerNorm unless with_bias says otherwise."""
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(*shape, hidden, generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    weight = torch.randn(hidden, generator=g) * 0.2 + (0.0 if zero_centered else 1.0)
    if with_bias is None:
        with_bias = normalization == "LayerNorm"
    bias = torch.randn(hidden, generator=g) if with_bias else None
    params = [p.to(dtype).requires_grad_() if p is not None else None for p in (weight, bias)]
    dy = torch.randn(*shape, hidden, generator=g).to(dtype)
    return [x, *params], dy


def _kernel_and_pytorch_norm(normalization, zero_centered, x, weight, bias, dy):
    """(_run of the norm kernel, _run of apply_norm's PyTorch code) on the same inputs."""
    def norm_with(fn):
        return lambda x, w, b: fn(x, normalization, w, b, 1e-5, zero_centered)

    return (_run(norm_with(norm_kernels.fused_norm), [x, weight, bias], dy),
            _run(norm_with(apply_norm), [x, weight, bias], dy))


@interpreter_only
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [7, 77, 256, 1000])
def test_norm_matches_pytorch(normalization, zero_centered, dtype, hidden):
    """Output, dx, dgamma and dbeta of the kernel against apply_norm's PyTorch code; odd
    widths leave the row's block partly masked."""
    (x, weight, bias), dy = _norm_inputs(normalization, hidden, dtype, zero_centered)
    fused, reference = _kernel_and_pytorch_norm(normalization, zero_centered, x, weight, bias, dy)
    _assert_close(fused, reference, dtype)


@interpreter_only
def test_norm_saves_statistics_not_a_copy_of_the_output():
    """The backward reads the float32 mean and rstd saved by the forward."""
    (x, weight, bias), _ = _norm_inputs("LayerNorm", 64, torch.bfloat16, False)
    y = norm_kernels.fused_norm(x, "LayerNorm", weight, bias, 1e-5, False)
    saved = y.grad_fn.saved_tensors
    x2d, _, mean, rstd = saved
    xf = x.detach().float().reshape(-1, 64)
    torch.testing.assert_close(mean, xf.mean(-1))
    torch.testing.assert_close(rstd, torch.rsqrt(xf.var(-1, unbiased=False) + 1e-5))


@interpreter_only
def test_norm_many_rows_per_backward_program():
    """More rows than backward programs: each program sums several rows' dgamma."""
    (x, weight, bias), dy = _norm_inputs("LayerNorm", 33, torch.float32, False, shape=(37,))
    fn = norm_kernels.fused_norm
    fused = _run(lambda *a: fn(*a, 1e-5, False), [x, "LayerNorm", weight, bias], dy)
    reference = _run(lambda *a: apply_norm(*a, 1e-5, False), [x, "LayerNorm", weight, bias], dy)
    _assert_close(fused, reference, torch.float32)


def _tiled_rows(hidden):
    """7 tiles of rows and 3 more: the forward's last tile ragged, and each of the CPU
    backward's 3 programs takes several tiles (its chunk of 12 rows of 4-row tiles; the last
    chunk 7 rows, a full tile and a ragged one)."""
    block_m = norm_kernels._tile_config(hidden)[0]
    return 7 * block_m + 3


@interpreter_only
@pytest.mark.parametrize("normalization, with_bias, zero_centered", [
    ("LayerNorm", True, False), ("LayerNorm", False, True), ("RMSNorm", False, False),
    ("RMSNorm", False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [80, 1000, 2048, 3000])
def test_norm_tiles_of_rows(normalization, with_bias, zero_centered, dtype, hidden):
    """Tiles of several rows (4 where hidden is a multiple of 16: 80 and 2048, 1 for 1000 and
    3000), a ragged last tile and masked columns (80, 1000, 3000): output, dx, dgamma and
    dbeta against the PyTorch path."""
    rows = _tiled_rows(hidden)
    assert hidden % 16 or (rows - 3) // 7 == 4  # the widths meant to take 4-row tiles do
    (x, weight, bias), dy = _norm_inputs(normalization, hidden, dtype, zero_centered,
                                         shape=(rows,), with_bias=with_bias)
    fused, reference = _kernel_and_pytorch_norm(normalization, zero_centered, x, weight, bias, dy)
    assert len(fused) == (4 if with_bias else 3)
    _assert_close(fused, reference, dtype)


@interpreter_only
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_writes_every_element_and_the_same_bits_twice(normalization, monkeypatch):
    """y, dx, dgamma and dbeta of a run whose new tensors (statistics and partial sums too)
    start as NaN, against a plain run, bit for bit: every element is written, and the
    fixed-order sums give the same bits run to run (the interpreter runs programs in order:
    tests/gpu checks the same on a GPU)."""
    hidden = 2048
    (x, weight, bias), dy = _norm_inputs(normalization, hidden, torch.bfloat16, False,
                                         shape=(_tiled_rows(hidden),))

    def run():
        return _run(lambda x, w, b: norm_kernels.fused_norm(x, normalization, w, b, 1e-5,
                                                            False), [x, weight, bias], dy)

    plain = run()
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(make):
        def new(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return new

    monkeypatch.setattr(torch, "empty", poisoned(empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(empty_like))
    poisoned_run = run()
    monkeypatch.undo()
    for a, b in zip(plain, poisoned_run, strict=True):
        assert not b.isnan().any()
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def _add_norm_runs(normalization, with_bias, dtype, hidden, use_y=True, use_h=True):
    """[(y, h, gradients of x, residual and the norm parameters)] of fused_add_norm, then of
    x + residual followed by fused_norm, with the gradients taken through the outputs used."""
    rows = _tiled_rows(hidden)
    (x, weight, bias), dy = _norm_inputs(normalization, hidden, dtype, True, shape=(rows,),
                                         with_bias=with_bias)
    g = torch.Generator().manual_seed(1)
    residual = torch.randn(rows, hidden, generator=g).to(dtype).requires_grad_()
    dh = torch.randn(rows, hidden, generator=g).to(dtype)

    def fused(x, r, w, b):
        return norm_kernels.fused_add_norm(x, r, normalization, w, b, 1e-5, True)

    def separate(x, r, w, b):
        h = r + x
        return norm_kernels.fused_norm(h, normalization, w, b, 1e-5, True), h

    wrt = [x, residual] + ([weight] + ([bias] if with_bias else []) if use_y else [])
    runs = []
    for fn in (fused, separate):
        y, h = fn(x, residual, weight, bias)
        outputs, grads = zip(*[(t, g) for t, g, used in ((y, dy, use_y), (h, dh, use_h)) if used])
        runs.append((y, h, *torch.autograd.grad(outputs, wrt, grads)))
    return runs


@interpreter_only
@pytest.mark.parametrize("normalization, with_bias", [("LayerNorm", True), ("RMSNorm", False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [80, 1000])
def test_add_norm_is_the_add_then_the_norm(normalization, with_bias, dtype, hidden,
                                          bf16_rounds_to_nearest):
    """fused_add_norm against x + residual followed by fused_norm: the sum and the normalized
    sum bit for bit, dgamma / dbeta bit for bit (the same partial sums), and both addends'
    gradient (the norm's input gradient plus the sum's own, rounded once, not twice) one
    tensor, within the dtype's rounding of the separate path's; ragged tiles and masked
    columns (80: 4-row tiles, 1000: one row). (The sum is rounded in the kernel: bf16 rounds
    to nearest there as on a GPU.)"""
    (y, h, dx, dr, *dp), (y_ref, h_ref, dx_ref, dr_ref, *dp_ref) = _add_norm_runs(
        normalization, with_bias, dtype, hidden)
    assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
    assert dx is dr and torch.equal(dx_ref, dr_ref)
    torch.testing.assert_close(dx, dx_ref, **_tol(dtype))
    assert len(dp) == (2 if with_bias else 1)
    for a, b in zip(dp, dp_ref, strict=True):
        assert torch.equal(a, b)


@interpreter_only
@pytest.mark.parametrize("use_y, use_h", [(True, False), (False, True)])
def test_add_norm_with_one_output_used(use_y, use_h):
    """Only the normalized sum used (the backward without the sum's gradient) or only the
    sum (no norm backward at all): the addends' gradients as the separate path's."""
    (_, _, dx, dr, *_), (_, _, dx_ref, dr_ref, *_) = _add_norm_runs(
        "LayerNorm", True, torch.float32, 80, use_y=use_y, use_h=use_h)
    torch.testing.assert_close(dx, dx_ref, **_tol(torch.float32))
    torch.testing.assert_close(dr, dr_ref, **_tol(torch.float32))


def _pass_input_runs(normalization, dtype, hidden, use_y=True, use_x=True):
    """[(y, x passed on, gradients of x and the norm parameters)] of fused_norm with
    pass_input, then of fused_norm with x itself used again, the gradients taken through the
    outputs used (dh: the other use's gradient)."""
    rows = _tiled_rows(hidden)
    (x, weight, bias), dy = _norm_inputs(normalization, hidden, dtype, False, shape=(rows,))
    dh = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)

    def passing(x, w, b):
        return norm_kernels.fused_norm(x, normalization, w, b, 1e-5, False, pass_input=True)

    def separate(x, w, b):
        return norm_kernels.fused_norm(x, normalization, w, b, 1e-5, False), x

    with_bias = bias is not None
    wrt = [x] + ([weight] + ([bias] if with_bias else []) if use_y else [])
    runs = []
    for fn in (passing, separate):
        y, passed = fn(x, weight, bias)
        outputs, grads = zip(*[(t, g) for t, g, used in ((y, dy, use_y), (passed, dh, use_x))
                               if used])
        runs.append((y, passed, *torch.autograd.grad(outputs, wrt, grads)))
    return runs


@interpreter_only
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [80, 1000])
def test_norm_passing_its_input_adds_the_other_gradient(normalization, dtype, hidden):
    """fused_norm(pass_input=True) against fused_norm with its input used again: the output
    bit for bit, the input handed back unchanged (the same memory), dgamma / dbeta bit for
    bit, and the input's gradient (the norm's plus the other use's, added in the kernel and
    rounded once) within the dtype's rounding of autograd's separate add."""
    (y, passed, dx, *dp), (y_ref, x, dx_ref, *dp_ref) = _pass_input_runs(normalization, dtype,
                                                                        hidden)
    assert torch.equal(y, y_ref)
    assert passed.data_ptr() == x.data_ptr() and torch.equal(passed, x)
    torch.testing.assert_close(dx, dx_ref, **_tol(dtype))
    for a, b in zip(dp, dp_ref, strict=True):
        assert torch.equal(a, b)


@interpreter_only
@pytest.mark.parametrize("use_y, use_x", [(True, False), (False, True)])
def test_norm_passing_its_input_with_one_output_used(use_y, use_x):
    """Only the normalized input used (no other gradient) or only the passed input (no norm
    backward at all): the input's gradient as with the input used directly; and an input
    that needs no gradient is passed on as one that needs none."""
    (_, _, dx, *_), (_, _, dx_ref, *_) = _pass_input_runs("LayerNorm", torch.float32, 80,
                                                          use_y=use_y, use_x=use_x)
    torch.testing.assert_close(dx, dx_ref, **_tol(torch.float32))
    (x, weight, bias), _ = _norm_inputs("LayerNorm", 80, torch.float32, False, shape=(4,))
    y, passed = norm_kernels.fused_norm(x.detach(), "LayerNorm", weight, bias, 1e-5, False,
                                        pass_input=True)
    assert y.requires_grad and not passed.requires_grad


@interpreter_only
def test_transformer_layer_adds_the_residual_in_the_mlp_norm(kernels_on_cpu, monkeypatch):
    """A TransformerLayer's residual add before its MLP runs inside the MLP's norm
    (FusedAddNorm) and the residual's gradient is added inside the attention's norm
    (FusedNormPassingInput) when the kernels serve, and the layer's output and gradients
    agree with the PyTorch path."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(48, 64, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                device="cpu")
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(5, 2, 48, requires_grad=True)
    params = [x, *layer.parameters()]
    dy = torch.randn(5, 2, 48)
    calls = []
    for function in (norm_kernels.FusedNormPassingInput, norm_kernels.FusedAddNorm):
        original = function.apply
        monkeypatch.setattr(function, "apply", lambda *a, name=function.__name__,
                            original=original: calls.append(name) or original(*a))
    fused = _run(lambda *p: layer(x), params, dy)
    # (the attention's norm hands the layer input on as the residual: its gradient is added
    # in that norm's backward)
    assert calls == ["FusedNormPassingInput", "FusedAddNorm"]
    monkeypatch.undo()  # also restores kernels_enabled: the PyTorch path
    reference = _run(lambda *p: layer(x), params, dy)
    _assert_close(fused, reference, torch.float32)


@interpreter_only
@pytest.mark.parametrize("module_name", ["LayerNorm", "RMSNorm", "LayerNormLinear",
                                         "LayerNormMLP"])
def test_modules_take_the_kernel_when_enabled(module_name, kernels_on_cpu, monkeypatch):
    """The norms of LayerNorm, RMSNorm, LayerNormLinear and LayerNormMLP go through the fused
    Function when the kernels are enabled, and agree with the PyTorch path."""
    torch.manual_seed(0)
    build = {
        "LayerNorm": lambda: te.LayerNorm(48, zero_centered_gamma=True, device="cpu"),
        "RMSNorm": lambda: te.RMSNorm(48, device="cpu"),
        "LayerNormLinear": lambda: te.LayerNormLinear(48, 40, normalization="RMSNorm",
                                                      device="cpu"),
        "LayerNormMLP": lambda: te.LayerNormMLP(48, 64, device="cpu"),
    }[module_name]
    module = build()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(4, 3, 48, requires_grad=True)
    params = [x, *module.parameters()]
    dy = torch.randn_like(module(x))
    calls = []
    original = norm_kernels.FusedNorm.apply
    monkeypatch.setattr(norm_kernels.FusedNorm, "apply",
                        lambda *a: calls.append(1) or original(*a))
    fused = _run(lambda *p: module(x), params, dy)
    assert calls, "the fused norm did not run"
    monkeypatch.undo()  # also restores kernels_enabled: the PyTorch path
    reference = _run(lambda *p: module(x), params, dy)
    _assert_close(fused, reference, torch.float32)


def test_cpu_tensors_keep_the_pytorch_path():
    """Without CUDA the kernels are not used, whatever TRANSFORMER_FA_TRITON_KERNELS says."""
    x = torch.randn(2, 8)
    assert not kernels.use_fused_norm(x, torch.ones(8), None)
    assert not kernels.use_fused_rope(x.view(2, 1, 1, 8), torch.ones(4, 1, 1, 8))


def _freqs(max_len, rot_dim, interleaved):
    return te.RotaryPositionEmbedding(rot_dim, interleaved=interleaved)(max_len).cpu()


def _rope_case(tensor_format, dtype, head_dim=20, rot_dim=12, heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = {"sbhd": (7, 2, heads, head_dim), "bshd": (2, 7, heads, head_dim),
             "thd": (13, heads, head_dim)}[tensor_format]
    t = torch.randn(*shape, generator=g).to(dtype).requires_grad_()
    return t, torch.randn(*shape, generator=g).to(dtype)


def _rope_both(t, dy, freqs, **kwargs):
    def rope(t):
        return apply_rotary_pos_emb(t, freqs, **kwargs)

    fused = _run(lambda t: apply_rotary_pos_emb(t, freqs, fused=True, **kwargs), [t], dy)
    return fused, _run(rope, [t], dy)


@interpreter_only
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [12, 20])
def test_rope_matches_pytorch(tensor_format, interleaved, dtype, rot_dim, kernels_on_cpu):
    """Forward and backward, both conventions, partial (12 of 20 channels) and full rotary;
    thd with ragged lengths and a padded tail past cu_seqlens[-1]."""
    t, dy = _rope_case(tensor_format, dtype, rot_dim=rot_dim)
    freqs = _freqs(16, rot_dim, interleaved)
    cu = torch.tensor([0, 2, 7, 11], dtype=torch.int32) if tensor_format == "thd" else None
    fused, reference = _rope_both(t, dy, freqs, tensor_format=tensor_format,
                                  interleaved=interleaved, cu_seqlens=cu)
    _assert_close(fused, reference, dtype)


@interpreter_only
@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
def test_rope_start_positions_and_context_parallel(tensor_format, kernels_on_cpu):
    t, dy = _rope_case(tensor_format, torch.float32)
    freqs = _freqs(32, 12, False)
    starts = torch.tensor([3, 0, 5]) if tensor_format == "thd" else torch.tensor([3, 9])
    cu = torch.tensor([0, 2, 7, 11], dtype=torch.int32) if tensor_format == "thd" else None
    fused, reference = _rope_both(t, dy, freqs, tensor_format=tensor_format,
                                  start_positions=starts, cu_seqlens=cu)
    _assert_close(fused, reference, torch.float32)
    if tensor_format != "thd":  # cp: an even local length
        t, dy = t.detach()[:6] if tensor_format == "sbhd" else t.detach()[:, :6], None
        t.requires_grad_()
        dy = torch.randn_like(t)
        fused, reference = _rope_both(t, dy, freqs, tensor_format=tensor_format,
                                      cp_size=2, cp_rank=1)
        _assert_close(fused, reference, torch.float32)


@interpreter_only
def test_rope_reads_strided_views(kernels_on_cpu):
    """q as a view of a fused qkv projection ([s, b, 3, h, d] split) is read in place."""
    qkv = torch.randn(7, 2, 3 * 3, 20, requires_grad=True)
    q = qkv[:, :, 0:3]
    dy = torch.randn(7, 2, 3, 20)
    fused, reference = _rope_both(q, dy, _freqs(8, 20, True), tensor_format="sbhd",
                                  interleaved=True)
    _assert_close(fused, reference, torch.float32)


@interpreter_only
def test_rope_unfused_when_freqs_need_grad(kernels_on_cpu, monkeypatch):
    """The kernel gives freqs no gradient, so freqs that require one take the PyTorch path."""
    freqs = _freqs(8, 20, False).requires_grad_()
    monkeypatch.setattr(rope_kernels, "fused_rope", None)  # would fail if called
    out = apply_rotary_pos_emb(torch.randn(7, 2, 3, 20), freqs, fused=True)
    out.sum().backward()
    assert freqs.grad is not None


def test_rope_odd_table_width_is_refused():
    with pytest.raises(ValueError, match="even number of channels"):
        apply_rotary_pos_emb(torch.randn(4, 1, 1, 8), torch.zeros(4, 1, 1, 5))


# FP8 casts. Triton's interpreter converts float32 to FP8 with its own rounding (ties away
# from zero, no NaN), unlike the GPU's cvt.rn (round to nearest even, as torch's .to()), so
# the cases below model the GPU's conversion with torch's: they check the kernel's tiles,
# masks, strides, scale, clamp, transposes and amax bit for bit, and the GPU tests
# (tests/gpu/test_fp8_gpu.py) check the conversion itself. (The interpreter also truncates
# the float32 column sums to bfloat16: within the rule's one-rounding allowance.)
if INTERPRETED:
    import triton.language as tl
    from triton.runtime import interpreter as triton_interpreter

    from transformer_fa.kernels import fp8_cast, fp8_scale


@pytest.fixture
def fp8_kernels_on_cpu(kernels_on_cpu, monkeypatch):
    real = triton_interpreter.InterpreterBuilder.create_fp_to_fp
    to_torch = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def round_to_nearest_even(self, src, dst_type, rounding_mode):
        fp8_dtype = to_torch.get(dst_type.scalar)
        if fp8_dtype is None or src.dtype.scalar != tl.float32:
            return real(self, src, dst_type, rounding_mode)
        data = torch.from_numpy(src.data.copy()).to(fp8_dtype).view(torch.uint8).numpy()
        return triton_interpreter.TensorHandle(data, dst_type.scalar)

    monkeypatch.setattr(triton_interpreter.InterpreterBuilder, "create_fp_to_fp",
                        round_to_nearest_even)
    monkeypatch.setenv("TRANSFORMER_FA_FP8_ON_CPU", "1")


def _fp8_input(shape, dtype, seed=0):
    """Values across FP8's range and past its max, zeros, -0, tiny values that round into
    (and under) FP8's subnormals, and +-inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(-6, 3, shape[-1])
    flat = x.view(-1)
    specials = [0.0, -0.0, 1e5, -1e5, float("inf"), float("-inf"), float("nan"), 3e-6]
    positions = torch.randperm(flat.numel(), generator=g)[:len(specials)]
    flat[positions] = torch.tensor(specials[:positions.numel()])
    return x.to(dtype)


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous()
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _quantize_both(x, fmt, recipe, history, scales, slot=1, **orientations):
    """fp8._quantize through the kernels and through the PyTorch path, each on its own copy
    of the state: the casts (and column sums, with dbias=True) and the histories."""
    fp8_max = {Format.E4M3: 448.0, Format.E5M2: 57344.0}[fmt]
    results = []
    for enabled in (True, False):
        state = history.clone(), scales.clone()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "kernels_enabled", lambda *tensors: enabled)
            results.append((fp8._quantize(x, fmt, fp8_max, recipe, *state, slot,
                                          **orientations), state[0]))
    return results


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2])
@pytest.mark.parametrize("shape", [(1, 3), (37, 45), (130, 257)])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_cast_matches_pytorch(dtype, fmt, shape, recipe, fp8_kernels_on_cpu):
    """Row-major cast, transpose, inverse scale and the recorded amax, bit for bit; ragged
    shapes leave tiles partly masked (130 x 257 spans several 128-wide tiles)."""
    x = _fp8_input(shape, dtype)
    x.view(-1)[5:8] = 0  # keeps a finite amax in some cases below
    history = torch.tensor([[2.0, 3.0, 4.0], [5.0, 6.0, 7.0]])
    scales = torch.tensor([0.5, 0.375, 2.0])
    for finite in (False, True):
        if finite:
            x = torch.nan_to_num(x.float(), nan=1.0, posinf=2e3, neginf=-7.0).to(dtype)
        for rowwise, columnwise in ((True, True), (True, False), (False, True)):
            (got, got_history), (want, want_history) = _quantize_both(
                x, fmt, recipe, history, scales, rowwise=rowwise, columnwise=columnwise)
            for a, b, asked in zip(got[:2], want[:2], (rowwise, columnwise)):
                if asked:
                    _same_bits(a, b)
                else:
                    assert a is None and b is None
            assert torch.equal(got[2], want[2]) or (got[2].isnan() and want[2].isnan())
            torch.testing.assert_close(got_history, want_history, rtol=0, atol=0,
                                       equal_nan=True)
        if isinstance(recipe, DelayedScaling) and finite:
            assert got_history[0, 1] == x.float().abs().max() > 3  # recorded, with max
            assert got_history[0, 0] == 2 and got_history[0, 2] == 4  # others untouched


@interpreter_only
def test_fp8_cast_keeps_the_larger_recorded_amax_and_nan(fp8_kernels_on_cpu):
    x = torch.full((20, 33), -1.5)
    history = torch.tensor([[0.0, 9.0]])
    (_, got), (_, want) = _quantize_both(x, Format.E4M3, DelayedScaling(), history,
                                         torch.ones(2))
    assert got[0, 1] == want[0, 1] == 9.0
    x[3, 7] = float("nan")
    (_, got), _ = _quantize_both(x, Format.E4M3, DelayedScaling(), history, torch.ones(2))
    assert got[0, 1].isnan()


@interpreter_only
def test_fp8_cast_reads_strided_inputs(fp8_kernels_on_cpu):
    """A transposed view and a broadcast (stride-0) gradient are read in place."""
    base = _fp8_input((40, 70), torch.bfloat16)
    for x in (base.t(), base[:, 3:50:2], torch.ones(1, 48).expand(32, 48) * 3):
        (got, _), (want, _) = _quantize_both(x, Format.E5M2, Float8CurrentScaling(),
                                             torch.zeros(1, 2), torch.ones(2),
                                             rowwise=True, columnwise=True)
        _same_bits(got[0], want[0])
        _same_bits(got[1], want[1])


def _assert_quantized_alike(got, want, x):
    """Kernel and PyTorch results of _quantize(..., dbias=True): FP8 casts and inverse scale
    bit for bit, the column sums by the summation-order rule."""
    (got, got_history), (want, want_history) = got, want
    for a, b in zip(got[:2], want[:2]):
        assert (a is None and b is None) or _same_bits(a, b) is None
    assert torch.equal(got[2], want[2]) or (got[2].isnan() and want[2].isnan())
    torch.testing.assert_close(got_history, want_history, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(want[3], x.sum(0), rtol=0, atol=0, equal_nan=True)
    assert_bias_grad_close(got[3], x)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 3), (37, 45), (130, 257), (300, 40)])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_cast_column_sums(dtype, shape, recipe, fp8_kernels_on_cpu):
    """The cast's column sums (dbias) in every orientation and alone, with infs and NaNs and
    without: the casts, inverse scale and amax as without dbias (the PyTorch path's, bit for
    bit), the sums as torch's up to summation order. Ragged shapes: tiles partly masked in
    both directions, 300 rows span three row blocks of the workspace."""
    x = _fp8_input(shape, dtype)
    history = torch.tensor([[2.0, 3.0, 4.0], [5.0, 6.0, 7.0]])
    scales = torch.tensor([0.5, 0.375, 2.0])
    for finite in (False, True):
        if finite:
            x = torch.nan_to_num(x.float(), nan=1.0, posinf=2e3, neginf=-7.0).to(dtype)
        for rowwise, columnwise in (*_ORIENTATIONS, (False, False)):
            got, want = _quantize_both(x, Format.E5M2, recipe, history, scales,
                                       rowwise=rowwise, columnwise=columnwise, dbias=True)
            _assert_quantized_alike(got, want, x)
            assert got[0][3].dtype == dtype and got[0][3].shape == (shape[1],)


def _assert_dbias_casts_alike(x, orientations):
    """The E4M3 delayed-scaling cast of x with the column sums, kernel against PyTorch, for
    each (rowwise, columnwise) of ``orientations``."""
    for rowwise, columnwise in orientations:
        got, want = _quantize_both(x, Format.E4M3, DelayedScaling(), torch.zeros(1, 2),
                                   torch.ones(2), rowwise=rowwise, columnwise=columnwise,
                                   dbias=True)
        _assert_quantized_alike(got, want, x)


@interpreter_only
def test_fp8_cast_column_sums_over_many_row_blocks(fp8_kernels_on_cpu):
    """8400 rows: 66 row blocks, more than the second pass adds in one step."""
    x = torch.randn(8400, 20, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    _assert_dbias_casts_alike(x, ((False, False), (True, True)))


@interpreter_only
def test_fp8_cast_column_sums_of_strided_inputs(fp8_kernels_on_cpu):
    """A transposed view, a strided slice and a broadcast (stride-0) gradient, read in place."""
    base = _fp8_input((140, 70), torch.bfloat16).nan_to_num(0.0, 0.0, 0.0)
    for x in (base.t(), base[:, 3:50:2], torch.ones(1, 48).expand(260, 48) * 3):
        _assert_dbias_casts_alike(x, ((True, True), (True, False)))


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cast_sums_columns_in_one_launch_only_when_asked(dtype, fp8_kernels_on_cpu,
                                                             monkeypatch):
    """float32 with both orientations takes two cast launches (a Triton miscompile, see
    fp8_cast.cast): one of them sums the columns; without dbias no launch does, and no
    second pass runs."""
    launches, passes = [], []
    real_launch, real_pass = fp8_cast._launch, fp8_cast._sum_row_blocks
    monkeypatch.setattr(fp8_cast, "_launch",
                        lambda *a, **k: launches.append(k.get("dbias", False))
                        or real_launch(*a, **k))
    monkeypatch.setattr(fp8_cast, "_sum_row_blocks",
                        lambda *a: passes.append(1) or real_pass(*a))
    x = _fp8_input((40, 24), dtype).nan_to_num(0.0, 0.0, 0.0)
    for dbias in (True, False):
        launches.clear()
        passes.clear()
        *_, col_sums = fp8_cast.cast(x, torch.ones(()), torch.float8_e4m3fn, 448.0,
                                     rowwise=True, columnwise=True, dbias=dbias)
        assert len(launches) == (2 if dtype == torch.float32 else 1)
        assert launches.count(True) == int(dbias) and len(passes) == int(dbias)
        assert (col_sums is None) != dbias


@interpreter_only
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("frozen", [False, True], ids=["all-grads", "bias-grad-only"])
def test_fp8_linear_bias_grad_from_the_cast(recipe, frozen, fp8_kernels_on_cpu, monkeypatch):
    """The FP8 Linear's backward asks the output gradient's cast for the column sums (the
    bias gradient) and runs no sum of its own; with the weight frozen and an input without
    grad the cast gives the bias gradient alone. Bias gradient by the summation-order rule,
    everything else as the PyTorch path's, bit for bit."""
    casts = []
    real = fp8_cast.cast
    monkeypatch.setattr(fp8_cast, "cast",
                        lambda *a, **k: casts.append(k.get("dbias", False)) or real(*a, **k))
    dy = (torch.randn(2, 16, 48, generator=torch.Generator().manual_seed(1)) * 3)
    dy = dy.to(torch.bfloat16)
    results = []
    for enabled in (True, False):
        torch.manual_seed(0)
        lin = te.Linear(64, 48, device="cpu", params_dtype=torch.bfloat16)
        lin.weight.requires_grad_(not frozen)
        x = (torch.randn(2, 16, 64) * 4).to(torch.bfloat16).requires_grad_(not frozen)
        monkeypatch.setattr(kernels, "kernels_enabled", lambda *tensors: enabled)
        with te.autocast(recipe=recipe):
            out = lin(x)
        casts.clear()
        ops = [name for name, _ in aten_ops(lambda: out.backward(dy))[0]]
        if enabled:
            assert casts == [True] and "sum" not in ops, ops
        results.append([x.grad, lin.weight.grad, lin.fp8_meta.amax_history_bwd,
                        lin.fp8_meta.scale_bwd, lin.bias.grad])
    (*got, bias_grad), (*want, want_bias_grad) = results
    for a, b in zip(got, want, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert (got[0] is None) == frozen
    assert torch.equal(want_bias_grad, dy.reshape(-1, 48).sum(0))
    assert_bias_grad_close(bias_grad, dy)


def _same_scalar(a, b):
    """0-dim float32 tensors with equal bits (NaNs: both NaN)."""
    assert a.shape == b.shape == () and a.dtype == b.dtype == torch.float32
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)) or (a.isnan() and b.isnan())


_ORIENTATIONS = ((True, True), (True, False), (False, True))
_FP32_MAX = torch.finfo(torch.float32).max


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2])
def test_fp8_current_scale_from_special_amaxes(dtype, fmt, fp8_kernels_on_cpu):
    """The cast kernel's scale from the amax and its inverse scale, bit for bit with
    compute_scale: amax 0 (scale 1), inf and NaN (scale 1), a tiny amax whose quotient
    overflows (float32's max; float16 has no value that small), and ordinary ones."""
    finfo = torch.finfo(dtype)
    cases = {"zeros": 0.0, "inf": float("inf"), "nan": float("nan"),
             "tiny": finfo.smallest_normal, "small": 3e-5, "large": 7e3}
    if dtype != torch.bfloat16:  # the interpreter flushes bfloat16 subnormals (the GPU not)
        cases["subnormal"] = finfo.smallest_normal * finfo.eps
    for name, value in cases.items():
        x = torch.zeros(9, 21)
        x[4, 17] = -value
        x[2, 3] = value / 3
        x = x.to(dtype)
        for rowwise, columnwise in _ORIENTATIONS:
            (got, _), (want, _) = _quantize_both(x, fmt, Float8CurrentScaling(), torch.zeros(1, 2),
                                                 torch.ones(2), rowwise=rowwise,
                                                 columnwise=columnwise)
            _same_scalar(got[2], want[2])
            for a, b in zip(got[:2], want[:2]):
                assert (a is None and b is None) or _same_bits(a, b) is None
        if name in ("zeros", "inf", "nan"):
            assert want[2] == 1.0  # compute_scale kept the old scale, 1
        if name in ("tiny", "subnormal") and dtype != torch.float16:
            assert want[2] == torch.tensor(_FP32_MAX).reciprocal()  # the quotient overflowed


@interpreter_only
def test_fp8_current_scale_over_many_amaxes(fp8_kernels_on_cpu):
    """Amaxes across float32's range (subnormals to near its max): every quotient and inverse
    as compute_scale and reciprocal round them."""
    amaxes = torch.logspace(-45, 38, 97) * (1 + torch.rand(97, generator=torch.Generator()
                                                            .manual_seed(0)))
    for amax in amaxes[amaxes.isfinite()]:
        x = torch.full((3, 5), amax.item() / 2)
        x[1, 2] = amax
        for fmt in (Format.E4M3, Format.E5M2):
            (got, _), (want, _) = _quantize_both(x, fmt, Float8CurrentScaling(),
                                                 torch.zeros(1, 2), torch.ones(2))
            _same_scalar(got[2], want[2])
            _same_bits(got[0], want[0])


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_delayed_inverse_scale_of_special_scales(dtype, fp8_kernels_on_cpu):
    """The inverse of a stored scale as torch's reciprocal: 0 (inf), -0, inf (0), NaN, a
    subnormal (its inverse overflows to inf) and ordinary scales."""
    x = _fp8_input((6, 40), dtype).nan_to_num(0.0, 0.0, 0.0)
    for value in (0.0, -0.0, float("inf"), float("nan"), 1e-45, 3e-39, 0.1, 448.0, 1e30):
        scales = torch.tensor([1.0, value])
        for rowwise, columnwise in _ORIENTATIONS:
            (got, _), (want, _) = _quantize_both(x, Format.E4M3, DelayedScaling(),
                                                 torch.zeros(1, 2), scales, rowwise=rowwise,
                                                 columnwise=columnwise)
            _same_scalar(got[2], want[2])
            for a, b in zip(got[:2], want[:2]):
                assert (a is None and b is None) or _same_bits(a, b) is None


@interpreter_only
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_kernel_path_leaves_no_scalar_math_to_torch(recipe, fp8_kernels_on_cpu):
    """The cast kernel gives the inverse scale and computes the current scale: around the
    kernels, torch only allocates (no reciprocal, no compute_scale's ops, no amax)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    scalar_math = {"reciprocal", "div", "div_", "where", "isinf", "isfinite", "gt", "lt",
                   "bitwise_and", "logical_and", "full_like", "ones_like", "abs", "amax",
                   "max", "maximum", "mul", "clamp"}

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = _fp8_input((24, 40), torch.bfloat16)
    history, scales = torch.zeros(1, 2), torch.ones(2)
    cast_results = []
    real = fp8_cast.cast
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp8_cast, "cast", lambda *a, **k: cast_results.append(real(*a, **k))
                      or cast_results[-1])
        with Ops() as ops:
            data, data_t, scale_inv = fp8._quantize(x, Format.E4M3, 448.0, recipe, history,
                                                    scales, 1, columnwise=True)
    assert len(cast_results) == 1 and scale_inv is cast_results[0][2]
    assert "empty" in ops.names  # the mode saw the allocations
    assert not scalar_math.intersection(ops.names), ops.names


@interpreter_only
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=3), Float8CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("fmt", [Format.HYBRID, Format.E4M3])
def test_fp8_gemm_with_kernels_matches_pytorch(recipe, fmt, fp8_kernels_on_cpu):
    """Linear's FP8 forward and backward, two steps, with the kernels and without: equal
    outputs, input and weight gradients, amax histories and scales (bit for bit); the bias
    gradients (the kernel's column sums, torch's sum) by the summation-order rule."""
    recipe = type(recipe)(fp8_format=fmt, **({"amax_history_len": 3}
                                             if isinstance(recipe, DelayedScaling) else {}))
    results = []
    for enabled in (True, False):
        torch.manual_seed(0)
        lin = te.Linear(64, 48, device="cpu", params_dtype=torch.bfloat16)
        got = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "kernels_enabled", lambda *tensors: enabled)
            for step in range(2):
                x = (torch.randn(2, 16, 64) * 4).to(torch.bfloat16).requires_grad_()
                with te.autocast(recipe=recipe):
                    out = lin(x)
                out.float().square().sum().backward()
                got += [out, x.grad, lin.weight.grad.clone()]
                # d(out.float().square().sum()) / d(out) = 2 out, exact in bfloat16
                assert_bias_grad_close(lin.bias.grad, 2 * out)
                lin.zero_grad()
            meta = lin.fp8_meta
            got += [meta.amax_history_fwd, meta.scale_fwd, meta.amax_history_bwd,
                    meta.scale_bwd]
        results.append(got)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@interpreter_only
def test_calibration_amax_through_the_kernel(fp8_kernels_on_cpu):
    """Calibration records the amaxes of 3D inputs and the weight with the amax kernel."""
    x = _fp8_input((3, 16, 40), torch.float32).nan_to_num(0.0, 0.0, 0.0)
    results = []
    for enabled in (True, False):
        torch.manual_seed(0)
        lin = te.Linear(40, 32, device="cpu")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "kernels_enabled", lambda *tensors: enabled)
            with te.autocast(enabled=False, calibrating=True):
                lin(x)
        results.append(lin.fp8_meta.scale_fwd)
    assert torch.equal(*results)


@interpreter_only
def test_fp8_cast_refuses_bad_arguments():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="rowwise and/or columnwise"):
        fp8_cast.cast(x, torch.ones(()), torch.float8_e4m3fn, 448.0, rowwise=False)
    with pytest.raises(ValueError, match="amax must be a one-element float32"):
        fp8_cast.fold_amax(x, torch.zeros(2))
    with pytest.raises(ValueError, match="either scale or scale_from_amax"):
        fp8_cast.cast(x, torch.ones(()), torch.float8_e4m3fn, 448.0,
                      scale_from_amax=torch.ones(()))
    with pytest.raises(ValueError, match="either scale or scale_from_amax"):
        fp8_cast.cast(x, None, torch.float8_e4m3fn, 448.0)
    with pytest.raises(ValueError, match="scale_from_amax must be a one-element float32"):
        fp8_cast.cast(x, None, torch.float8_e4m3fn, 448.0,
                      scale_from_amax=torch.ones((), dtype=torch.float64))
    with pytest.raises(ValueError, match="scale must be a one-element float32"):
        fp8_cast.cast(x, torch.ones(3), torch.float8_e4m3fn, 448.0)
    with pytest.raises(ValueError, match="gelu=True casts an activation"):
        fp8_cast.cast(x, torch.ones(()), torch.float8_e4m3fn, 448.0, gelu=True, dbias=True)
    with pytest.raises(ValueError, match="gelu=True casts GELU's output, dgelu_input"):
        fp8_cast.cast(x, torch.ones(()), torch.float8_e4m3fn, 448.0, gelu=True,
                      dgelu_input=x)
    with pytest.raises(ValueError, match="dgelu_input must be a float32, bfloat16 or float16 "
                                         "tensor of x's shape"):
        fp8_cast.fold_amax(x, torch.zeros(1), dgelu_input=x.t())
    with pytest.raises(ValueError, match="dgelu_input must be"):
        fp8_cast.cast(x, torch.ones(()), torch.float8_e4m3fn, 448.0, dgelu_input=x.double())


# The cast's gelu option (GELU in FC2's FP8 input cast) by the rule of tests/test_fp8.py: the
# cast of torch's float32 GELU, but for float32 values within a few ulps of an FP8 rounding
# boundary (the interpreter's tanh is not torch's to the last bit), and within one FP8 step of
# the unfused cast (gelu(h) rounded to h's dtype first).
@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2])
@pytest.mark.parametrize("shape", [(1, 3), (37, 45), (130, 257)])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_gelu_cast_matches_pytorch(dtype, fmt, shape, recipe, fp8_kernels_on_cpu):
    """_quantize(gelu=True) through the kernel: every orientation of the cast of gelu(x), the
    inverse scale and the recorded amax by the rule, with infs and NaNs (gelu(-inf) is NaN)
    and without; ragged shapes leave tiles partly masked."""
    fp8_max = {Format.E4M3: 448.0, Format.E5M2: 57344.0}[fmt]
    x = _fp8_input(shape, dtype)
    history = torch.tensor([[2.0, 3.0, 4.0], [5.0, 6.0, 7.0]])
    scales = torch.tensor([0.5, 0.375, 2.0])
    for finite in (False, True):
        if finite:
            x = torch.nan_to_num(x.float(), nan=1.0, posinf=2e3, neginf=-7.0).to(dtype)
        scale = gelu_cast_scale(x, recipe, scales, fp8_max)
        for rowwise, columnwise in _ORIENTATIONS:
            (got, got_history), (want, want_history) = _quantize_both(
                x, fmt, recipe, history, scales, rowwise=rowwise, columnwise=columnwise,
                gelu=True)
            for a, b, asked in zip(got[:2], want[:2], (rowwise, columnwise)):
                assert (a is None and b is None) == (not asked)
            if rowwise:
                assert_fp8_of_gelu(got[0], x, scale, fp8_max)
            if columnwise:
                assert_fp8_of_gelu(got[1].t(), x, scale, fp8_max)
                assert got[1].is_contiguous()
            if rowwise and columnwise:
                _same_bits(got[1], got[0].t().contiguous())
            for a, b in ((got[2], want[2]), (got_history, want_history)):
                torch.testing.assert_close(a, b, rtol=GELU_CAST_RTOL, atol=0, equal_nan=True)
        if isinstance(recipe, DelayedScaling):
            assert got_history[0, 1].isnan() == fp8._gelu_float32(x).isnan().any()
            assert got_history[0, 0] == 2 and got_history[0, 2] == 4  # others untouched


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_gelu_cast_within_one_step_of_the_unfused_cast(dtype, recipe, fp8_kernels_on_cpu):
    """The kernel's cast of gelu(h) against its cast of torch's gelu(h) in h's dtype."""
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(130, 257, generator=g) * 3).to(dtype)
    history, scales = torch.zeros(1, 2), torch.tensor([1.0, 16.0])
    fused = fp8._quantize(h, Format.E4M3, 448.0, recipe, history, scales.clone(), 1,
                          columnwise=True, gelu=True)
    unfused = fp8._quantize(torch.nn.functional.gelu(h, approximate="tanh"), Format.E4M3,
                            448.0, recipe, history, scales.clone(), 1, columnwise=True)
    for a, b in zip(fused[:2], unfused[:2]):
        assert_within_one_fp8_step(a, b)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_gelu_amax_pass(dtype, fp8_kernels_on_cpu):
    """fold_amax(gelu=True): max|gelu(x)| (by the rule), a larger recorded amax kept, NaN
    from gelu(-inf) (and from a NaN) propagated; without gelu max|x|."""
    x = (torch.randn(37, 300, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    x[3, 4] = -100.0  # x's amax, gelu's is near 0 there
    amax = torch.zeros(1)
    fp8_cast.fold_amax(x, amax, gelu=True)
    want = fp8._gelu_float32(x).abs().max()
    torch.testing.assert_close(amax[0], want, rtol=GELU_CAST_RTOL, atol=0)
    assert want < x.float().abs().max()  # gelu's amax is not x's (negative x)
    fp8_cast.fold_amax(x, amax)
    assert amax[0] == x.float().abs().max()
    big = torch.full((1,), 1e4)
    fp8_cast.fold_amax(x, big, gelu=True)
    assert big[0] == 1e4
    for special in (float("-inf"), float("nan")):
        y = x.clone()
        y[5, 7] = special
        fp8_cast.fold_amax(y, big, gelu=True)
        assert big[0].isnan()
        big.fill_(1e4)


@interpreter_only
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_mlp_casts_gelu_in_the_kernel(recipe, fp8_kernels_on_cpu, monkeypatch):
    """LayerNormMLP in FP8 with the kernels: no GELU op in the forward (FC2's input cast, and
    current scaling's amax pass, apply it in the kernel: the cast of FC1's output by the
    rule), no gelu_backward op in the backward (FC1's gradient cast takes FC1's output and
    the gradient of the GELU's output: the cast of their gelu_backward by the rule)."""
    gelu_casts, dgelu_casts, gelu_amaxes = [], [], []
    real_cast, real_fold = fp8_cast.cast, fp8_cast.fold_amax

    def cast(x, *args, gelu=False, **options):
        result = real_cast(x, *args, gelu=gelu, **options)
        # (a delayed scale is a view of the state the autocast's exit or the backward's end
        # updates)
        scales = tuple(None if t is None else t.clone()
                       for t in (options["scale"], options.get("scale_from_amax")))
        if options.get("dgelu_input") is not None:
            dgelu_casts.append((x, options["dgelu_input"], options["dbias"], *scales, result))
        if gelu:
            gelu_casts.append((x.clone(), *scales, result))
        return result

    monkeypatch.setattr(fp8_cast, "cast", cast)
    monkeypatch.setattr(fp8_cast, "fold_amax", lambda x, amax, **options: (
        gelu_amaxes.append(options.get("gelu", False)), real_fold(x, amax, **options)))
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(32, 64, device="cpu", params_dtype=torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=recipe):
        forward_ops, out = aten_ops(lambda: mlp(x))
    backward_ops, _ = aten_ops(lambda: out.float().square().sum().backward())
    assert not [op for op in forward_ops if op[0] == "gelu"]
    assert not [op for op in backward_ops if op[0] == "gelu_backward"]
    assert len(gelu_casts) == 1 and x.grad is not None
    h, scale, amax, (data, data_t, _, _) = gelu_casts[0]
    assert h.shape == (16, 64)  # FC1's output
    if amax is not None:  # current scaling: the amax pass of gelu(h)
        assert gelu_amaxes.count(True) == 1
        scale = fp8.compute_scale(amax, torch.ones(()), 448.0)
    assert_fp8_of_gelu(data, h, scale, 448.0)
    _same_bits(data_t, data.t().contiguous())
    assert len(dgelu_casts) == 1
    dy, h_saved, dbias, scale, amax, result = dgelu_casts[0]
    assert torch.equal(h_saved, h) and dbias
    if amax is not None:  # current scaling: the amax pass of dgelu(dy, h)
        assert_amax_of_dgelu(amax, dy, h)
        scale = fp8.compute_scale(amax, torch.ones(()), 57344.0)
    assert_dgelu_cast(result, dy, h, scale, 57344.0, True, True)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 3), (37, 45), (300, 257)])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_dgelu_cast_matches_pytorch(dtype, shape, recipe, fp8_kernels_on_cpu):
    """_quantize(dgelu_input=h, dbias=True) through the kernel, each orientation and dbias
    alone: the casts of gelu_backward(dy, h) in float32 by the rule, the transpose the
    row-major cast's, the column sums of the float32 values, the amax within the slack;
    ragged shapes, 300 rows: three row blocks of the sums' workspace. h a strided view."""
    g = torch.Generator().manual_seed(3)
    h = (torch.randn(shape[1], shape[0], generator=g) * 3).to(dtype).t()
    dy = (torch.randn(*shape, generator=g) * torch.logspace(-4, 2, shape[1])).to(dtype)
    history = torch.tensor([[2.0, 3.0, 4.0], [5.0, 6.0, 7.0]])
    scales = torch.tensor([0.5, 0.375, 2.0])
    scale = dgelu_cast_scale(dy, h, recipe, scales, fp8_cast.fold_amax, 57344.0)
    for rowwise, columnwise in (*_ORIENTATIONS, (False, False)):
        got_history = history.clone()
        got = fp8._quantize(dy, Format.E5M2, 57344.0, recipe, got_history, scales.clone(), 1,
                            rowwise=rowwise, columnwise=columnwise, dbias=True,
                            dgelu_input=h)
        assert_dgelu_cast(got, dy, h, scale, 57344.0, rowwise, columnwise)
        if isinstance(recipe, DelayedScaling):
            assert_amax_of_dgelu(got_history[0, 1], dy, h)
            torch.testing.assert_close(got[2], 1 / scales[1], rtol=0, atol=0)


# The delayed-scaling update (kernels/fp8_scale.py) against fp8.update_amax_history's PyTorch
# code, bit for bit: scales and rolled histories.
def _amax_history(history_len, n_cols, seed=0):
    """Amaxes across float32's range, with columns that hold a NaN (in row 0 or later), an
    inf, only zeros, a subnormal amax (its quotient overflows), and old scales with an inf
    and a NaN."""
    g = torch.Generator().manual_seed(seed)
    history = torch.rand(history_len, n_cols, generator=g) * torch.logspace(-30, 30, n_cols)
    specials = {0: float("nan"), 1: float("inf"), 3: 1e-45}
    for col, value in specials.items():
        if col < n_cols:
            history[min(history_len - 1, 2 + col), col] = value
    if n_cols > 2:
        history[:, 2] = 0.0
    if n_cols > 4:
        history[0, 4] = float("nan")
    scale = torch.rand(n_cols, generator=g) + 0.5
    scale[-2:] = torch.tensor([float("inf"), float("nan")])[-n_cols:]
    return history, scale


def _same_words(a, b):
    assert a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _update_both(history, scale, recipe, fp8_max, views=lambda h, s: (h, s)):
    """update_amax_history with the kernel and with the PyTorch code, each on its own copy:
    the kernel's call count, and both (history, scale)."""
    calls = []
    results = []
    for enabled in (True, False):
        h, s = history.clone(), scale.clone()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "kernels_enabled", lambda *tensors: enabled)
            real = fp8_scale.update_delayed_scaling
            patch.setattr(fp8_scale, "update_delayed_scaling",
                          lambda *a, **k: calls.append(1) or real(*a, **k))
            fp8.update_amax_history(*views(h, s), fp8_max, recipe)
        results.append((h, s))
    return len(calls), results


@interpreter_only
@pytest.mark.parametrize("history_len, n_cols", [(1, 3), (5, 7), (1024, 4), (1031, 37)])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
def test_delayed_scale_update_matches_pytorch(history_len, n_cols, algo, margin, fp8_max):
    """1031 x 37 spans several blocks of rows and of columns, ragged."""
    history, scale = _amax_history(history_len, n_cols)
    recipe = DelayedScaling(amax_history_len=history_len, amax_compute_algo=algo,
                            margin=margin)
    calls, ((got_h, got_s), (want_h, want_s)) = _update_both(history, scale, recipe, fp8_max)
    assert calls == 1
    _same_words(got_s, want_s)
    _same_words(got_h, want_h)
    assert n_cols == 3 or not torch.equal(got_s.view(torch.int32), scale.view(torch.int32))


@interpreter_only
def test_delayed_scale_update_of_strided_views():
    """A column of a history and a slice of the scales (the backward's per-GEMM update),
    and a transposed history, in place; the rest untouched."""
    history, scale = _amax_history(16, 6)
    recipe = DelayedScaling(amax_history_len=16)
    for gemm in (0, 4, 5):
        calls, ((got_h, got_s), (want_h, want_s)) = _update_both(
            history, scale, recipe, 57344.0,
            lambda h, s: (h[:, gemm:gemm + 1], s[gemm:gemm + 1]))
        assert calls == 1
        _same_words(got_h, want_h)
        _same_words(got_s, want_s)
        others = [col for col in range(6) if col != gemm]
        _same_words(got_h[:, others], history[:, others])
    stored_t = history.t().contiguous()
    calls, ((got_h, _), (want_h, _)) = _update_both(stored_t, scale, recipe, 448.0,
                                                    lambda h, s: (h.t(), s))
    assert calls == 1
    _same_words(got_h, want_h)


@interpreter_only
def test_custom_delayed_algorithms_keep_the_pytorch_path():
    history, scale = _amax_history(4, 3)
    for recipe in (DelayedScaling(amax_compute_algo=lambda h: h.mean(0)),
                   DelayedScaling(scaling_factor_compute_algo=lambda a, s, m, r: s * 2)):
        calls, ((got_h, got_s), (want_h, want_s)) = _update_both(history, scale, recipe, 448.0)
        assert calls == 0
        _same_words(got_s, want_s)
        _same_words(got_h, want_h)


@interpreter_only
def test_delayed_scale_update_refuses_bad_arguments():
    with pytest.raises(ValueError, match="float32 \\[history_len, n\\]"):
        fp8_scale.update_delayed_scaling(torch.zeros(4, 3), torch.ones(2), 448.0, 0, False)
    with pytest.raises(ValueError, match="history must be a float32"):
        fp8_scale.update_delayed_scaling(torch.zeros(4, 3, dtype=torch.float64), torch.ones(3),
                                         448.0, 0, False)


# Bias gradients (kernels/bias_grad.py). The kernels sum in another order than torch's, so
# their sums are not torch's bit for bit; they are held to torch's own accuracy instead.
def assert_as_accurate_as_torch(got, torch_result, exact):
    """The largest error of ``got`` against the float64 ``exact`` is at most twice torch's own
    largest error plus 2 ulps of got's dtype at each value (the final rounding, which may go
    the other way where torch's sum was a little off). A dropped or repeated row, a wrong
    column or a sum of the wrong values is off by the values themselves, far outside."""
    assert got.dtype == torch_result.dtype and got.shape == torch_result.shape == exact.shape
    err = (got.double() - exact).abs()
    torch_err = (torch_result.double() - exact).abs().max() if exact.numel() else 0.0
    bound = 2 * torch_err + 2 * torch.finfo(got.dtype).eps * exact.abs()
    worst = (err - bound).argmax() if exact.numel() else None
    assert (err <= bound).all(), (
        f"error {err.flatten()[worst].item():.3g} > bound {bound.flatten()[worst].item():.3g} "
        f"(torch's largest error {float(torch_err):.3g})")


def _gelu_backward(dy, h):
    return torch.ops.aten.gelu_backward(dy, h, approximate="tanh")


@pytest.fixture
def bf16_rounds_to_nearest(monkeypatch):
    """The interpreter converts float32 to bfloat16 by truncation; the GPU (cvt.rn) and torch
    round to nearest even: model the GPU's conversion with torch's."""
    real = triton_interpreter.InterpreterBuilder.cast_impl

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(src.data.copy()).to(torch.bfloat16).view(torch.uint16)
            return triton_interpreter.TensorHandle(data.numpy(), tl.bfloat16)
        return real(self, src, dst_type)

    monkeypatch.setattr(triton_interpreter.InterpreterBuilder, "cast_impl", cast)


# (1, n): one row; 1000 x 300: several row chunks of several row blocks, and two column
# tiles, the second ragged; 300 x 1: one column; 5 x 513: three column tiles, one row block
_SUM_SHAPES = [(1, 7), (1, 300), (37, 256), (1000, 300), (5, 513), (300, 1)]
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _sum_input(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2 + 0.3).to(dtype)


@interpreter_only
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("shape", _SUM_SHAPES)
def test_column_sum_as_accurate_as_torch(dtype, shape, bf16_rounds_to_nearest):
    g = _sum_input(shape, dtype)
    assert_as_accurate_as_torch(bias_grad.column_sum(g), g.sum(0), g.double().sum(0))


@interpreter_only
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("shape", _SUM_SHAPES)
def test_dgelu_column_sum_as_accurate_as_torch(dtype, shape, bf16_rounds_to_nearest):
    """dh against torch's gelu_backward and db against its sum, both against float64. The
    kernel sums the float32 dh values before their rounding (torch sums the rounded dh)."""
    dy = _sum_input(shape, dtype)
    h = _sum_input(shape, dtype, seed=1) * 2  # into both tails of GELU
    dh, db = bias_grad.dgelu_column_sum(dy, h)
    exact = _gelu_backward(dy.double(), h.double())
    reference = _gelu_backward(dy, h)
    assert dh.is_contiguous()
    assert_as_accurate_as_torch(dh, reference, exact)
    assert_as_accurate_as_torch(db, reference.sum(0), exact.sum(0))


@interpreter_only
def test_column_sum_over_many_chunks(bf16_rounds_to_nearest, monkeypatch):
    """More partial rows than the final pass reads at once (94 chunks of one 32-row block:
    three steps, the last ragged), as on a GPU with many SMs."""
    monkeypatch.setattr(bias_grad, "_target_programs", lambda device, programs_per_sm: 100)
    g = _sum_input((3000, 7), torch.bfloat16)
    assert bias_grad._row_chunks(3000, 7, 32, g.device, bias_grad.TILES) == (1, 32, 94)
    assert_as_accurate_as_torch(bias_grad.column_sum(g), g.sum(0), g.double().sum(0))
    dh, db = bias_grad.dgelu_column_sum(g, g)
    assert_as_accurate_as_torch(db, _gelu_backward(g, g).sum(0),
                                _gelu_backward(g.double(), g.double()).sum(0))


@interpreter_only
def test_column_sum_of_strided_views():
    """A slice of wider rows and broadcast rows (stride 0) are read in place; a transposed
    view (column stride > 1) is copied first."""
    base = _sum_input((50, 300), torch.float32)
    views = [base[:, 7:107], torch.ones(1, 40).expand(30, 40) * 3, base.t(), base[::3, ::2]]
    for g in views:
        assert_as_accurate_as_torch(bias_grad.column_sum(g), g.sum(0), g.double().sum(0))
    dh, db = bias_grad.dgelu_column_sum(base[:, 7:107], base.t()[:100, :50].t())
    reference = _gelu_backward(base[:, 7:107], base[:, :100])
    assert_as_accurate_as_torch(db, reference.sum(0), _gelu_backward(
        base[:, 7:107].double(), base[:, :100].double()).sum(0))


@interpreter_only
def test_bias_grad_of_empty_gradients():
    assert torch.equal(bias_grad.column_sum(torch.zeros(0, 5)), torch.zeros(5))
    dh, db = bias_grad.dgelu_column_sum(torch.zeros(0, 5), torch.zeros(0, 5))
    assert dh.shape == (0, 5) and torch.equal(db, torch.zeros(5))


@interpreter_only
def test_bias_grad_refuses_bad_arguments():
    with pytest.raises(ValueError, match="g2d must be 2D"):
        bias_grad.column_sum(torch.zeros(2, 3, 4))
    with pytest.raises(TypeError, match="g2d must be float32, bfloat16 or float16"):
        bias_grad.column_sum(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(TypeError, match="g2d must be a torch.Tensor"):
        bias_grad.column_sum([[1.0]])
    with pytest.raises(ValueError, match="dy and h must have one shape"):
        bias_grad.dgelu_column_sum(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(TypeError, match="h must be float32"):
        bias_grad.dgelu_column_sum(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int32))


def record_bias_grad_functions(monkeypatch):
    """A list that gets the names of the bias-gradient Functions the modules apply
    ("linear", "gelu")."""
    calls = []
    for name, function in (("linear", linear_module._LinearBiasGrad),
                           ("gelu", linear_module._LinearGelu)):
        real = function.apply
        monkeypatch.setattr(function, "apply",
                            lambda *a, name=name, real=real: calls.append(name) or real(*a))
    return calls


@pytest.fixture
def functions_called(monkeypatch):
    return record_bias_grad_functions(monkeypatch)


def test_bias_grad_gate(monkeypatch):
    """use_bias_grad_kernels: a bias that needs a gradient, grad mode, one kernel dtype, no
    torch.autocast, a non-empty input, and the kernels enabled (CUDA)."""
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    b = torch.zeros(3, requires_grad=True)
    assert not kernels.use_bias_grad_kernels(x, w, b)  # CPU tensors
    monkeypatch.setattr(kernels, "kernels_enabled", lambda *tensors: True)
    assert kernels.use_bias_grad_kernels(x, w, b)
    assert kernels.use_bias_grad_kernels(x.half(), w.half(), b.detach().half().requires_grad_())
    assert not kernels.use_bias_grad_kernels(x, w, None)
    assert not kernels.use_bias_grad_kernels(x, w, b.detach())
    assert not kernels.use_bias_grad_kernels(x.bfloat16(), w, b)
    assert not kernels.use_bias_grad_kernels(x.double(), w.double(),
                                             b.detach().double().requires_grad_())
    assert not kernels.use_bias_grad_kernels(x[:0], w, b)
    with torch.no_grad():
        assert not kernels.use_bias_grad_kernels(x, w, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not kernels.use_bias_grad_kernels(x, w, b)


def _forward_calls(module, x, calls, context=None):
    calls.clear()
    with context or torch.enable_grad():
        module(x)
    return list(calls)


def test_modules_take_the_bias_grad_functions_only_where_they_apply(functions_called,
                                                                     monkeypatch):
    """Forward only (the parent has no interpreter, so _LinearGelu's forward kernel is
    stood in for by torch's GELU): which Functions each module applies."""
    from transformer_fa.kernels import bias_grad as bias_grad_module

    monkeypatch.setattr(kernels, "kernels_enabled", lambda *tensors: True)
    monkeypatch.setattr(kernels, "prefer_fused_norm", lambda hidden: False)
    monkeypatch.setattr(bias_grad_module, "gelu",
                        lambda x: torch.nn.functional.gelu(x, approximate="tanh"))
    x = torch.randn(3, 2, 16)
    calls = functions_called

    def build(cls, *args, **kwargs):
        torch.manual_seed(0)
        return cls(*args, device="cpu", **kwargs)

    linear = build(te.Linear, 16, 8)
    assert _forward_calls(linear, x, calls) == ["linear"]
    assert _forward_calls(linear, x, calls, torch.no_grad()) == []
    assert _forward_calls(build(te.Linear, 16, 8, return_bias=True), x, calls) == []
    assert _forward_calls(build(te.Linear, 16, 8, bias=False), x, calls) == []
    linear.bias.requires_grad_(False)
    assert _forward_calls(linear, x, calls) == []
    assert _forward_calls(build(te.LayerNormLinear, 16, 8), x, calls) == ["linear"]
    mlp = build(te.LayerNormMLP, 16, 32)
    assert _forward_calls(mlp, x, calls) == ["gelu", "linear"]
    assert _forward_calls(build(te.LayerNormMLP, 16, 32, checkpoint=True), x, calls) \
        == ["gelu", "linear"]
    assert _forward_calls(build(te.LayerNormMLP, 16, 32, return_bias=True), x, calls) \
        == ["gelu"]
    assert _forward_calls(build(te.LayerNormMLP, 16, 32, activation="swiglu"), x, calls) \
        == ["linear", "linear"]
    assert _forward_calls(build(te.LayerNormMLP, 16, 32, activation="relu"), x, calls) \
        == ["linear", "linear"]
    mlp.fc1_bias.requires_grad_(False)
    assert _forward_calls(mlp, x, calls) == ["linear"]
    layer = build(te.TransformerLayer, 16, 32, 2, hidden_dropout=0.0, attention_dropout=0.0)
    assert _forward_calls(layer, x, calls) == ["linear", "linear", "gelu", "linear"]


@pytest.mark.parametrize("recipe", [DelayedScaling(), None], ids=["fp8", "calibrating"])
def test_fp8_gemms_keep_their_path(recipe, functions_called, monkeypatch):
    """Under FP8 autocast (or calibration) the GEMMs are fp8.fp8_matmul's, bias included."""
    monkeypatch.setattr(kernels, "use_bias_grad_kernels", lambda *args: True)
    monkeypatch.setattr(kernels, "kernels_enabled", lambda *tensors: False)  # fp8 casts
    monkeypatch.setenv("TRANSFORMER_FA_FP8_ON_CPU", "1")
    x = torch.randn(16, 2, 64, dtype=torch.bfloat16)
    for cls in (te.Linear, te.LayerNormMLP):
        module = cls(64, 64, device="cpu", params_dtype=torch.bfloat16)
        context = te.autocast(enabled=recipe is not None, calibrating=recipe is None,
                              recipe=recipe)
        assert _forward_calls(module, x, functions_called, context) == []


def _module_cases():
    kwargs = dict(device="cpu")
    return {
        "Linear": lambda: te.Linear(24, 20, **kwargs),
        "Linear-split": lambda: te.Linear(24, 20, parameters_split=("a", "b"), **kwargs),
        "LayerNormLinear": lambda: te.LayerNormLinear(24, 20, **kwargs),
        "LayerNormMLP": lambda: te.LayerNormMLP(24, 40, **kwargs),
        "LayerNormMLP-checkpoint": lambda: te.LayerNormMLP(24, 40, checkpoint=True, **kwargs),
        "LayerNormMLP-swiglu": lambda: te.LayerNormMLP(24, 40, activation="swiglu", **kwargs),
        "TransformerLayer": lambda: te.TransformerLayer(24, 40, 2, hidden_dropout=0.0,
                                                        attention_dropout=0.0, **kwargs),
    }


@interpreter_only
@pytest.mark.parametrize("case", list(_module_cases()))
@pytest.mark.parametrize("needs", ["all", "no-input-grad", "frozen-weights"])
def test_module_gradients_through_bias_grad_functions(case, needs, functions_called,
                                                      bf16_rounds_to_nearest, monkeypatch):
    """float32 outputs and gradients through the Functions (kernels interpreted) against the
    PyTorch path: equal up to the bias sums' order. A 3D input and a non-contiguous output
    gradient; an input without grad (no dx), frozen weights (no dW, bias grads only)."""
    torch.manual_seed(0)
    module = _module_cases()[case]()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    if needs == "frozen-weights":
        for name, p in module.named_parameters():
            p.requires_grad_("bias" in name)
    x = torch.randn(5, 3, 24, requires_grad=needs != "no-input-grad")
    dy = torch.randn(3, 5, module(x).shape[-1]).transpose(0, 1)  # non-contiguous
    params = [x, *module.parameters()]
    results = []
    for enabled in (True, False):
        functions_called.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "kernels_enabled", lambda *tensors: enabled)
            patch.setattr(kernels, "prefer_fused_norm", lambda hidden: False)
            results.append(_run(lambda *p: module(x), params, dy))
        assert bool(functions_called) == enabled
    _assert_close(*results, torch.float32)
# The grouped update (fp8_scale.update_delayed_scalings: many pairs, one launch) against the
# per-history kernel and the PyTorch code, bit for bit.
def _group_of_pairs(history_len, seed=0):
    """Pairs of many widths and strides: column views of one history and slices of its
    scales (the layout of a module's per-GEMM state), a transposed history, strided scales,
    a zero-width pair and plain histories, with _amax_history's special amaxes; last, amaxes
    near float32's max (with a margin: subnormal scales). The shared history's columns 6
    and 7 are in no pair."""
    shared, shared_scale = _amax_history(history_len, 8, seed)
    wide, wide_scale = _amax_history(history_len, 37, seed + 1)
    stored_t = _amax_history(history_len, 5, seed + 2)[0].t().contiguous()
    strided_scale = torch.rand(10, generator=torch.Generator().manual_seed(seed)) + 0.5
    return [(shared[:, 0:1], shared_scale[0:1]), (shared[:, 4:6], shared_scale[4:6]),
            (wide, wide_scale), (stored_t.t(), strided_scale[::2]),
            (shared[:, 2:2], shared_scale[2:2]), _amax_history(history_len, 2, seed + 3),
            (shared[:, 1:4], shared_scale[1:4]), _near_float32_max(history_len)]


def _near_float32_max(history_len):
    history = torch.zeros(history_len, 4)
    history[0] = torch.tensor([1e37, 1e38, 3e38, torch.finfo(torch.float32).max])
    return history, torch.ones(4)


def _copies(pairs):
    """Each pair's copy, views of copied bases where the pairs share one."""
    bases = {}

    def copy(t):
        base = t._base if t._base is not None else t
        if id(base) not in bases:
            bases[id(base)] = base.clone()
        return bases[id(base)].as_strided(t.shape, t.stride(), t.storage_offset())
    return [(copy(h), copy(s)) for h, s in pairs]


class _LaunchCounter:
    """A jitted kernel's launches, counted (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.fixture
def update_launches(monkeypatch):
    """Launches of the grouped and the per-history update kernels, counted."""
    counters = {name: _LaunchCounter(getattr(fp8_scale, name))
                for name in ("_update_group_kernel", "_update_kernel")}
    for name, counter in counters.items():
        monkeypatch.setattr(fp8_scale, name, counter)
    return counters


@interpreter_only
@pytest.mark.parametrize("history_len", [1, 5, 1031])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin, fp8_max", [(0, 448.0), (3, 57344.0), (20, 448.0)])
def test_grouped_scale_update_matches_per_history_and_pytorch(history_len, algo, margin,
                                                              fp8_max, update_launches):
    """One launch updates every pair in place as the per-history kernel and the PyTorch code
    do, bit for bit (margin 20: subnormal scales); the bases' other columns untouched."""
    pairs = _group_of_pairs(history_len)
    recipe = DelayedScaling(amax_history_len=history_len, amax_compute_algo=algo,
                            margin=margin)
    grouped, per_history, reference = _copies(pairs), _copies(pairs), _copies(pairs)
    fp8_scale.update_delayed_scalings(grouped, fp8_max, margin, algo == "most_recent")
    assert update_launches["_update_group_kernel"].launches == 1
    assert update_launches["_update_kernel"].launches == 0
    for history, scale in per_history:
        fp8_scale.update_delayed_scaling(history, scale, fp8_max, margin,
                                         algo == "most_recent")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "kernels_enabled", lambda *tensors: False)
        fp8.update_amax_histories(reference, fp8_max, recipe)
    for (h, s), (h1, s1), (h2, s2), (h0, s0) in zip(grouped, per_history, reference, pairs):
        for got, want in ((h, h1), (h, h2), (s, s1), (s, s2)):
            _same_words(got, want)
        assert h.numel() == 0 or not torch.equal(h, h0)
    _same_words(grouped[0][0]._base[:, 6:], pairs[0][0]._base[:, 6:])
    if margin == 20:
        assert (reference[-1][1] < torch.finfo(torch.float32).smallest_normal).any()


@interpreter_only
def test_grouped_scale_update_through_update_amax_histories(kernels_on_cpu, update_launches):
    """fp8.update_amax_histories takes the grouped launch on the kernel path (one pair: the
    per-history kernel); the PyTorch path's results, bit for bit."""
    pairs = _group_of_pairs(16)
    recipe = DelayedScaling(amax_history_len=16, margin=2)
    got, want = _copies(pairs), _copies(pairs)
    fp8.update_amax_histories(got, 448.0, recipe)
    fp8.update_amax_history(*got[2], 448.0, recipe)
    assert update_launches["_update_group_kernel"].launches == 1
    assert update_launches["_update_kernel"].launches == 1
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "kernels_enabled", lambda *tensors: False)
        fp8.update_amax_histories(want, 448.0, recipe)
        fp8.update_amax_history(*want[2], 448.0, recipe)
    for a, b in zip(got, want):
        _same_words(a[0], b[0])
        _same_words(a[1], b[1])


@interpreter_only
def test_grouped_scale_update_builds_its_table_once(monkeypatch):
    """The table is built on the first launch for a set of pairs and reused after; other
    pairs get their own; a pair's tensor going away drops its table."""
    built = []
    real = fp8_scale._Table
    monkeypatch.setattr(fp8_scale, "_Table", lambda *a: built.append(1) or real(*a))
    pairs = [_amax_history(4, 3, seed) for seed in range(3)]
    before = len(fp8_scale._TABLES)
    for _ in range(3):
        fp8_scale.update_delayed_scalings(pairs, 448.0, 0, False)
    assert len(built) == 1 and len(fp8_scale._TABLES) == before + 1
    fp8_scale.update_delayed_scalings(pairs[:2], 448.0, 0, False)
    assert len(built) == 2
    reference = _copies(pairs)
    pairs[1] = (pairs[1][0].clone(), pairs[1][1])  # a new tensor: a new table
    fp8_scale.update_delayed_scalings(pairs, 448.0, 0, False)
    assert len(built) == 3
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "kernels_enabled", lambda *tensors: False)
        fp8.update_amax_histories(reference, 448.0, DelayedScaling(amax_history_len=4))
    for a, b in zip(pairs, reference):
        _same_words(a[0], b[0])
        _same_words(a[1], b[1])
    del pairs, reference
    assert len(fp8_scale._TABLES) == before


@interpreter_only
def test_grouped_scale_update_refuses_bad_arguments():
    with pytest.raises(ValueError, match="one length and one device"):
        fp8_scale.update_delayed_scalings([_amax_history(4, 3), _amax_history(5, 3)], 448.0,
                                          0, False)
    with pytest.raises(ValueError, match="update_delayed_scalings: history must be a float32"):
        fp8_scale.update_delayed_scalings([_amax_history(4, 3), (torch.zeros(4, 3),
                                                                 torch.ones(2))], 448.0, 0,
                                          False)


@interpreter_only
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_fp8_stack_updates_in_one_launch_per_pass(algo, fp8_kernels_on_cpu, update_launches):
    """Three FP8 Linears, three steps: one grouped launch at the autocast's exit and one at
    the end of each backward pass; the modules' states and gradients those of the PyTorch
    path (its per-history updates at the same times), bit for bit."""
    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=algo, margin=1)
    results = []
    for enabled in (True, False):
        torch.manual_seed(0)
        stack = torch.nn.Sequential(*[te.Linear(32, 32, device="cpu") for _ in range(3)])
        got = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "kernels_enabled", lambda *tensors: enabled)
            for step in range(3):
                x = (torch.randn(16, 32) * (step + 1)).requires_grad_()
                with te.autocast(recipe=recipe):
                    out = stack(x)
                if enabled:
                    assert update_launches["_update_group_kernel"].launches == 2 * step + 1
                out.square().sum().backward()
                if enabled:
                    assert update_launches["_update_group_kernel"].launches == 2 * step + 2
                got += [out, x.grad]
        for lin in stack:
            meta = lin.fp8_meta
            got += [lin.weight.grad, meta.amax_history_fwd, meta.scale_fwd,
                    meta.amax_history_bwd, meta.scale_bwd]
        results.append(got)
    assert update_launches["_update_kernel"].launches == 0
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@interpreter_only
@pytest.mark.parametrize("dtype", _DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (37, 256), (5, 3000), (2, 3, 1500)])
def test_gelu_as_accurate_as_torch(dtype, shape, bf16_rounds_to_nearest, monkeypatch):
    """The GELU forward kernel against torch's tanh GELU, both against float64, in blocks of
    1024 elements so that the shapes above span several programs and a ragged last one; a
    transposed view is read through a copy, and the shape comes back."""
    monkeypatch.setattr(bias_grad, "_GELU_BLOCK", 1024)
    x = _sum_input(shape, dtype, seed=2) * 3  # into both tails of GELU
    got = bias_grad.gelu(x)
    assert got.shape == x.shape and got.dtype == dtype
    assert_as_accurate_as_torch(got, torch.nn.functional.gelu(x, approximate="tanh"),
                                torch.nn.functional.gelu(x.double(), approximate="tanh"))
    t = x.reshape(-1, shape[-1]).t()
    assert_as_accurate_as_torch(bias_grad.gelu(t), torch.nn.functional.gelu(t, approximate="tanh"),
                                torch.nn.functional.gelu(t.double(), approximate="tanh"))


@interpreter_only
def test_gelu_of_empty_and_bad_inputs():
    assert bias_grad.gelu(torch.zeros(0, 5)).shape == (0, 5)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        bias_grad.gelu(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        bias_grad.gelu([1.0])


@interpreter_only
def test_mlp_forward_takes_the_gelu_kernel(monkeypatch):
    """LayerNormMLP's FC1 + GELU (_LinearGelu) runs the forward kernel on the GEMM output."""
    monkeypatch.setattr(kernels, "kernels_enabled", lambda *tensors: True)
    seen = []
    real = bias_grad.gelu
    monkeypatch.setattr(bias_grad, "gelu", lambda x: seen.append(tuple(x.shape)) or real(x))
    mlp = te.LayerNormMLP(16, 32, device="cpu")
    x = torch.randn(3, 16, requires_grad=True)
    out = mlp(x)
    out.sum().backward()
    assert seen == [(3, 32)]
    with torch.no_grad():
        h = torch.nn.functional.linear(
            torch.nn.functional.layer_norm(x, (16,), mlp.layer_norm_weight, mlp.layer_norm_bias),
            mlp.fc1_weight, mlp.fc1_bias)
        ref = torch.nn.functional.linear(torch.nn.functional.gelu(h, approximate="tanh"),
                                         mlp.fc2_weight, mlp.fc2_bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
