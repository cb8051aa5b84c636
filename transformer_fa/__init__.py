"""transformer_fa: a layout-aware transformer layer library in the style of TransformerEngine."""
__version__ = "0.1.0"

from . import attention
from .attention import (DotProductAttention, MultiheadAttention, RotaryPositionEmbedding,
                        apply_rotary_pos_emb)
from .module import LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm
from .transformer import TransformerLayer

__all__ = ["attention", "DotProductAttention", "MultiheadAttention", "TransformerLayer",
           "LayerNorm", "RMSNorm", "Linear", "LayerNormLinear", "LayerNormMLP",
           "RotaryPositionEmbedding", "apply_rotary_pos_emb"]
