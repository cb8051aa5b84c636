"""Attention: layouts, backend selection, DotProductAttention and MultiheadAttention."""
from .dot_product_attention import DotProductAttention
from .inference import InferenceParams
from .layout import detect_qkv_layout, get_qkv_layout
from .multi_head_attention import MultiheadAttention
from .params import AttentionInputs, AttentionParams
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb

__all__ = ["DotProductAttention", "MultiheadAttention", "get_qkv_layout", "detect_qkv_layout",
           "AttentionParams", "AttentionInputs", "RotaryPositionEmbedding", "apply_rotary_pos_emb",
           "InferenceParams"]
