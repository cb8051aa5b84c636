"""TE's FP8 recipe classes, as plain dataclasses with TE's fields and defaults; autocast /
fp8_autocast (transformer_fa.fp8) run the modules' GEMMs in FP8 with them."""
import dataclasses
import os
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
    """Base class of the recipes (TE's), with TE's predicates of a recipe's kind (code written
    for TE branches on them: ``recipe.delayed()``, ``recipe.float8_current_scaling()``, ...).
    The block-scaling, NVFP4 and custom recipes do not exist here, so those are False."""

    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def mxfp8(cls) -> bool:
        return False

    float8_block_scaling = nvfp4 = custom = mxfp8  # (kinds that do not exist here)


@dataclasses.dataclass(frozen=True)
class MMParams:
    """An FP8 GEMM's options (TE's). use_split_accumulator: the tensor cores' partial sums are
    promoted to float32 at intervals (cuBLASLt's CUBLASLT_MATMUL_DESC_FAST_ACCUM off); False
    is the fast accumulation, quicker and less precise (TE's choice for the forward GEMMs)."""

    use_split_accumulator: bool = True


@dataclasses.dataclass(frozen=True)
class QParams:
    """A current-scaling quantization's options (TE's): power_2_scale (scales rounded down to
    powers of 2) and amax_epsilon (a floor under the amax). Only the defaults are served."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0


# TE's environment defaults of the fields below, read when this module is imported (as TE's)
_BACKWARD_OVERRIDE_DEFAULT = os.getenv("NVTE_BACKWARD_OVERRIDE", None)
_POWER_2_SCALES_DEFAULT = os.getenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0") == "1"
_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


def _check_backward_override(recipe) -> None:
    """TE's backward_override (None: FP8 backward GEMMs; 'high_precision' / 'dequantized':
    other backward GEMMs): only None is served."""
    value = recipe.backward_override
    if value not in _BACKWARD_OVERRIDES:
        raise ValueError(f"backward_override must be one of {_BACKWARD_OVERRIDES}, got {value!r}")
    if value is not None:
        raise ValueError(f"{type(recipe).__name__}(backward_override={value!r}) is not supported "
                         f"yet (only None: the backward GEMMs in FP8); check NVTE_BACKWARD_OVERRIDE")


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
    backward_override: Optional[str] = _BACKWARD_OVERRIDE_DEFAULT

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)
        _check_backward_override(self)


# The GEMMs' accumulation where a recipe does not say (DelayedScaling): TE's modules' constants
# (fast accumulation in the forward GEMM, split accumulation in the dgrad and wgrad GEMMs)
FPROP_DGRAD_WGRAD_SPLIT_ACCUMULATOR = (False, True, True)


@dataclasses.dataclass
class Float8CurrentScaling(Recipe):
    """TE's per-tensor current scaling recipe. fp8_gemm_fprop / _dgrad / _wgrad: the GEMMs'
    accumulation (TE's defaults: fast in the forward GEMM, split in the backward ones);
    fp8_quant_*: the quantizations' QParams (the defaults only: power-of-2 scales and an amax
    floor are refused by name)."""

    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = QParams()
    fp8_quant_fwd_weight: QParams = QParams()
    fp8_quant_bwd_grad: QParams = QParams()
    fp8_gemm_fprop: MMParams = MMParams(use_split_accumulator=False)
    fp8_gemm_dgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_gemm_wgrad: MMParams = MMParams(use_split_accumulator=True)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = _BACKWARD_OVERRIDE_DEFAULT
    use_power_2_scales: bool = _POWER_2_SCALES_DEFAULT

    def __post_init__(self) -> None:
        _check_format(self.fp8_format)
        _check_backward_override(self)
        if self.use_power_2_scales:
            raise ValueError("Float8CurrentScaling(use_power_2_scales=True): power-of-2 scales "
                             "are not supported yet; check "
                             "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES")
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            value = getattr(self, name)
            if not isinstance(value, QParams):
                raise TypeError(f"{name} must be a recipe.QParams, got {value!r}")
            if value != QParams():
                raise ValueError(f"Float8CurrentScaling({name}={value!r}): power-of-2 scales "
                                 "and amax_epsilon are not supported yet (only QParams())")
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not isinstance(getattr(self, name), MMParams):
                raise TypeError(f"{name} must be a recipe.MMParams, got {getattr(self, name)!r}")


def split_accumulator(recipe: Recipe) -> tuple:
    """(forward, dgrad, wgrad) GEMMs' use_split_accumulator under this recipe."""
    if isinstance(recipe, Float8CurrentScaling):
        return tuple(getattr(recipe, f"fp8_gemm_{gemm}").use_split_accumulator
                     for gemm in ("fprop", "dgrad", "wgrad"))
    return FPROP_DGRAD_WGRAD_SPLIT_ACCUMULATOR
