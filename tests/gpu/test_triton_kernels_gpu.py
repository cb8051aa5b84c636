"""The Triton kernels (transformer_fa/kernels) on CUDA against the PyTorch paths they
replace, at real sizes: norms and RoPE forward and backward in fp32/bf16/fp16, the bias
gradients (column sums, GELU's backward with them) and the modules that use them, and a
TransformerLayer step with the kernels on and off (TRANSFORMER_FA_TRITON_KERNELS=0)."""
import math

import pytest
import torch

import transformer_fa as te
from transformer_fa import kernels
from transformer_fa.attention.rope import apply_rotary_pos_emb
from transformer_fa.module.layernorm import apply_norm
from test_triton_kernels import assert_as_accurate_as_torch, record_bias_grad_functions

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not kernels.triton_available(), reason="needs triton"),
]

# relative to the reference's largest magnitude: both paths compute in float32, so the
# differences are the output dtype's rounding (and float32 summation order)
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=REL_TOL[dtype],
                               atol=REL_TOL[dtype] * max(scale, 1e-6))


@pytest.fixture(autouse=True)
def norm_kernel_at_every_size(monkeypatch):
    """The kernels are checked at every size they serve; the modules prefer the norm kernel
    only from NORM_KERNEL_FASTER_FROM on (where it measured faster)."""
    monkeypatch.setattr(kernels, "prefer_fused_norm", lambda hidden: True)


def fused_and_reference(fn, inputs, grad_out, monkeypatch):
    """[out, grads...] with the kernels on, then with TRANSFORMER_FA_TRITON_KERNELS=0."""
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", setting)
        out = fn(*inputs)
        wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        results.append([out, *torch.autograd.grad(out, wrt, grad_out)])
    return results


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [768, 2048, 5120, 8192, 16384, 3000])
def test_norm_kernel(normalization, zero_centered, dtype, hidden, monkeypatch):
    rows = 4096 if hidden <= 8192 else 1024
    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = (torch.randn(rows, hidden, device="cuda", generator=g) * 3 + 1).to(dtype)
    weight = torch.randn(hidden, device="cuda", generator=g) * 0.2 + (0 if zero_centered else 1)
    bias = torch.randn(hidden, device="cuda", generator=g) if normalization == "LayerNorm" \
        else None
    x, weight = x.requires_grad_(), weight.to(dtype).requires_grad_()
    bias = bias.to(dtype).requires_grad_() if bias is not None else None
    dy = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype)
    assert kernels.use_fused_norm(x, weight, bias)
    fused, reference = fused_and_reference(
        lambda x, w, b: apply_norm(x, normalization, w, b, 1e-5, zero_centered),
        [x, weight, bias], dy, monkeypatch)
    for a, b in zip(fused, reference, strict=True):
        assert_close(a, b, dtype)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_kernel_ragged_rows_same_bits(normalization, monkeypatch):
    """The layer benchmark's width with a ragged row count (the forward's last 4-row tile and
    the backward's last chunk partly filled) against the PyTorch path, and a second run: the
    same bits (dgamma/dbeta summed in a fixed order, no atomics)."""
    rows, hidden = 8192 + 5, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(rows, hidden, device="cuda", generator=g) * 3 + 1).to(torch.bfloat16)
    weight = (torch.randn(hidden, device="cuda", generator=g) * 0.2 + 1).to(torch.bfloat16)
    bias = torch.randn(hidden, device="cuda", generator=g).to(torch.bfloat16) \
        if normalization == "LayerNorm" else None
    x, weight = x.requires_grad_(), weight.requires_grad_()
    bias = bias.requires_grad_() if bias is not None else None
    dy = torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16)
    run = lambda x, w, b: apply_norm(x, normalization, w, b, 1e-5, False)  # noqa: E731
    fused, reference = fused_and_reference(run, [x, weight, bias], dy, monkeypatch)
    again, _ = fused_and_reference(run, [x, weight, bias], dy, monkeypatch)
    for a, b, c in zip(fused, reference, again, strict=True):
        assert_close(a, b, torch.bfloat16)
        assert torch.equal(a.view(torch.int16), c.view(torch.int16))


@pytest.mark.skipif(torch.cuda.is_available()
                    and torch.cuda.get_device_properties(0).total_memory < 48 * 2**30,
                    reason="needs ~40 GiB of GPU memory")
def test_norm_kernel_offsets_past_2_31(monkeypatch):
    """rows * hidden past 2**31 elements (64-bit offsets): the last rows' y and dx against the
    PyTorch path on those rows alone, dgamma against the full PyTorch path."""
    rows, hidden = 2**20 + 3, 2048
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    y = apply_norm(x, "RMSNorm", weight, None, 1e-5, False)
    dx, dw = torch.autograd.grad(y, [x, weight], dy)
    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "0")
    tail = x.detach()[-16:].requires_grad_()
    y_ref = apply_norm(tail, "RMSNorm", weight, None, 1e-5, False)
    (dx_ref,) = torch.autograd.grad(y_ref, [tail], dy[-16:])
    assert_close(y[-16:], y_ref, torch.bfloat16)
    assert_close(dx[-16:], dx_ref, torch.bfloat16)
    del y, dx, y_ref
    dw_ref = torch.autograd.grad(apply_norm(x, "RMSNorm", weight, None, 1e-5, False), [weight],
                                 dy)[0]
    assert_close(dw, dw_ref, torch.bfloat16)


def test_norm_kernel_under_autocast(monkeypatch):
    """float32 parameters, bf16 input (torch.autocast): bf16 out, float32 gradients."""
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    norm = te.LayerNorm(2048, device="cuda")
    dy = torch.randn_like(x)

    def run(x, weight, bias):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return norm(x)

    fused, reference = fused_and_reference(run, [x, norm.weight, norm.bias], dy, monkeypatch)
    assert fused[2].dtype == torch.float32
    for a, b in zip(fused, reference, strict=True):
        assert_close(a, b, torch.bfloat16)


def _rope_inputs(tensor_format, dtype, s=4096, b=2, h=16, d=128):
    shape = {"sbhd": (s, b, h, d), "bshd": (b, s, h, d), "thd": (s * b, h, d)}[tensor_format]
    g = torch.Generator(device="cuda").manual_seed(1)
    t = torch.randn(*shape, device="cuda", generator=g).to(dtype).requires_grad_()
    return t, torch.randn(*shape, device="cuda", generator=g).to(dtype)


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rot_dim", [128, 64])
def test_rope_kernel(tensor_format, interleaved, dtype, rot_dim, monkeypatch):
    t, dy = _rope_inputs(tensor_format, dtype)
    freqs = te.RotaryPositionEmbedding(rot_dim, interleaved=interleaved)(4096)
    cu = None
    if tensor_format == "thd":  # ragged lengths, and a tail past cu_seqlens[-1]
        cu = torch.tensor([0, 1000, 1001, 4500, 8000], dtype=torch.int32, device="cuda")
    assert kernels.use_fused_rope(t, freqs)
    fused, reference = fused_and_reference(
        lambda t: apply_rotary_pos_emb(t, freqs, tensor_format, interleaved=interleaved,
                                       fused=True, cu_seqlens=cu), [t], dy, monkeypatch)
    for a, b in zip(fused, reference, strict=True):
        assert_close(a, b, dtype)


@pytest.mark.parametrize("tensor_format", ["bshd", "thd"])
def test_rope_kernel_start_positions(tensor_format, monkeypatch):
    t, dy = _rope_inputs(tensor_format, torch.bfloat16, s=1024)
    freqs = te.RotaryPositionEmbedding(128)(8192)
    cu = torch.tensor([0, 500, 2048], dtype=torch.int32, device="cuda")
    starts = torch.tensor([7, 3000], device="cuda")
    fused, reference = fused_and_reference(
        lambda t: apply_rotary_pos_emb(t, freqs, tensor_format, start_positions=starts,
                                       fused=True, cu_seqlens=cu), [t], dy, monkeypatch)
    for a, b in zip(fused, reference, strict=True):
        assert_close(a, b, torch.bfloat16)


@pytest.fixture
def functions_called(monkeypatch):
    return record_bias_grad_functions(monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(8192, 2048), (8192, 6144), (8192, 8192), (8191, 3000),
                                   (1, 4096), (100000, 64)])
def test_column_sum_kernel(dtype, shape):
    """g.sum(0) as accurate as torch's (tests/test_triton_kernels.py states the rule), and the
    same bits on a second call (no atomics)."""
    from transformer_fa.kernels.bias_grad import column_sum

    g = torch.Generator(device="cuda").manual_seed(shape[1])
    x = (torch.randn(*shape, device="cuda", generator=g) * 2 + 0.3).to(dtype)
    got = column_sum(x)
    assert_as_accurate_as_torch(got, x.sum(0), x.double().sum(0))
    assert torch.equal(column_sum(x), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(8192, 2048), (8192, 8192), (8191, 3000)])
def test_dgelu_column_sum_kernel(dtype, shape):
    """dh against torch's gelu_backward (tanh) and db against the sum of it, both as accurate
    as torch's against float64; the same bits on a second call."""
    from transformer_fa.kernels.bias_grad import dgelu_column_sum

    g = torch.Generator(device="cuda").manual_seed(shape[1])
    dy = torch.randn(*shape, device="cuda", generator=g).to(dtype)
    h = (torch.randn(*shape, device="cuda", generator=g) * 3).to(dtype)
    dh, db = dgelu_column_sum(dy, h)
    reference = torch.ops.aten.gelu_backward(dy, h, approximate="tanh")
    exact = torch.ops.aten.gelu_backward(dy.double(), h.double(), approximate="tanh")
    assert_as_accurate_as_torch(dh, reference, exact)
    assert_as_accurate_as_torch(db, reference.sum(0), exact.sum(0))
    again = dgelu_column_sum(dy, h)
    assert torch.equal(again[0], dh) and torch.equal(again[1], db)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("block_r,num_warps,programs_per_sm", [(32, 4, 2), (64, 8, 8)])
@pytest.mark.parametrize("shape", [(8191, 3000), (8192, 2048), (517, 64)])
def test_column_sums_at_every_pipelined_setting(stages, block_r, num_warps, programs_per_sm,
                                                shape):
    """The row loop pipelined at each stage count (chunks ending inside a row block, one
    block a chunk): the sums and dgelu as accurate as torch's, as at the default setting."""
    from transformer_fa.kernels import bias_grad

    tiles = bias_grad.TILES._replace(block_r={2: block_r, 4: block_r // 2}, num_warps=num_warps,
                                     stages=stages, programs_per_sm=programs_per_sm)
    g = torch.Generator(device="cuda").manual_seed(shape[1])
    dy = torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)
    h = (torch.randn(*shape, device="cuda", generator=g) * 3).to(torch.bfloat16)
    _, sums = bias_grad._column_sums(dy, None, dy.dtype, tiles)
    assert_as_accurate_as_torch(sums, dy.sum(0), dy.double().sum(0))
    dh, db = bias_grad._column_sums(dy, h, h.dtype, tiles)
    reference = torch.ops.aten.gelu_backward(dy, h, approximate="tanh")
    exact = torch.ops.aten.gelu_backward(dy.double(), h.double(), approximate="tanh")
    assert_as_accurate_as_torch(dh, reference, exact)
    assert_as_accurate_as_torch(db, reference.sum(0), exact.sum(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(8192, 8192), (8191, 3000), (3, 5)])
def test_gelu_kernel(dtype, shape):
    """The MLP's GELU forward against torch's (tanh), both against float64: as accurate as
    torch's (the ragged last program included)."""
    from transformer_fa.kernels.bias_grad import gelu

    g = torch.Generator(device="cuda").manual_seed(shape[1])
    h = (torch.randn(*shape, device="cuda", generator=g) * 3).to(dtype)
    assert_as_accurate_as_torch(gelu(h), torch.nn.functional.gelu(h, approximate="tanh"),
                                torch.nn.functional.gelu(h.double(), approximate="tanh"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("module_name", ["Linear", "LayerNormMLP", "LayerNormMLP-checkpoint"])
def test_modules_through_bias_grad_functions(dtype, module_name, functions_called, monkeypatch):
    """Outputs and gradients (input, weights, biases) with the bias-gradient Functions
    against the PyTorch path; a 3D input, frozen norm parameters."""
    torch.manual_seed(0)
    kwargs = dict(params_dtype=dtype, device="cuda")
    module = {
        "Linear": lambda: te.Linear(1024, 3072, **kwargs),
        "LayerNormMLP": lambda: te.LayerNormMLP(1024, 4096, **kwargs),
        "LayerNormMLP-checkpoint": lambda: te.LayerNormMLP(1024, 4096, checkpoint=True,
                                                           **kwargs),
    }[module_name]()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.add_(torch.randn_like(p) * 0.1)
            p.requires_grad_("layer_norm" not in name)
    x = torch.randn(1024, 4, 1024, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(1024, 4, 1024 if "MLP" in module_name else 3072, device="cuda",
                     dtype=dtype)
    params = [x, *module.parameters()]
    fused, reference = fused_and_reference(lambda *p: module(x), params, dy, monkeypatch)
    assert functions_called == (["linear"] if module_name == "Linear" else
                               ["gelu", "linear"] * (2 if "checkpoint" in module_name else 1))
    for a, b in zip(fused, reference, strict=True):
        assert_close(a, b, dtype)


def _bias_grad_ops(prof, tokens, widths):
    """aten::sum calls over a [tokens, width] gradient (bias gradients), aten::gelu_backward
    calls, GELU-backward GPU kernels, and launches of the column-sum kernel."""
    events = list(prof.events())
    sums = [e for e in events if e.name == "aten::sum" and e.input_shapes
            and e.input_shapes[0] and e.input_shapes[0][-1] in widths
            and math.prod(e.input_shapes[0][:-1]) == tokens]
    on_gpu = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return (len(sums), sum(e.name == "aten::gelu_backward" for e in events),
            sum("gelubackward" in name.lower().replace("_", "") for name in on_gpu),
            sum("_partial_column_sums_kernel" in name for name in on_gpu))


def test_transformer_layer_backward_launches_no_bias_sums(monkeypatch):
    """With the kernels, a TransformerLayer backward sums no bias gradient with aten::sum and
    runs no gelu_backward: its 4 bias gradients (qkv, proj, fc1 with GELU's backward, fc2)
    are the column-sum kernel's. Without them (so the check can fail): the 4 sums and the
    GELU backward. (2048 tokens: no aten::sum of another shape can pass for a bias sum.)"""
    torch.manual_seed(0)
    s, b, hidden, ffn = 1024, 2, 1024, 4096
    layer = te.TransformerLayer(hidden, ffn, 16, hidden_dropout=0.0, attention_dropout=0.0,
                                params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(s, b, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    counts = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", setting)
        layer(x).backward(dy)  # compiles the kernels
        out = layer(x)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            out.backward(dy)
            torch.cuda.synchronize()
        counts[setting] = _bias_grad_ops(prof, s * b, {3 * hidden, hidden, ffn})
    assert counts["1"] == (0, 0, 0, 4), counts
    sums, gelu_ops, gelu_kernels, column_sums = counts["0"]
    assert sums >= 4 and gelu_ops >= 1 and gelu_kernels >= 1 and column_sums == 0, counts


@pytest.mark.parametrize("config", [
    dict(normalization="LayerNorm"),
    dict(normalization="RMSNorm", activation="swiglu", zero_centered_gamma=True),
])
def test_transformer_layer_with_kernels_matches_pytorch_path(config, functions_called,
                                                             monkeypatch):
    """A bf16 TransformerLayer forward + backward (with RoPE), kernels on against off; the
    bias gradients through the column-sum Functions (fc1 + GELU as one)."""
    torch.manual_seed(0)
    layer = te.TransformerLayer(1024, 4096, 16, hidden_dropout=0.0, attention_dropout=0.0,
                                params_dtype=torch.bfloat16, device="cuda", **config)
    with torch.no_grad():  # non-trivial norm parameters
        for name, p in layer.named_parameters():
            if "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    freqs = te.RotaryPositionEmbedding(64)(512)
    x = torch.randn(512, 2, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    params = [x, *layer.parameters()]
    calls = []
    from transformer_fa.kernels import norm as norm_kernels
    for function in (norm_kernels.FusedNormPassingInput, norm_kernels.FusedAddNorm):
        original = function.apply
        monkeypatch.setattr(function, "apply", lambda *a, name=function.__name__,
                            original=original: calls.append(name) or original(*a))
    fused, reference = fused_and_reference(lambda *p: layer(x, rotary_pos_emb=freqs), params,
                                           dy, monkeypatch)
    # (the attention's norm handing the input on as the residual, whose gradient its backward
    # adds: FusedNormPassingInput; the MLP's norm with the residual add before it: FusedAddNorm)
    assert calls == ["FusedNormPassingInput", "FusedAddNorm"], \
        "the layer's norms did not take the kernels"
    gelu = config.get("activation", "gelu") == "gelu"
    assert functions_called == ["linear", "linear"] + (["gelu"] if gelu else ["linear"]) \
        + ["linear"]
    for a, b in zip(fused, reference, strict=True):
        assert_close(a, b, torch.bfloat16)

