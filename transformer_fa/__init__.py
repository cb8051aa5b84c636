"""transformer_fa: a layout-aware transformer layer library in the style of TransformerEngine."""
__version__ = "0.1.0"

from . import attention
from .attention import DotProductAttention

__all__ = ["attention", "DotProductAttention"]
