"""MLP activations with TransformerEngine's names and meanings.

GELU is the tanh approximation (TE's kernels use it). The gated ("GLU") variants
take FC1's output of width 2 * ffn_hidden_size and return
``act(first half) * second half``, the order TE uses.
"""
import functools
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def qgelu(x: torch.Tensor) -> torch.Tensor:
    """Quick GELU: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


def relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


def srelu(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU."""
    return torch.square(F.relu(x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def gated(x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return act(a) * b

    gated.__name__ = f"gated_{act.__name__}"
    return gated


glu = _gated(torch.sigmoid)
geglu = _gated(gelu)
qgeglu = _gated(qgelu)
reglu = _gated(relu)
sreglu = _gated(srelu)
swiglu = _gated(silu)

def clamped_swiglu(x: torch.Tensor, limit: float = 7.0, alpha: float = 1.702,
                   glu_linear_offset: float = 1.0) -> torch.Tensor:
    """TE's clamped SwiGLU (gpt-oss): a = min(a, limit), b = clamp(b, -limit, limit),
    a * sigmoid(alpha * a) * (b + glu_linear_offset)."""
    a, b = x.chunk(2, dim=-1)
    a = a.clamp(max=limit)
    return a * torch.sigmoid(alpha * a) * (b.clamp(-limit, limit) + glu_linear_offset)


# Activations that take TE's activation_params, and the names they accept.
PARAMETRIZED = {"clamped_swiglu": ("limit", "alpha", "glu_linear_offset")}

# name -> (function, gated)
ACTIVATIONS: Dict[str, Tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "gelu": (gelu, False),
    "qgelu": (qgelu, False),
    "relu": (relu, False),
    "srelu": (srelu, False),
    "silu": (silu, False),
    "glu": (glu, True),
    "geglu": (geglu, True),
    "qgeglu": (qgeglu, True),
    "reglu": (reglu, True),
    "sreglu": (sreglu, True),
    "swiglu": (swiglu, True),
    "clamped_swiglu": (clamped_swiglu, True),
}


def get_activation(activation: str, activation_params: Optional[dict] = None
                   ) -> Tuple[Callable[[torch.Tensor], torch.Tensor], bool]:
    """(function, gated) for a TE activation name, with TE's activation_params bound."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
        )
    fn, gated = ACTIVATIONS[activation]
    if not activation_params:
        return fn, gated
    accepted = PARAMETRIZED.get(activation, ())
    unknown = sorted(set(activation_params) - set(accepted))
    if unknown:
        raise ValueError(f"activation_params {unknown} are not parameters of activation="
                         f"{activation!r} (it takes {list(accepted) or 'none'})")
    return functools.partial(fn, **activation_params), gated
