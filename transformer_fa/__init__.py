"""transformer_fa: a layout-aware transformer layer library in the style of TransformerEngine."""
__version__ = "0.1.0"

from . import attention, common
from .attention.backends.flash import flash_attn_with_kvcache
from .attention import (DotProductAttention, InferenceParams, MultiheadAttention,
                        RotaryPositionEmbedding, apply_rotary_pos_emb)
from .module import LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm
from .distributed import CudaRNGStatesTracker, checkpoint
from .fp8 import (autocast, fp8_autocast, fp8_model_init, is_fp8_available,
                  is_fp8_block_scaling_available, is_mxfp8_available, is_nvfp4_available,
                  quantized_model_init)
from .graph import make_graphed_callables
from .utils import get_device_compute_capability, is_bf16_available
from .transformer import TransformerLayer

__all__ = ["attention", "DotProductAttention", "MultiheadAttention", "TransformerLayer",
           "LayerNorm", "RMSNorm", "Linear", "LayerNormLinear", "LayerNormMLP",
           "RotaryPositionEmbedding", "apply_rotary_pos_emb", "common", "autocast",
           "fp8_autocast", "fp8_model_init", "is_fp8_available", "checkpoint",
           "CudaRNGStatesTracker", "make_graphed_callables", "quantized_model_init",
           "is_mxfp8_available", "is_fp8_block_scaling_available", "is_nvfp4_available",
           "get_device_compute_capability", "is_bf16_available", "InferenceParams",
           "flash_attn_with_kvcache"]
