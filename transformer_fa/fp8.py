"""TE's FP8 entry points. FP8 is not implemented yet (issue 26): the context managers accept
TE's arguments and run as no-ops when disabled; enabling them is a clear error."""
from contextlib import contextmanager
from typing import Tuple, Union

_NO_FP8 = "FP8 is not supported by transformer_fa yet"


def is_fp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """TE's check: FP8 is never available here."""
    return (False, _NO_FP8) if return_reason else False


# TE's other quantization queries: none of those formats is available either.
is_mxfp8_available = is_fp8_available
is_fp8_block_scaling_available = is_fp8_available
is_nvfp4_available = is_fp8_available


def _refuse_if_enabled(enabled: bool, what: str) -> None:
    if enabled:
        raise ValueError(f"{what}(enabled=True): {_NO_FP8}; pass enabled=False (or drop the "
                         f"context manager) to run in the parameters' precision")


@contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe=None,
             amax_reduction_group=None, _graph: bool = False):
    """TE's ``autocast`` (quantized execution): a no-op with ``enabled=False``."""
    _refuse_if_enabled(enabled or calibrating, "autocast")
    yield


@contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None,
                 fp8_group=None, _graph: bool = False):
    """TE's older name of ``autocast``: a no-op with ``enabled=False``."""
    _refuse_if_enabled(enabled or calibrating, "fp8_autocast")
    yield


@contextmanager
def fp8_model_init(enabled: bool = True, recipe=None,
                   preserve_high_precision_init_val: bool = False):
    """TE's FP8 parameter creation: a no-op with ``enabled=False``."""
    _refuse_if_enabled(enabled, "fp8_model_init")
    yield


@contextmanager
def quantized_model_init(enabled: bool = True, recipe=None,
                         preserve_high_precision_init_val: bool = False):
    """TE 2.x's name of ``fp8_model_init``: a no-op with ``enabled=False``."""
    _refuse_if_enabled(enabled, "quantized_model_init")
    yield
