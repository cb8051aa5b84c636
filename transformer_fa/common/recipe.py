"""TE's FP8 recipe classes, as plain dataclasses with TE's fields and defaults; autocast /
fp8_autocast (transformer_fa.fp8) run the modules' GEMMs in FP8 with them."""
import dataclasses
from enum import Enum
from typing import Callable, NamedTuple, Optional, Union


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(Enum):
    """FP8 formats: E4M3 (forward and backward), E5M2, HYBRID (E4M3 forward, E5M2 backward)."""

    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


class Recipe:
    """Base class of the recipes (TE's)."""


def _check_format(fp8_format: Format) -> None:
    if not isinstance(fp8_format, Format):
        raise TypeError(f"fp8_format must be a recipe.Format, got {fp8_format!r}")
    if fp8_format == Format.E5M2:
        raise ValueError("fp8_format=Format.E5M2: pure E5M2 training is not supported (TE)")


@dataclasses.dataclass
class DelayedScaling(Recipe):
    """TE's delayed scaling recipe (scales from an amax history)."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)


@dataclasses.dataclass
class Float8CurrentScaling(Recipe):
    """TE's per-tensor current scaling recipe."""

    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)
