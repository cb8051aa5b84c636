"""The scalar math the FP8 kernels share (fp8_cast.py, fp8_scale.py): the scale from an amax as
fp8.py's ``compute_scale`` computes it, and the correctly rounded division it needs."""
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

FP32_MAX = tl.constexpr(torch.finfo(torch.float32).max)

# Triton's interpreter (the CPU tests) has tl.math.div_rn but no libdevice; compiled for
# CUDA, libdevice's div_rn is the correctly rounded division (`/` and tl.fdiv, even with
# ieee_rounding=True, gave 1-ulp differences from torch's on an H100, Triton 3.6). Triton
# compiles libdevice flushing subnormals by default, torch does not (1 / float32's max, the
# inverse of an overflowed scale, is subnormal): kernels that use these launch with
# NO_FLUSH_TO_ZERO.
NO_FLUSH_TO_ZERO = {"enable_reflect_ftz": False}
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def div_rn(a, b):
    if _INTERPRETED:
        return tl.math.div_rn(a, b)
    else:
        return libdevice.div_rn(a, b)


@triton.jit
def scale_from_amax(amax, old_scale, fp8_max, margin_divisor):
    """fp8.compute_scale elementwise: ``(fp8_max / amax) / margin_divisor`` (IEEE divisions),
    ``old_scale`` where the amax is not positive and finite, float32's max where the quotient
    overflows. ``amax``: a float32 block; the others broadcast to it."""
    zeros = tl.zeros_like(amax)  # both operands of div_rn blocks of one shape
    new = div_rn(div_rn(zeros + fp8_max, amax), zeros + margin_divisor)
    new = tl.where((amax > 0) & (amax < float("inf")), new, old_scale)
    return tl.where(tl.abs(new) == float("inf"), FP32_MAX, new)
