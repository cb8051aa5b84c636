"""TE's ``transformer_engine.common`` names that user code imports (the FP8 recipes)."""
from . import recipe

__all__ = ["recipe"]
