"""Public helpers with TE's names (``transformer_engine.pytorch`` exports these too).

Weight-init functions and device and library queries. TE's FP8 entry points live in
``transformer_fa.fp8`` and its checkpointing in ``transformer_fa.distributed``, both exported
by ``transformer_fa``.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Callable, Tuple, Union

import torch


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


def host_reads_allowed() -> bool:
    """Whether a check may read device tensors on the host: not while torch.compile traces
    (it would break the graph) nor while a CUDA graph is being captured (a sync is illegal
    there). The checks skipped then are caught later by the kernels' own bounds (or were
    already made in the eager warm-up a capture follows)."""
    if torch.compiler.is_compiling():
        return False
    if _LENGTHS_CHECKED_ON_HOST.get():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


_LENGTHS_CHECKED_ON_HOST = contextvars.ContextVar("lengths_checked_on_host", default=False)


@contextlib.contextmanager
def lengths_checked_on_host():
    """Within it, host_reads_allowed() is False: for calls whose cu_seqlens and positions
    were built and checked on the host (InferenceParams' steps). Reading their device copies
    back would sync the host with the GPU on every layer of every decode step."""
    token = _LENGTHS_CHECKED_ON_HOST.set(True)
    try:
        yield
    finally:
        _LENGTHS_CHECKED_ON_HOST.reset(token)

