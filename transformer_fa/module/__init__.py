"""TE-style building blocks: norms, linear layers, the MLP and its activations."""
from .activations import get_activation
from .layernorm import LayerNorm, RMSNorm
from .linear import LayerNormLinear, LayerNormMLP, Linear

__all__ = ["LayerNorm", "RMSNorm", "Linear", "LayerNormLinear", "LayerNormMLP", "get_activation"]
