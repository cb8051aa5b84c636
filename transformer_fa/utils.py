"""Public helpers with TE's names (``transformer_engine.pytorch`` exports these too).

Weight-init functions, device and library queries, and the entry points of features that
transformer_fa does not have (FP8): those accept "disabled" and answer "not available", so
code written for TE runs unchanged as long as it does not turn FP8 on.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Optional, Tuple, Union

import torch
import torch.utils.checkpoint

_NO_FP8 = "transformer_fa has no FP8 support"


# --- weight init (TE's Megatron-style helpers) -----------------------------------------------

def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init function that fills a tensor from N(0, sigma^2)."""
    _check_positive("sigma", sigma)

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(sigma: float,
                              num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (sigma / sqrt(2 * num_layers))^2): for the output layers of residual branches."""
    _check_positive("sigma", sigma)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def attention_mask_func(attention_scores: torch.Tensor,
                        attention_mask: torch.Tensor) -> torch.Tensor:
    """Fills the masked positions (True = masked out) of the scores with -10000, in place."""
    if attention_mask.dtype != torch.bool:
        raise TypeError(f"attention_mask must be a bool tensor (True = masked out), "
                        f"got {attention_mask.dtype}")
    return attention_scores.masked_fill_(attention_mask, -10000.0)


# --- device and library queries -------------------------------------------------------------

def get_device_compute_capability() -> Tuple[int, int]:
    """(major, minor) of the current CUDA device; (0, 0) where there is no CUDA device."""
    if not torch.cuda.is_available():
        return (0, 0)
    return torch.cuda.get_device_capability(torch.cuda.current_device())


def is_bf16_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether the current CUDA device computes in bfloat16 (sm80+)."""
    if not torch.cuda.is_available():
        available, reason = False, "no CUDA device"
    elif get_device_compute_capability() < (8, 0):
        available, reason = False, "bfloat16 needs compute capability 8.0 or newer"
    else:
        available, reason = True, ""
    return (available, reason) if return_reason else available


def get_cudnn_version() -> Tuple[int, int, int]:
    """(major, minor, patch) of the cuDNN that FusedAttention runs on (cudnn-frontend's
    backend); (0, 0, 0) where cudnn-frontend or cuDNN is not installed."""
    try:
        import cudnn
        version = int(cudnn.backend_version())
    except Exception:  # not installed, or no loadable libcudnn
        return (0, 0, 0)
    if version >= 90000:  # cuDNN 9: major * 10000 + minor * 100 + patch
        return (version // 10000, (version % 10000) // 100, version % 100)
    return (version // 1000, (version % 1000) // 100, version % 100)  # cuDNN 8


# --- FP8: not available ---------------------------------------------------------------------

def _not_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    return (False, _NO_FP8) if return_reason else False


def is_fp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Always False (with the reason when asked): transformer_fa has no FP8."""
    return _not_available(return_reason)


is_mxfp8_available = is_fp8_available
is_fp8_block_scaling_available = is_fp8_available
is_nvfp4_available = is_fp8_available


def _fp8_disabled_context(name: str, enabled: bool):
    if enabled:
        raise ValueError(f"{name}(enabled=True) needs FP8, and {_NO_FP8}; "
                         f"pass enabled=False (or drop the {name} block)")
    return contextlib.nullcontext()


def autocast(enabled: bool = True, calibrating: bool = False, recipe=None,
             amax_reduction_group=None, _graph: bool = False):
    """TE's FP8 autocast. Only ``enabled=False`` works (a no-op context); TE's default
    ``enabled=True`` raises, since it asks for FP8."""
    if calibrating:
        raise ValueError(f"autocast(calibrating=True) is FP8 calibration; {_NO_FP8}")
    return _fp8_disabled_context("autocast", enabled)


def quantized_model_init(enabled: bool = True, recipe=None,
                         preserve_high_precision_init_val: bool = False):
    """TE's FP8 parameter creation. Only ``enabled=False`` works (a no-op context)."""
    return _fp8_disabled_context("quantized_model_init", enabled)


# --- activation checkpointing ---------------------------------------------------------------

def checkpoint(function: Callable, *args, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Optional[Callable] = None, tp_group=None,
               use_reentrant: bool = True, **kwargs):
    """TE's ``checkpoint``: run ``function(*args, **kwargs)`` without keeping its activations
    and recompute them in backward (torch.utils.checkpoint, RNG state restored).

    The tensor-parallel arguments must stay at their single-device values.
    """
    if distribute_saved_activations:
        raise ValueError("checkpoint(distribute_saved_activations=True) splits activations "
                         "across a tensor-parallel group; transformer_fa has no tensor "
                         "parallelism")
    if tp_group is not None:
        raise ValueError("checkpoint(tp_group=...) needs tensor parallelism, which "
                         "transformer_fa does not have; leave it None")
    if get_rng_state_tracker is not None:
        raise ValueError("checkpoint(get_rng_state_tracker=...) restores tensor-parallel RNG "
                         "states, which transformer_fa does not have; leave it None")
    if use_reentrant:
        # The reentrant implementation only passes gradients to positional tensors: a keyword
        # tensor that needs a gradient would silently get none.
        for key, value in kwargs.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise ValueError(f"checkpoint(use_reentrant=True): keyword argument {key!r} "
                                 f"is a tensor that requires grad; pass it positionally")
        function = functools.partial(function, **kwargs)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
