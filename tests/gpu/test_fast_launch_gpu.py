"""kernels.launch.fast on CUDA: for every call pattern Triton specializes on, the compiled
kernel it caches and launches is the one ``kernel[grid]`` picks."""
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from transformer_fa.kernels.launch import fast  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@triton.jit
def _scaled_copy(X, Y, n, alpha, stride, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + i * stride, mask=i < n)
    tl.store(Y + i * stride, (x.to(tl.float32) * alpha).to(Y.dtype.element_ty), mask=i < n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 1, 8])  # elements: aligned or not to 16 bytes
@pytest.mark.parametrize("n", [1, 16, 17, 1000])  # Triton specializes ints == 1 and % 16
@pytest.mark.parametrize("stride", [1, 2])
def test_fast_launch_runs_the_kernel_triton_would(dtype, offset, n, stride):
    """Every call pattern (pointer alignment, ints Triton specializes) runs the compiled kernel
    that kernel[grid] itself picks for it, and gives its result; the second call of a pattern
    goes through the cache."""
    x = torch.randn(offset + n * stride, device="cuda", dtype=dtype)[offset:]
    grid = (triton.cdiv(n, 128),)
    args, kwargs = (x, torch.zeros_like(x), n, 0.5, stride), dict(BLOCK=128, num_warps=4)
    launcher = fast(_scaled_copy)
    for _ in range(2):
        y = torch.zeros_like(x)
        launcher[grid](x, y, n, 0.5, stride, BLOCK=128, num_warps=4)
        torch.testing.assert_close(y[::stride][:n], (x[::stride][:n].float() * 0.5).to(dtype),
                                   rtol=0, atol=0)
    _, key = launcher.key(args, kwargs)
    assert launcher.compiled[key] is _scaled_copy.warmup(*args, grid=grid, **kwargs)
