"""transformer_fa: a layout-aware transformer layer library in the style of TransformerEngine."""
__version__ = "0.1.0"

from . import attention, common
from .attention import (DotProductAttention, MultiheadAttention, RotaryPositionEmbedding,
                        apply_rotary_pos_emb)
from .module import LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm
from .distributed import CudaRNGStatesTracker, checkpoint
from .fp8 import autocast, fp8_autocast, fp8_model_init, is_fp8_available
from .graph import make_graphed_callables
from .transformer import TransformerLayer

__all__ = ["attention", "DotProductAttention", "MultiheadAttention", "TransformerLayer",
           "LayerNorm", "RMSNorm", "Linear", "LayerNormLinear", "LayerNormMLP",
           "RotaryPositionEmbedding", "apply_rotary_pos_emb", "common", "autocast",
           "fp8_autocast", "fp8_model_init", "is_fp8_available", "checkpoint",
           "CudaRNGStatesTracker", "make_graphed_callables"]
