"""MLP activations with TransformerEngine's names and meanings.

GELU is the tanh approximation (TE's kernels use it). The gated ("GLU") variants
take FC1's output of width 2 * ffn_hidden_size and return
``act(first half) * second half``, the order TE uses.
"""
from typing import Callable, Dict, Tuple

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
}


def get_activation(activation: str) -> Tuple[Callable[[torch.Tensor], torch.Tensor], bool]:
    """(function, gated) for a TE activation name."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
        )
    return ACTIVATIONS[activation]
