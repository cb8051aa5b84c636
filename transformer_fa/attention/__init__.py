"""Attention: layouts, backend selection, DotProductAttention and MultiheadAttention."""
from .dot_product_attention import DotProductAttention
from .layout import detect_qkv_layout, get_qkv_layout
from .params import AttentionInputs, AttentionParams

__all__ = ["DotProductAttention", "get_qkv_layout", "detect_qkv_layout", "AttentionParams",
           "AttentionInputs"]
