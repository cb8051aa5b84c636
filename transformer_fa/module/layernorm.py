"""LayerNorm and RMSNorm with TransformerEngine's arguments and formulas.

Both normalize in float32 (float64 for float64 inputs) and return the input's dtype, as TE's
kernels do.
With ``zero_centered_gamma`` the stored gamma is zero-initialised and the scale
applied is ``1 + gamma``, which keeps weight decay from pulling the scale to 0.
On CUDA with triton installed, a fused kernel (transformer_fa.kernels.norm) computes the same
thing in one pass forward and one backward; this PyTorch code is the path everywhere else.
"""
import math
import warnings
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .. import kernels, parallel
from ._common import check_device, check_positive_int, resolve_dtype

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}"
        )


def _native_layer_norm_computes_in_float32(x, normalization, weight, bias,
                                           zero_centered_gamma) -> bool:
    """Whether F.layer_norm on x as it is gives what the float32 path below gives. CUDA's
    kernels read bf16/fp16 and compute (forward and backward) in float32, so there they do,
    without the float32 copy of x that the backward would otherwise keep (twice the bytes of
    x per norm). CPU's low-precision backward accumulates dgamma/dbeta in low precision, and
    autocast would run the op in float32: those take the path below, as does
    zero_centered_gamma (1 + gamma is formed in float32)."""
    return (normalization == "LayerNorm" and x.is_cuda and not zero_centered_gamma
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype)
            and not torch.is_autocast_enabled(x.device.type))


def apply_norm(
    x: torch.Tensor,
    normalization: str,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    zero_centered_gamma: bool,
    pass_input: bool = False,
):
    """Normalize the last dimension of ``x``; ``bias`` is None for RMSNorm. With
    ``pass_input``: (the normalized x, x) for a caller that uses x again; on the norm kernel's
    path x comes back out of the norm's autograd function, whose backward then adds the
    gradient of those other uses into the norm's own (one pass instead of two)."""
    if kernels.use_fused_norm(x, weight, bias) and kernels.prefer_fused_norm(x.shape[-1]):
        from ..kernels.norm import fused_norm

        return fused_norm(x, normalization, weight, bias, eps, zero_centered_gamma, pass_input)
    if pass_input:
        return apply_norm(x, normalization, weight, bias, eps, zero_centered_gamma), x
    if _native_layer_norm_computes_in_float32(x, normalization, weight, bias,
                                              zero_centered_gamma):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    compute_dtype = torch.promote_types(x.dtype, torch.float32)  # never below x's precision
    gamma = weight.to(compute_dtype)
    if zero_centered_gamma:
        gamma = gamma + 1.0
    xf = x.to(compute_dtype)
    shape = (x.shape[-1],)
    if normalization == "LayerNorm":
        beta = bias.to(compute_dtype) if bias is not None else None
        out = F.layer_norm(xf, shape, gamma, beta, eps)
    else:
        out = F.rms_norm(xf, shape, gamma, eps)
    return out.to(x.dtype)


def apply_add_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalization: str,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    zero_centered_gamma: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(apply_norm(x + residual), x + residual): on the norm kernel's path one pass, whose
    backward also adds the sum's gradient from its other uses (a layer's residual stream)."""
    if (residual.shape == x.shape and kernels.use_fused_norm(x, weight, bias)
            and kernels.use_fused_norm(residual, weight, bias) and residual.dtype == x.dtype
            and kernels.prefer_fused_norm(x.shape[-1])):
        from ..kernels.norm import fused_add_norm

        return fused_add_norm(x, residual, normalization, weight, bias, eps, zero_centered_gamma)
    total = residual + x
    return apply_norm(total, normalization, weight, bias, eps, zero_centered_gamma), total


def make_norm_params(
    hidden_size: int,
    normalization: str,
    zero_centered_gamma: bool,
    params_dtype: Optional[torch.dtype],
    device: Union[torch.device, str, None],
):
    """(weight, bias) parameters of a norm; bias is None for RMSNorm."""
    check_normalization(normalization)
    check_positive_int(hidden_size, "hidden_size")
    dtype = resolve_dtype(params_dtype)
    fill = torch.zeros if zero_centered_gamma else torch.ones
    weight = torch.nn.Parameter(fill(hidden_size, dtype=dtype, device=device))
    bias = None
    if normalization == "LayerNorm":
        bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
    return weight, bias


class _Norm(torch.nn.Module):
    normalization = "LayerNorm"

    # TE's signature: normalized_shape first, the older hidden_size (deprecated) sixth, the
    # device, dtype and sm_margin by keyword
    def __init__(
        self,
        normalized_shape: Union[int, Tuple[int, ...], None] = None,
        eps: float = 1e-5,
        sequence_parallel: Optional[bool] = None,  # TE's: marks the parameters (see below)
        params_dtype: Optional[torch.dtype] = None,  # TE's older name of dtype
        zero_centered_gamma: bool = False,
        hidden_size: Optional[int] = None,  # TE's older name of normalized_shape
        *,
        device: Union[torch.device, str] = "cuda",
        dtype: Optional[torch.dtype] = None,
        sm_margin: int = 0,  # TE's: SMs its kernels leave to communication; no effect here
    ) -> None:
        super().__init__()
        if (hidden_size is None) == (normalized_shape is None):
            raise TypeError("pass exactly one of normalized_shape and hidden_size")
        if hidden_size is not None:
            warnings.warn("`hidden_size` arg has been renamed to `normalized_shape` for "
                          "compatibility with `torch.nn.LayerNorm`.", DeprecationWarning,
                          stacklevel=2)
            normalized_shape = hidden_size
        # (torch.nn.LayerNorm's and TE's normalized_shape: the last dims normalized together)
        shape = (tuple(normalized_shape) if isinstance(normalized_shape, (tuple, list, torch.Size))
                 else (normalized_shape,))
        if not shape or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            raise ValueError(f"normalized_shape must be an int or a shape of ints, got {shape}")
        hidden_size = math.prod(shape)
        if params_dtype is not None and dtype is not None:
            raise TypeError("pass at most one of params_dtype and dtype")
        check_device(device)
        self.normalized_shape = shape
        self.hidden_size = hidden_size
        self.eps = eps
        self.zero_centered_gamma = zero_centered_gamma
        self.sequence_parallel = sequence_parallel
        weight, bias = make_norm_params(
            hidden_size, self.normalization, zero_centered_gamma, params_dtype or dtype, device
        )
        # parameters of the normalized shape (TE's); the norm runs over their flat view
        self.weight = torch.nn.Parameter(weight.detach().view(shape))
        if bias is not None:
            self.bias = torch.nn.Parameter(bias.detach().view(shape))
        else:
            self.register_parameter("bias", None)
        if sequence_parallel:
            # As TE: fed a part of the sequence, their gradients are summed over the TP group
            # (transformer_fa.parallel.allreduce_sequence_parallel_grads).
            parallel.mark_sequence_parallel(self.weight, self.bias)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        shape = self.normalized_shape
        if len(shape) == 1:
            return apply_norm(inp, self.normalization, self.weight, self.bias, self.eps,
                              self.zero_centered_gamma)
        if tuple(inp.shape[inp.dim() - len(shape):]) != shape:
            raise ValueError(f"inp's last dims {list(inp.shape)[-len(shape):]} are not "
                             f"normalized_shape={list(shape)}")
        flat = inp.reshape(*inp.shape[:inp.dim() - len(shape)], self.hidden_size)
        bias = None if self.bias is None else self.bias.view(-1)
        out = apply_norm(flat, self.normalization, self.weight.view(-1), bias, self.eps,
                         self.zero_centered_gamma)
        return out.view(inp.shape)

    def extra_repr(self) -> str:
        size = self.hidden_size if len(self.normalized_shape) == 1 else self.normalized_shape
        return f"{size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_Norm):
    r"""y = (x - E[x]) / sqrt(Var[x] + eps) * gamma + beta; gamma -> 1 + gamma if zero_centered."""

    normalization = "LayerNorm"


class RMSNorm(_Norm):
    r"""y = x / sqrt(mean(x^2) + eps) * gamma; gamma -> 1 + gamma if zero_centered_gamma."""

    normalization = "RMSNorm"


class L2Normalization(torch.nn.Module):
    r"""TE's L2Normalization (``transformer_engine.pytorch.ops``): y = x / sqrt(sum(x^2) + eps)
    over the last dimension, in float32, no parameters; MultiheadAttention's query / key norm
    for ``qk_norm_type="L2Normalization"``."""

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = inp.float()
        return (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + self.eps)).to(inp.dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
