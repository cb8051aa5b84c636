"""Triton kernels for the elementwise work of a transformer layer (norms, RoPE, FP8 casts,
bias gradients).

They run on CUDA tensors when ``triton`` imports; everywhere else (CPUs, no triton, inside
torch.compile, which fuses the PyTorch code itself) the PyTorch code of the modules runs, and
it stays the reference the kernels are tested against. ``TRANSFORMER_FA_TRITON_KERNELS=0`` turns the
kernels off (read on every call, like the NVTE_* switches).

The kernel modules (``norm``, ``rope``, ``fp8_cast``, ``fp8_scale``, ``bias_grad``) import
triton at the top: import them only after ``triton_available()``.
"""
import functools
import os

import torch

# dtypes the kernels read and write; statistics and angles are float32 inside
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# widest row a norm kernel holds in registers (one row a tile)
MAX_NORM_HIDDEN = 16384


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def kernels_enabled(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels serve these tensors: all on CUDA, triton importable,
    not switched off, not being traced by torch.compile."""
    if torch.compiler.is_compiling():
        return False
    if not all(t.is_cuda for t in tensors):
        return False
    return os.environ.get("TRANSFORMER_FA_TRITON_KERNELS", "1") != "0" and triton_available()


def use_fused_norm(x: torch.Tensor, weight: torch.Tensor, bias) -> bool:
    extra = () if bias is None else (bias,)
    return (x.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES
            and 0 < x.shape[-1] <= MAX_NORM_HIDDEN and x.numel() > 0
            and kernels_enabled(x, weight, *extra))


# The tiled norm kernels (2026-11-28) in the layer benchmark's training step (H200, bf16,
# hidden 2048, 8192 tokens; profile_layer.py's kernel time per step, 16 LayerNorms): norms
# 2.11 ms with PyTorch's kernels, 1.18 ms with ours (forward 19 us vs 35-38 us a call,
# backward 25 us vs 75 us), the step 46.1 -> 45.3 ms beside the same plain PyTorch time. At
# hidden 8192 they were faster before (bench_elementwise, 1.4x LayerNorm, 3.1-3.5x RMSNorm).
# bench_elementwise's 2048 rows time the host there (a Triton launch and autograd cost more
# than the ~50 us of GPU work), so the step's profile decides. Below 2048: not measured.
NORM_KERNEL_FASTER_FROM = 2048


def prefer_fused_norm(hidden: int) -> bool:
    """Whether the norm kernel is the faster path for rows of this size (measured above).

    ``TRANSFORMER_FA_FUSED_NORM`` (read on every call, for benchmarks and tests to A/B the
    paths): ``1`` takes the kernel at every size (where ``use_fused_norm`` allows), ``0``
    the PyTorch path; unset (or any other value) the rule above."""
    forced = os.environ.get("TRANSFORMER_FA_FUSED_NORM")
    if forced in ("0", "1"):
        return forced == "1"
    return hidden >= NORM_KERNEL_FASTER_FROM


def use_fused_rope(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """The kernel gives no gradient for freqs (as TE's) and computes angles in float32."""
    return (t.dtype in KERNEL_DTYPES and freqs.dtype == torch.float32
            and not freqs.requires_grad and t.numel() > 0 and kernels_enabled(t, freqs))


def use_bias_grad_kernels(inp: torch.Tensor, weight: torch.Tensor, bias) -> bool:
    """Whether ``x W^T + b`` takes the Functions whose backward sums the bias gradient with the
    column-sum kernels (module/linear.py): a bias that needs a gradient, grad mode on, input,
    weight and bias of one kernel dtype, no torch.autocast (it casts inside F.linear, where
    the Functions' backward would not see it)."""
    return (bias is not None and kernels_enabled(inp, weight, bias) and bias.requires_grad
            and torch.is_grad_enabled() and inp.dtype in KERNEL_DTYPES
            and inp.dtype == weight.dtype == bias.dtype and inp.numel() > 0
            and not torch.is_autocast_enabled(inp.device.type))


def use_fp8_cast(x: torch.Tensor, *state: torch.Tensor) -> bool:
    """The FP8 cast kernels read 2D tensors of the kernel dtypes (fp8.py flattens the GEMM
    operands); ``state``: the scale and amax tensors they read and write."""
    return (x.dtype in KERNEL_DTYPES and x.dim() == 2 and x.numel() > 0
            and kernels_enabled(x, *state))


def use_fp8_scale_update(*state: torch.Tensor) -> bool:
    """The delayed-scaling update kernels: float32 amax histories and scales (``state``)."""
    return (all(t.dtype == torch.float32 for t in state) and kernels_enabled(*state))
