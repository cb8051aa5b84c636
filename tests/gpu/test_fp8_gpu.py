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
        with te.autocast(recipe=recipe):
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


# The Triton FP8 casts (transformer_fa/kernels/fp8_cast.py) against the PyTorch path
# (TRANSFORMER_FA_TRITON_KERNELS=0), bit for bit. NaNs compare by position: the GPU's cvt
# may drop a NaN's sign, which torch's conversion keeps.
from test_fp8_bias_grad import assert_bias_grad_close  # noqa: E402 (tests/ is on sys.path)
from transformer_fa import fp8, kernels  # noqa: E402
from transformer_fa.common.recipe import Format  # noqa: E402

needs_cast_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() and kernels.triton_available()),
    reason="needs CUDA and triton")
FP8_MAX = {Format.E4M3: 448.0, Format.E5M2: 57344.0}


def _cuda_cast_built():
    from transformer_fa.attention.backends import flash
    ext = flash._extension() if flash.is_built() else None
    if ext is None or not hasattr(ext, "fp8_cast_transpose"):
        return False
    major, minor = torch.cuda.get_device_capability()
    return 10 * major + minor in ext.FP8_CAST_ARCHS


@pytest.fixture(params=["cuda", "triton"])
def cast_impl(request, monkeypatch):
    """Each cast test twice: with the CUDA cast-transpose kernel (csrc/fp8/) serving the calls
    it serves (16-bit, transposed output, rows % 16, cols % 8; skipped where the extension
    lacks it), and with every call on the Triton kernel."""
    if request.param == "triton":
        monkeypatch.setenv("TRANSFORMER_FA_FP8_CAST", "triton")
    elif not _cuda_cast_built():
        pytest.skip("the CUDA extension has no FP8 cast kernel for this GPU")
    else:
        monkeypatch.delenv("TRANSFORMER_FA_FP8_CAST", raising=False)
    return request.param


@pytest.fixture
def cast_calls(monkeypatch, cast_impl):
    """The cast kernel's calls, so that a test sees the kernel path ran (in each of
    cast_impl's settings)."""
    from transformer_fa.kernels import fp8_cast
    calls = []
    real = fp8_cast.cast
    monkeypatch.setattr(fp8_cast, "cast", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@needs_cast_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gelu, dgelu, dbias", [(False, False, False), (True, False, False),
                                                (False, True, True), (False, False, True)])
def test_cuda_cast_serves_the_transposed_16bit_casts(dtype, gelu, dgelu, dbias, monkeypatch):
    """Where the CUDA kernel is built, it (not Triton) runs the 16-bit casts with a transposed
    output, and its results are the Triton kernel's: the FP8 bytes of plain casts bit for bit
    (the transpose the row-major cast's), of GELU / dgelu casts within one FP8 step at under
    1% of the elements (the two compute the activation with different float32 instructions),
    the amax within 1e-6, the column sums within a rounding of x's dtype; the amax pass
    (fold_amax) on the CUDA kernel too, equal to the cast's amax."""
    if not _cuda_cast_built():
        pytest.skip("the CUDA extension has no FP8 cast kernel for this GPU")
    from transformer_fa.kernels import fp8_cast
    served = []
    real = fp8_cast._cuda_cast_transpose
    monkeypatch.setattr(fp8_cast, "_cuda_cast_transpose",
                        lambda *a: served.append(real(*a)) or served[-1])
    x = _fp8_input((1040, 264), dtype)  # ragged last tiles in both directions
    x = torch.nan_to_num(x.float(), nan=1.0, posinf=2e3, neginf=-7.0).to(dtype) / 64
    h = torch.randn_like(x) * 3 if dgelu else None
    fp8_dtype = torch.float8_e5m2 if dbias else torch.float8_e4m3fn
    fp8_max = torch.finfo(fp8_dtype).max
    results = []
    for setting in ("", "triton"):
        monkeypatch.setenv("TRANSFORMER_FA_FP8_CAST", setting)
        amax = torch.zeros(1, device="cuda")
        scale = torch.tensor(3.0, device="cuda")
        results.append((*fp8_cast.cast(x, scale, fp8_dtype, fp8_max, rowwise=True,
                                       columnwise=True, amax=amax, dbias=dbias, gelu=gelu,
                                       dgelu_input=h), amax))
    assert served[0] is not None and served[1] is None
    (out, out_t, inv, sums, amax), (t_out, t_out_t, t_inv, t_sums, t_amax) = results
    _assert_same_floats(inv, t_inv)
    if gelu or dgelu:
        for a, b in ((out, t_out), (out_t, t_out_t)):
            # (+0 and -0 are one value: where gelu'(h) is about 0 the two round a product
            # of about 1e-9 to zeros of either sign)
            steps = (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()
            steps[a.float() == b.float()] = 0
            assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01
        torch.testing.assert_close(amax, t_amax, rtol=1e-6, atol=0)
    else:
        _assert_same_fp8(out, t_out)
        _assert_same_fp8(out_t, t_out_t)
        _assert_same_floats(amax, t_amax)
        _assert_same_fp8(out_t, out.t().contiguous())
    if dbias:
        # both sum the float32 values in their own order and round once to x's dtype
        y = x.float() if h is None else torch.ops.aten.gelu_backward(
            x.float(), h.float(), approximate="tanh")
        bound = 2 * torch.finfo(dtype).eps * y.sum(0).abs() + 1e-5 * y.abs().sum(0)
        assert sums.dtype == dtype and ((sums.float() - t_sums.float()).abs() <= bound).all()
    # current scaling's amax pass: the CUDA kernel's (fp8_amax) against Triton's
    monkeypatch.setenv("TRANSFORMER_FA_FP8_CAST", "")
    assert fp8_cast._cuda_fp8_kernel("fp8_amax", x, h) is not None
    amaxes = []
    for setting in ("", "triton"):
        monkeypatch.setenv("TRANSFORMER_FA_FP8_CAST", setting)
        amaxes.append(torch.full((1,), 0.5, device="cuda"))
        fp8_cast.fold_amax(x, amaxes[-1], gelu=gelu, dgelu_input=h)
    torch.testing.assert_close(amaxes[0], amaxes[1], rtol=1e-6 if gelu or dgelu else 0, atol=0)
    torch.testing.assert_close(amaxes[0], amax, rtol=0, atol=0)  # the cast's own amax


def _fp8_input(shape, dtype, seed=0):
    """Values across FP8's range (subnormals too) and past its max, zeros, -0, +-inf, NaN."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, generator=g, device="cuda")
    x *= torch.logspace(-6, 3, shape[-1], device="cuda")
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, 1e5, -1e5, float("inf"), float("-inf"), float("nan")],
                            device="cuda")
    n = min(flat.numel(), specials.numel())
    flat[torch.randperm(flat.numel(), generator=g, device="cuda")[:n]] = specials[:n]
    return x.to(dtype)


def _assert_same_fp8(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous() and b.is_contiguous()
    nan = a.float().isnan()
    assert torch.equal(nan, b.float().isnan())
    assert torch.equal(a.view(torch.uint8)[~nan], b.view(torch.uint8)[~nan])


def _assert_same_floats(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _quantize_with_and_without_kernels(monkeypatch, x, fmt, recipe, scales=None,
                                       **orientations):
    """(FP8, transpose, inverse scale, history) of slot 1, with the kernels and without;
    with dbias=True (FP8, transpose, inverse scale, column sums, history)."""
    history = torch.tensor([[2.0, 3.0, 4.0], [5.0, 6.0, 7.0]], device="cuda")
    if scales is None:
        scales = torch.tensor([0.5, 0.375, 2.0], device="cuda")
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", setting)
        state = history.clone(), scales.clone()
        results.append((*fp8._quantize(x, fmt, FP8_MAX[fmt], recipe, *state, 1,
                                       **orientations), state[0]))
    return results


def _assert_same_casts(got, want, rowwise, columnwise):
    """_quantize_with_and_without_kernels' two results: the casts asked for bit for bit (the
    others None), the inverse scale and the amax history (the last item) too."""
    for a, b, asked in zip(got[:2], want[:2], (rowwise, columnwise)):
        if asked:
            _assert_same_fp8(a, b)
        else:
            assert a is None and b is None
    _assert_same_floats(got[2], want[2])  # inverse scale
    _assert_same_floats(got[-1], want[-1])  # amax history


@needs_cast_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2])
@pytest.mark.parametrize("shape", [(1, 16), (1000, 3000), (4096, 1024)])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("finite", [True, False], ids=["finite", "inf-nan"])
def test_cast_kernel_matches_pytorch_bitwise(dtype, fmt, shape, recipe, finite, monkeypatch,
                                             cast_calls):
    """Row-major cast, transpose, inverse scale and the amax history, for each orientation
    asked for; 1000 x 3000 leaves every tile edge ragged."""
    x = _fp8_input(shape, dtype)
    if finite:
        x = torch.nan_to_num(x.float(), nan=1.0, posinf=2e3, neginf=-7.0).to(dtype)
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        cast_calls.clear()
        got, want = _quantize_with_and_without_kernels(monkeypatch, x, fmt, recipe,
                                                       rowwise=rowwise, columnwise=columnwise)
        assert len(cast_calls) == 1  # the kernels ran (once), the reference did not
        _assert_same_casts(got, want, rowwise, columnwise)
    if finite and isinstance(recipe, DelayedScaling):
        assert got[3][0, 1] == x.float().abs().max()


@needs_cast_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (37, 45), (1000, 3000), (4096, 1024),
                                   (16400, 200)])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("finite", [True, False], ids=["finite", "inf-nan"])
def test_cast_kernel_column_sums(dtype, shape, recipe, finite, monkeypatch, cast_calls):
    """The cast's column sums (dbias, a Linear's bias gradient) in every orientation and
    alone: the casts, inverse scale and amax history bit for bit with the PyTorch path (the
    sums change nothing else; float32 with both orientations: the two-launch case), the sums
    as torch's ``x.sum(0)`` up to summation order (test_fp8_bias_grad's rule), in x's dtype,
    the same bits on a second run (no atomics). 37 x 45 and 1000 x 3000 leave the tiles
    ragged in both directions; 16400 rows make 129 row blocks, three steps of the second
    pass."""
    x = _fp8_input(shape, dtype)
    if finite:
        x = torch.nan_to_num(x.float(), nan=1.0, posinf=2e3, neginf=-7.0).to(dtype)
    for rowwise, columnwise in ((True, True), (True, False), (False, True), (False, False)):
        cast_calls.clear()
        got, want = _quantize_with_and_without_kernels(monkeypatch, x, Format.E5M2, recipe,
                                                       rowwise=rowwise, columnwise=columnwise,
                                                       dbias=True)
        assert len(cast_calls) == 1  # the kernels ran (once), the reference did not
        _assert_same_casts(got, want, rowwise, columnwise)
        _assert_same_floats(want[3], x.sum(0))  # the PyTorch path: torch's sum
        assert got[3].dtype == dtype and got[3].shape == (shape[1],)
        assert_bias_grad_close(got[3], x)
        again, _ = _quantize_with_and_without_kernels(monkeypatch, x, Format.E5M2, recipe,
                                                      rowwise=rowwise, columnwise=columnwise,
                                                      dbias=True)
        assert torch.equal(again[3].view(torch.uint8), got[3].view(torch.uint8))


@needs_cast_kernels
@pytest.mark.skipif(not te.is_fp8_available(), reason="needs CUDA with FP8")
@pytest.mark.parametrize("recipe, casts", [(DelayedScaling(), 1), (Float8CurrentScaling(), 2)],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("frozen", [False, True], ids=["all-grads", "bias-grad-only"])
def test_fp8_linear_backward_sums_the_bias_in_the_cast(recipe, casts, frozen, monkeypatch,
                                                       cast_impl):
    """The backward of an FP8 Linear with a bias launches no torch sum: the output gradient's
    cast gives the bias gradient (the cast and its second pass; current scaling: the amax
    pass too). With the weight frozen and an input without grad, the cast gives it alone."""
    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "1")
    torch.manual_seed(0)
    lin = te.Linear(1024, 768, params_dtype=torch.bfloat16, device="cuda")
    lin.weight.requires_grad_(not frozen)
    x = torch.randn(4, 256, 1024, device="cuda", dtype=torch.bfloat16,
                    requires_grad=not frozen)
    dy = torch.randn(4, 256, 768, device="cuda", dtype=torch.bfloat16)

    def forward():
        with te.autocast(recipe=recipe):
            return lin(x)

    forward().backward(dy)  # compiles the kernels
    x.grad = None
    lin.zero_grad(set_to_none=True)
    out = forward()
    backward = _gpu_kernels(lambda: out.backward(dy))
    flat_dy = dy.reshape(-1, 768)
    flat_dy.sum(0)
    torch_sum = set(_gpu_kernels(lambda: flat_dy.sum(0)))  # the kernel the old backward ran
    assert torch_sum and not torch_sum.intersection(backward), backward
    assert sum(_SUM_PASS in name for name in backward) == 1, backward
    assert sum(_is_cast_launch(name) for name in backward) == casts, backward
    assert_bias_grad_close(lin.bias.grad, dy)
    assert (x.grad is None) == frozen and (lin.weight.grad is None) == frozen


def _assert_same_scalar(a, b):
    """0-dim float32 tensors with equal bits (NaNs: both NaN)."""
    assert a.shape == b.shape == () and a.dtype == b.dtype == torch.float32
    assert torch.equal(a.view(torch.int32), b.view(torch.int32)) or (a.isnan() and b.isnan())


def _amaxes_across_float32():
    """Amaxes from float32's least subnormal past its max (inf), each with a random mantissa,
    those around fp8_max / float32's max (where the scale's quotient starts to overflow), 0
    and NaN."""
    g = torch.Generator(device="cuda").manual_seed(0)
    spread = torch.logspace(-45, 38.6, 400, device="cuda")
    spread *= 1 + torch.rand(400, generator=g, device="cuda")
    fp32 = torch.finfo(torch.float32)
    edges = torch.tensor([fp8_max / fp32.max for fp8_max in FP8_MAX.values()], device="cuda")
    edges = (edges[:, None] * (1 + fp32.eps * torch.arange(-3.0, 4.0, device="cuda"))).flatten()
    specials = torch.tensor([0.0, float("nan"), fp32.smallest_normal], device="cuda")
    return torch.cat([spread, edges, specials])


@needs_cast_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2])
def test_current_scale_and_inverse_scale_over_float32s_range(dtype, fmt, monkeypatch,
                                                            cast_calls):
    """The cast kernel's scale from the amax (libdevice's div_rn) and its inverse scale, bit
    for bit with compute_scale and reciprocal, for amaxes across float32's range: any
    1-ulp difference in a division shows in the inverse scale."""
    amaxes = _amaxes_across_float32()
    for amax in amaxes:
        x = torch.full((16, 48), 0.5, device="cuda") * amax
        x[3, 5] = -amax
        x = x.to(dtype)
        got, want = _quantize_with_and_without_kernels(monkeypatch, x, fmt,
                                                       Float8CurrentScaling())
        _assert_same_scalar(got[2], want[2])
        _assert_same_fp8(got[0], want[0])
    assert len(cast_calls) == len(amaxes)


@needs_cast_kernels
@pytest.mark.parametrize("columnwise", [False, True])
def test_delayed_inverse_scale_over_float32s_range(columnwise, monkeypatch, cast_calls):
    """The inverse of the stored scale, written by the cast kernel, bit for bit with
    reciprocal: scales across float32's range (subnormals: inverse inf), 0, -0, inf, NaN."""
    x = _fp8_input((64, 96), torch.bfloat16)
    scales = torch.cat([_amaxes_across_float32(),
                        torch.tensor([-0.0, float("inf"), 1.0], device="cuda")])
    for scale in scales:
        got, want = _quantize_with_and_without_kernels(
            monkeypatch, x, Format.E4M3, DelayedScaling(), torch.stack([scale, scale, scale]),
            columnwise=columnwise)
        _assert_same_scalar(got[2], want[2])
        _assert_same_fp8(got[0], want[0])
        _assert_same_floats(got[3], want[3])
    assert len(cast_calls) == len(scales)


def _is_cast_launch(name):
    """A launch of an FP8 cast or amax pass: Triton's _cast_kernel, or csrc/fp8's kernels
    (transformer_fa::fp8::cast_transpose_kernel, amax_kernel)."""
    return "_cast_kernel" in name or "transformer_fa::fp8::" in name


def _gpu_kernels(fn):
    """The names of the GPU kernels fn() launches (run it once before: compiles)."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


_SUM_PASS = "_sum_row_blocks_kernel"  # the column sums' second pass (fp8_cast.py)


@needs_cast_kernels
@pytest.mark.parametrize("dbias", [False, True], ids=["cast", "cast-dbias"])
@pytest.mark.parametrize("recipe, launches", [(DelayedScaling(), ["cast"]),
                                              (Float8CurrentScaling(),
                                               ["fill", "cast", "cast"])],
                         ids=["delayed", "current"])
def test_quantize_kernel_launches(recipe, launches, dbias, monkeypatch, cast_impl):
    """GPU kernels per quantization (bfloat16, with the transpose): delayed scaling the cast
    alone (it writes the inverse scale); current scaling the amax's zero fill, the amax pass
    and the cast (which computes the scale from the amax); the column sums add their second
    pass, nothing else."""
    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "1")
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    history, scales = torch.zeros(1, 2, device="cuda"), torch.ones(2, device="cuda")

    def quantize():
        return fp8._quantize(x, Format.E4M3, 448.0, recipe, history, scales, 1,
                             columnwise=True, dbias=dbias)

    quantize()  # compiles the kernels
    on_gpu = _gpu_kernels(quantize)
    # the amax's zero fill: torch's FillFunctor kernel
    kinds = ["cast" if _is_cast_launch(name) else _SUM_PASS if _SUM_PASS in name
             else "fill" if "fill" in name.lower() else name for name in on_gpu]
    assert sorted(kinds) == sorted(launches + [_SUM_PASS] * dbias), on_gpu


@needs_cast_kernels
@pytest.mark.parametrize("dbias", [False, True], ids=["cast", "cast-dbias"])
def test_cast_kernel_reads_strided_inputs(dbias, monkeypatch, cast_calls):
    """Transposed and sliced views and a broadcast (stride-0) gradient, read in place (and
    their column sums)."""
    base = _fp8_input((1024, 768), torch.bfloat16).nan_to_num(0.0, 0.0, 0.0)
    views = (base.t(), base[:, 3:700:2], torch.full((1, 512), 3.0, device="cuda",
                                                    dtype=torch.bfloat16).expand(256, 512))
    for x in views:
        got, want = _quantize_with_and_without_kernels(
            monkeypatch, x, Format.E5M2, Float8CurrentScaling(), rowwise=True, columnwise=True,
            dbias=dbias)
        _assert_same_fp8(got[0], want[0])
        _assert_same_fp8(got[1], want[1])
        if dbias:
            assert_bias_grad_close(got[3], x)
    assert len(cast_calls) == len(views)


@needs_cast_kernels
def test_cast_kernel_in_a_cuda_graph(monkeypatch):
    """The kernels read the scale on the device: a captured cast follows new inputs and
    scales on replay (delayed scaling: the amax history too; and the column sums)."""
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    history = torch.zeros(1, 2, device="cuda")
    scales = torch.full((2,), 4.0, device="cuda")

    def cast():
        return fp8._quantize(x, Format.E4M3, 448.0, DelayedScaling(), history, scales, 1,
                             columnwise=True, dbias=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cast()  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cast()
    x.copy_(torch.randn_like(x) * 10)
    scales.fill_(2.0)
    history.zero_()
    graph.replay()
    torch.cuda.synchronize()
    replayed_history = history.clone()
    history.zero_()
    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "0")
    want = cast()
    _assert_same_fp8(captured[0], want[0])
    _assert_same_fp8(captured[1], want[1])
    _assert_same_floats(captured[2], want[2])
    _assert_same_floats(replayed_history, history)
    assert replayed_history[0, 1] == x.float().abs().max()
    assert_bias_grad_close(captured[3], x)


@needs_cast_kernels
@pytest.mark.skipif(not te.is_fp8_available(), reason="needs CUDA with FP8")
@pytest.mark.parametrize("params_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4),
                                    DelayedScaling(fp8_format=Format.E4M3),
                                    Float8CurrentScaling()],
                         ids=["delayed-hybrid", "delayed-e4m3", "current"])
def test_fp8_gemm_kernels_match_pytorch(params_dtype, recipe, monkeypatch, cast_calls):
    """Linear in FP8, three steps of forward and backward (and a frozen-weight and a
    no-input-grad step), with the kernels and with TRANSFORMER_FA_TRITON_KERNELS=0: equal
    outputs, input and weight gradients, amax histories and scales, bit for bit; the bias
    gradients (16-bit: the cast kernel's column sums, else torch's sum) by the
    summation-order rule."""
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", setting)
        torch.manual_seed(0)
        lin = te.Linear(1024, 768, params_dtype=params_dtype, device="cuda")
        got = []
        for step in range(5):
            lin.weight.requires_grad_(step != 3)
            x = (torch.randn(3, 256, 1024, device="cuda") * 4).to(params_dtype)
            x.requires_grad_(step != 4)
            with te.autocast(recipe=recipe):
                out = lin(x)
            dy = torch.randn_like(out)
            out.backward(dy)
            got += [out, x.grad, lin.weight.grad]
            assert_bias_grad_close(lin.bias.grad, dy)
            lin.zero_grad(set_to_none=True)
        meta = lin.fp8_meta
        got += [meta.amax_history_fwd, meta.scale_fwd, meta.amax_history_bwd, meta.scale_bwd]
        results.append(got)
    assert cast_calls  # the kernel path ran
    for a, b in zip(*results, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


# The delayed-scaling update kernel (transformer_fa/kernels/fp8_scale.py) against the PyTorch
# code, bit for bit (IEEE divisions, NaN-propagating max, in-place roll of strided views).
def _amax_history_cuda(history_len, n_cols, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    history = (torch.rand(history_len, n_cols, generator=g, device="cuda")
               * torch.logspace(-30, 30, n_cols, device="cuda"))
    for col, value in {0: float("nan"), 1: float("inf"), 3: 1e-45}.items():
        if col < n_cols:
            history[min(history_len - 1, 2 + col), col] = value
    if n_cols > 2:
        history[:, 2] = 0.0
    if n_cols > 4:
        history[0, 4] = float("nan")
    scale = torch.rand(n_cols, generator=g, device="cuda") + 0.5
    scale[-2:] = torch.tensor([float("inf"), float("nan")], device="cuda")[-n_cols:]
    return history, scale


def _update_with_and_without_kernel(monkeypatch, history, scale, recipe, fp8_max,
                                    views=lambda h, s: (h, s)):
    from transformer_fa.kernels import fp8_scale
    calls = []
    real = fp8_scale.update_delayed_scaling
    monkeypatch.setattr(fp8_scale, "update_delayed_scaling",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", setting)
        h, s = history.clone(), scale.clone()
        fp8.update_amax_history(*views(h, s), fp8_max, recipe)
        results.append((h, s))
    assert len(calls) == 1  # the kernel ran once, the reference without it
    return results


def _assert_same_words(a, b):
    assert a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@needs_cast_kernels
@pytest.mark.parametrize("history_len, n_cols", [(1, 3), (5, 7), (1024, 4), (1024, 2),
                                                 (1031, 37), (5000, 3)])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("fp8_max", [448.0, 57344.0])
def test_delayed_scale_update_kernel_matches_pytorch(history_len, n_cols, algo, margin,
                                                     fp8_max, monkeypatch):
    history, scale = _amax_history_cuda(history_len, n_cols)
    recipe = DelayedScaling(amax_history_len=history_len, amax_compute_algo=algo,
                            margin=margin)
    (got_h, got_s), (want_h, want_s) = _update_with_and_without_kernel(
        monkeypatch, history, scale, recipe, fp8_max)
    _assert_same_words(got_s, want_s)
    _assert_same_words(got_h, want_h)


@needs_cast_kernels
@pytest.mark.parametrize("margin", [8, 20])
def test_delayed_scale_update_kernel_subnormal_scales(margin, monkeypatch):
    """Amaxes near float32's max with a margin: scales in float32's subnormals (Triton's
    libdevice flushes them to 0 unless launched with enable_reflect_ftz=False)."""
    fp32_max = torch.finfo(torch.float32).max
    history = torch.tensor([[1e37, 1e38, 3e38, fp32_max]], device="cuda")
    scale = torch.ones(4, device="cuda")
    (_, got_s), (_, want_s) = _update_with_and_without_kernel(
        monkeypatch, history, scale, DelayedScaling(amax_history_len=1, margin=margin), 448.0)
    assert (want_s < torch.finfo(torch.float32).smallest_normal).any()
    _assert_same_words(got_s, want_s)


@needs_cast_kernels
def test_delayed_scale_update_kernel_of_strided_views(monkeypatch):
    """The backward's per-GEMM column of a history and slice of the scales, in place."""
    history, scale = _amax_history_cuda(1024, 6)
    recipe = DelayedScaling()
    for gemm in (0, 4, 5):
        (got_h, got_s), (want_h, want_s) = _update_with_and_without_kernel(
            monkeypatch, history, scale, recipe, 57344.0,
            lambda h, s: (h[:, gemm:gemm + 1], s[gemm:gemm + 1]))
        _assert_same_words(got_h, want_h)
        _assert_same_words(got_s, want_s)


@pytest.mark.parametrize("params_dtype", [torch.bfloat16, torch.float16])
def test_bias_in_the_fp8_gemm_epilogue_on_cuda(params_dtype, monkeypatch):
    """torch._scaled_mm adds the 16-bit bias in its epilogue: the output within one rounding
    of the separate add, the input and weight gradients equal, the bias's (a sum over the
    tokens either way: the cast kernel's column sums or torch's sum) by the summation-order
    rule."""
    x = torch.randn(4, 64, 256, device="cuda").to(params_dtype)
    dy = torch.randn(4, 64, 512, device="cuda").to(params_dtype)
    results = []
    for epilogue in (True, False):
        if not epilogue:
            monkeypatch.setattr(fp8, "_bias_fits_epilogue", lambda *a: False)
        torch.manual_seed(0)
        lin = te.Linear(256, 512, params_dtype=params_dtype, device="cuda")
        with torch.no_grad():
            lin.bias.normal_(0, 3)
        for _ in range(2):
            inp = x.clone().requires_grad_()
            with te.autocast(recipe=DelayedScaling()):
                out = lin(inp)
            out.backward(dy)
        results.append((out, inp.grad, lin.weight.grad, lin.bias.grad))
    (out, *grads), (want, *want_grads) = results
    eps = torch.finfo(params_dtype).eps
    torch.testing.assert_close(out.float(), want.float(), rtol=eps, atol=eps)
    assert torch.equal(grads[0], want_grads[0]) and torch.equal(grads[1], want_grads[1])
    for bias_grad in (grads[2], want_grads[2]):  # two steps: twice the sums (exactly)
        assert_bias_grad_close(bias_grad / 2, dy)


# The grouped update (fp8_scale.update_delayed_scalings: many pairs in one launch) against
# the per-history kernel and the PyTorch code, at a model's sizes.
def _gpu_pairs(history_len, seed=0):
    """24 modules' state as fp8.py updates it (forward [L, 2] and [L, 4] histories, backward
    column views of one [L, 2] history and slices of its scales), a wide transposed history
    with strided scales and amaxes near float32's max (with a margin: subnormal scales), all
    with _amax_history_cuda's special amaxes. The same seed gives an equal, separate set."""
    pairs = []
    for module in range(24):
        width = 4 if module % 3 == 2 else 2
        pairs.append(_amax_history_cuda(history_len, width, seed + module))
        history, scale = _amax_history_cuda(history_len, 2, seed + 100 + module)
        pairs += [(history[:, g:g + 1], scale[g:g + 1]) for g in range(2)]
    wide, wide_scale = _amax_history_cuda(history_len, 37, seed + 200)
    strided = torch.ones(74, device="cuda")
    strided[::2] = wide_scale
    pairs.append((wide.t().contiguous().t(), strided[::2]))
    near_max = torch.zeros(history_len, 4, device="cuda")
    near_max[0] = torch.tensor([1e37, 1e38, 3e38, torch.finfo(torch.float32).max])
    pairs.append((near_max, torch.ones(4, device="cuda")))
    return pairs


@needs_cast_kernels
@pytest.mark.parametrize("history_len", [1, 16, 1024, 1031])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin, fp8_max", [(0, 448.0), (3, 57344.0), (20, 448.0)])
def test_grouped_scale_update_kernel_matches_per_history(history_len, algo, margin, fp8_max,
                                                         monkeypatch):
    from transformer_fa.kernels import fp8_scale
    most_recent = algo == "most_recent"
    grouped, per_history, reference = (_gpu_pairs(history_len) for _ in range(3))
    fp8_scale.update_delayed_scalings(grouped, fp8_max, margin, most_recent)
    for history, scale in per_history:
        fp8_scale.update_delayed_scaling(history, scale, fp8_max, margin, most_recent)
    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "0")
    fp8.update_amax_histories(reference, fp8_max, DelayedScaling(
        amax_history_len=history_len, amax_compute_algo=algo, margin=margin))
    for (h, s), (h1, s1), (h2, s2) in zip(grouped, per_history, reference, strict=True):
        _assert_same_words(h, h1)
        _assert_same_words(h, h2)
        _assert_same_words(s, s1)
        _assert_same_words(s, s2)
    if margin == 20:
        assert (reference[-1][1] < torch.finfo(torch.float32).smallest_normal).any()


@needs_cast_kernels
@pytest.mark.parametrize("cached", [True, False], ids=["table-built", "no-table"])
def test_grouped_scale_update_in_a_cuda_graph(cached, monkeypatch):
    """A captured grouped update replays the PyTorch path's update: one grouped launch where
    its table was built before the capture, else (no host copies in a capture) one
    per-history launch per pair."""
    from transformer_fa.kernels import fp8_scale
    pairs, fresh = _gpu_pairs(16), _gpu_pairs(16)

    def reset():
        for (h, s), (h0, s0) in zip(pairs, fresh):
            h.copy_(h0)
            s.copy_(s0)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels (and builds the table) outside
        if cached:
            fp8_scale.update_delayed_scalings(pairs, 448.0, 1, False)
        for history, scale in _gpu_pairs(16):
            fp8_scale.update_delayed_scaling(history, scale, 448.0, 1, False)
        fp8_scale.update_delayed_scalings(_gpu_pairs(16), 448.0, 1, False)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    reset()
    calls = []
    real = fp8_scale.update_delayed_scaling
    monkeypatch.setattr(fp8_scale, "update_delayed_scaling",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_scale.update_delayed_scalings(pairs, 448.0, 1, False)
    assert len(calls) == (0 if cached else len(pairs))
    reset()
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "0")
    fp8.update_amax_histories(fresh, 448.0, DelayedScaling(amax_history_len=16, margin=1))
    for (h, s), (h0, s0) in zip(pairs, fresh, strict=True):
        _assert_same_words(h, h0)
        _assert_same_words(s, s0)


@needs_cast_kernels
@pytest.mark.skipif(not te.is_fp8_available(), reason="needs CUDA with FP8")
def test_stack_updates_its_scales_in_one_launch_per_pass(monkeypatch):
    """An 8-layer TransformerLayer stack (24 FP8 modules): the autocast's exit launches one
    grouped update and no per-history one, the backward pass one more at its end."""
    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "1")
    torch.manual_seed(0)
    stack = torch.nn.Sequential(*[
        te.TransformerLayer(256, 1024, 4, hidden_dropout=0.0, attention_dropout=0.0,
                            self_attn_mask_type="causal", attn_input_format="bshd",
                            params_dtype=torch.bfloat16, device="cuda")
        for _ in range(8)])
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    outputs = []

    def forward():
        with te.autocast(recipe=DelayedScaling()):
            outputs.append(stack(x))

    def backward():
        outputs.pop().float().square().mean().backward()

    for _ in range(2):  # compiles the kernels, builds the tables
        forward()
        backward()

    def updates(fn):
        names = _gpu_kernels(fn)
        return (sum("_update_group_kernel" in name for name in names),
                sum("_update_kernel" in name for name in names))

    assert updates(forward) == (1, 0)
    assert updates(backward) == (1, 0)
    assert not fp8._STATE.metas_after_backward and not fp8._STATE.backward_passes


# FP8 under activation checkpointing on CUDA (tests/test_fp8_checkpoint.py on CPU): a bf16
# stack trained with te.checkpoint and LayerNormMLP(checkpoint=True) equals the same stack
# trained without checkpointing, bit for bit, with the Triton cast and update kernels.
from test_fp8_checkpoint import assert_same_training, train_stack  # noqa: E402


@needs_cast_kernels
@pytest.mark.skipif(not te.is_fp8_available(), reason="needs CUDA with FP8")
@pytest.mark.parametrize("autocast_inside", [False, True], ids=["autocast-outside",
                                                                "autocast-inside"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=4), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_checkpointed_training_equals_plain_training(recipe, use_reentrant,
                                                         autocast_inside, monkeypatch,
                                                         cast_calls):
    """Outputs, all gradients, amax histories and scales after each of 3 steps. Attention
    runs on the unfused backend: a flash or cuDNN backward may sum in a varying order, and
    a reentrant checkpoint's forward runs without gradients, where a fused backend may run
    another kernel than the one the plain forward runs."""
    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "1")
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    sizes = dict(device="cuda", dtype=torch.bfloat16, hidden=256, seq=128)
    want = train_stack(recipe, **sizes)
    got = train_stack(recipe, dict(use_reentrant=use_reentrant), autocast_inside, **sizes)
    assert cast_calls  # the kernel path ran
    assert all(t.dtype == torch.bfloat16 for t in got[0][:3])
    assert_same_training(got, want)


# GELU in FC2's FP8 input cast (LayerNormMLP, activation "gelu"; kernels/fp8_cast.py's gelu
# option) by the rule of tests/test_fp8.py: the cast of torch's float32 GELU, but for values
# within the tanh's slack of an FP8 rounding boundary, and within one FP8 step of the unfused
# cast (torch's GELU rounded to 16 bits first).
from test_fp8 import (  # noqa: E402
    GELU_CAST_RTOL,
    assert_amax_of_dgelu,
    assert_dgelu_cast,
    assert_fp8_of_gelu,
    assert_within_one_fp8_step,
    dgelu_cast_scale,
    gelu_cast_scale,
)


@needs_cast_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2])
@pytest.mark.parametrize("shape", [(1, 16), (1000, 3000), (4096, 1024)])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("finite", [True, False], ids=["finite", "inf-nan"])
def test_gelu_cast_kernel_by_the_rule(dtype, fmt, shape, recipe, finite, monkeypatch,
                                      cast_calls):
    """_quantize(gelu=True) with the kernel, each orientation: the casts by the rule, the
    transpose the row-major cast's, the inverse scale and the amax history within a few
    float32 ulps of the PyTorch path's; 1000 x 3000 leaves every tile edge ragged."""
    x = _fp8_input(shape, dtype)
    if finite:
        x = torch.nan_to_num(x.float(), nan=1.0, posinf=2e3, neginf=-7.0).to(dtype)
    scales = torch.tensor([0.5, 0.375, 2.0], device="cuda")
    scale = gelu_cast_scale(x, recipe, scales, FP8_MAX[fmt])
    for rowwise, columnwise in ((True, True), (True, False), (False, True)):
        cast_calls.clear()
        got, want = _quantize_with_and_without_kernels(monkeypatch, x, fmt, recipe, scales,
                                                       rowwise=rowwise, columnwise=columnwise,
                                                       gelu=True)
        assert len(cast_calls) == 1  # the kernel ran (once), the reference did not
        for a, b, asked in zip(got[:2], want[:2], (rowwise, columnwise)):
            assert (a is None and b is None) == (not asked)
        if rowwise:
            assert_fp8_of_gelu(got[0], x, scale, FP8_MAX[fmt])
        if columnwise:
            assert got[1].is_contiguous()
            assert_fp8_of_gelu(got[1].t(), x, scale, FP8_MAX[fmt])
        if rowwise and columnwise:
            _assert_same_fp8(got[1], got[0].t().contiguous())
        for a, b in ((got[2], want[2]), (got[3], want[3])):  # inverse scale, amax history
            torch.testing.assert_close(a, b, rtol=GELU_CAST_RTOL, atol=0, equal_nan=True)


@needs_cast_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_gelu_cast_kernel_within_one_step_of_the_unfused_cast(dtype, recipe, monkeypatch):
    """The kernel's cast of gelu(h) against its cast of torch's gelu(h) in h's dtype."""
    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "1")
    g = torch.Generator(device="cuda").manual_seed(1)
    h = (torch.randn(4096, 1024, generator=g, device="cuda") * 3).to(dtype)
    casts = []
    for tensor, gelu in ((h, True), (torch.nn.functional.gelu(h, approximate="tanh"), False)):
        history = torch.zeros(1, 2, device="cuda")
        scales = torch.tensor([1.0, 16.0], device="cuda")
        casts.append(fp8._quantize(tensor, Format.E4M3, 448.0, recipe, history, scales, 1,
                                   columnwise=True, gelu=gelu))
    for a, b in zip(casts[0][:2], casts[1][:2]):
        assert_within_one_fp8_step(a, b)


@needs_cast_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (1000, 3000), (4096, 1024)])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
@pytest.mark.parametrize("h_layout", ["contiguous", "transposed"])
def test_dgelu_cast_kernel_by_the_rule(dtype, shape, recipe, h_layout, monkeypatch,
                                       cast_calls):
    """_quantize(dgelu_input=h, dbias=True) with the kernel (the backward of GELU in the
    gradient cast of the GEMM before it), each orientation and dbias alone: the casts of
    torch's float32 gelu_backward(dy, h) by the rule, the transpose the row-major cast's,
    the column sums of the float32 values, the amax within the slack of torch's. A
    contiguous h as LayerNormMLP saves it (both orientations in one kernel gave NaNs in the
    transpose from 16-bit inputs with it, Triton 3.6), and a strided one."""
    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "1")
    from transformer_fa.kernels import fp8_cast

    g = torch.Generator(device="cuda").manual_seed(3)
    if h_layout == "contiguous":
        h = (torch.randn(*shape, generator=g, device="cuda") * 3).to(dtype)
    else:
        h = (torch.randn(shape[1], shape[0], generator=g, device="cuda") * 3).to(dtype).t()
    dy = torch.randn(*shape, generator=g, device="cuda")
    dy = (dy * torch.logspace(-4, 2, shape[1], device="cuda")).to(dtype)
    scales = torch.tensor([0.5, 0.375, 2.0], device="cuda")
    scale = dgelu_cast_scale(dy, h, recipe, scales, fp8_cast.fold_amax, 57344.0)
    for rowwise, columnwise in ((True, True), (True, False), (False, True), (False, False)):
        history = torch.zeros(1, 3, device="cuda")
        cast_calls.clear()
        got = fp8._quantize(dy, Format.E5M2, 57344.0, recipe, history, scales.clone(), 1,
                            rowwise=rowwise, columnwise=columnwise, dbias=True,
                            dgelu_input=h)
        assert len(cast_calls) == 1
        assert_dgelu_cast(got, dy, h, scale, 57344.0, rowwise, columnwise)
        if isinstance(recipe, DelayedScaling):
            assert_amax_of_dgelu(history[0, 1], dy, h)


def _profiled_names(fn):
    """The names of the ops (aten::...) and GPU kernels fn() runs (run it once before)."""
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()]


@needs_cast_kernels
@pytest.mark.skipif(not te.is_fp8_available(), reason="needs CUDA with FP8")
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_mlp_runs_no_gelu(recipe, monkeypatch, cast_impl):
    """LayerNormMLP (gelu) in FP8: no aten::gelu in the forward (FC2's input cast applies it)
    and no aten::gelu_backward in the backward (FC1's gradient cast applies it); outside FP8
    the forward runs the GELU kernel (kernels/bias_grad.gelu), which writes gelu(h) in 16 bits."""
    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "1")
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(1024, 4096, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def forward():
        with te.autocast(recipe=recipe):
            return mlp(x)

    forward().sum().backward()  # compiles the kernels
    outputs = []
    forward_names = _profiled_names(lambda: outputs.append(forward()))
    assert "aten::gelu" not in forward_names
    assert any(_is_cast_launch(name) for name in forward_names)
    backward_names = _profiled_names(lambda: outputs[0].float().sum().backward())
    assert "aten::gelu_backward" not in backward_names
    assert any(_is_cast_launch(name) for name in backward_names)
    assert any("_gelu_kernel" in name for name in _profiled_names(lambda: mlp(x)))


@needs_cast_kernels
@pytest.mark.skipif(not te.is_fp8_available(), reason="needs CUDA with FP8")
@pytest.mark.parametrize("params_dtype, rtol", [(torch.float32, 0.01), (torch.bfloat16, 0.05)])
@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_fp8_mlp_fused_gelu_trains_like_the_unfused_path(params_dtype, rtol, recipe,
                                                         monkeypatch):
    """Three FP8 training steps of a LayerNormMLP with the fused GELU casts and with torch's
    GELU and gelu_backward between the FP8 GEMMs: the outputs close (float32: the same
    float32 values up to the rule's rare boundary elements; bfloat16: the unfused path rounds
    them to bfloat16)."""
    from test_fp8 import with_and_without_fp8_gelu_fusion

    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "1")

    def run():
        torch.manual_seed(0)
        mlp = te.LayerNormMLP(512, 2048, params_dtype=params_dtype, device="cuda")
        opt = torch.optim.SGD(mlp.parameters(), lr=1e-4)
        outputs = []
        for _ in range(3):
            x = torch.randn(4, 256, 512, device="cuda", dtype=params_dtype)
            with te.autocast(recipe=recipe):
                out = mlp(x)
            out.float().square().sum().backward()
            opt.step()
            opt.zero_grad()
            outputs.append(out.detach())
        return outputs

    results = with_and_without_fp8_gelu_fusion(run)
    for a, b in zip(*results):
        assert (a.float() - b.float()).norm() <= rtol * b.float().norm()


def _current_e4m3_dequantized(t):
    """What current scaling's E4M3 cast keeps of t (scale 448 / amax), as float64."""
    scale = 448.0 / t.float().abs().max()
    return ((t.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).double()
            / scale.double())


@pytest.mark.parametrize("k", [256, 8192])
def test_fast_accumulation_of_the_forward_gemm(k):
    """The forward GEMM's fast accumulation (Float8CurrentScaling's default fp8_gemm_fprop,
    TE's; delayed scaling's too): against a float64 GEMM of the same FP8 operands, its error
    within twice the split accumulation's or the bf16 output's rounding (2^-8, norm-wise), at
    a short and a long reduction."""
    from transformer_fa.common.recipe import MMParams

    torch.manual_seed(k)
    lin = te.Linear(k, 512, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    errors = []
    for split in (True, False):
        recipe = Float8CurrentScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=split))
        with torch.no_grad(), te.autocast(recipe=recipe):
            out = lin(x)
        # the same FP8 operands (current scaling's E4M3 casts), dequantized, in float64
        xq, wq = (_current_e4m3_dequantized(t.detach()) for t in (x, lin.weight))
        exact = xq @ wq.T
        errors.append(((out.double() - exact).norm() / exact.norm()).item())
    err_split, err_fast = errors
    assert err_fast <= max(2 * err_split, 2.0 ** -8), errors
