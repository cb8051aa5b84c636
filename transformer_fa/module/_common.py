"""Helpers shared by the modules: TE-compatible argument handling and output packing."""
from typing import Any, Callable, Dict, Optional

import torch

# TE arguments for features a module does not implement (tensor parallelism where the module
# has none, e.g. DotProductAttention; userbuffers; FP8 bookkeeping; deferred weight
# gradients): accepted for drop-in compatibility at their neutral values; anything else would
# silently change what the user asked for. Modules with tensor parallelism take tp_group/tp_size themselves.
_TE_ONLY_NEUTRAL = {  # name: (the value that means it, why another is refused)
    "tp_group": (None, "transformer_fa runs on a single device"),
    "tp_size": (1, "transformer_fa runs on a single device"),
    "fuse_wgrad_accumulation": (False, "weight gradients go to .grad, not into main_grad"),
    "ub_tp_comm_overlap": (False, "transformer_fa runs on a single device"),
    # TE's backward would leave the weight gradients to backward_dw(), which ours lacks
    "delay_wgrad_compute": (False, "the backward computes the weight gradients itself; there "
                                   "is no backward_dw()"),
}
# Accepted and ignored: they select an implementation strategy, not the function computed.
_TE_ONLY_IGNORED = {
    "sequence_parallel",  # DotProductAttention's: it reads sequences whole in any case
    "get_rng_state_tracker",
    "rng_tracker_name",
    "seq_length",
    "micro_batch_size",
    "name",
    "ub_overlap_ag",
    "ub_overlap_rs",
    "ub_overlap_rs_dgrad",
    "ub_bulk_dgrad",
    "ub_bulk_wgrad",
    "ub_name",
    "symmetric_ar_type",
    "save_original_input",
}


def check_te_only_kwargs(kwargs: Dict[str, Any], owner: str) -> None:
    """Validate TE-only keyword arguments that transformer_fa accepts but does not implement."""
    for key, value in kwargs.items():
        if key in _TE_ONLY_NEUTRAL:
            neutral, why = _TE_ONLY_NEUTRAL[key]
            if value is not neutral and value != neutral:
                raise ValueError(
                    f"{owner}: {key}={value!r} is not supported ({why}); leave it at {neutral!r}"
                )
        elif key not in _TE_ONLY_IGNORED:
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {key!r}")


def check_no_fp8_tensors(owner: str, fp8_output, fp8_grad) -> None:
    """TE's forward flags for FP8 tensors out of a GEMM (fp8_output) and FP8 gradients into its
    backward (fp8_grad): refused where set, as the GEMMs here take and give 16/32-bit tensors."""
    for name, value in (("fp8_output", fp8_output), ("fp8_grad", fp8_grad)):
        if value:
            raise ValueError(f"{owner}.forward: {name}=True (an FP8 tensor between modules) is "
                             f"not supported; the module's inputs and outputs stay in the "
                             f"activation dtype")


def default_init_method() -> Callable[[torch.Tensor], torch.Tensor]:
    """TE's default weight init: normal with mean 0 and std 0.023."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=0.023)

    return init_


def resolve_dtype(params_dtype: Optional[torch.dtype]) -> torch.dtype:
    if params_dtype is None:
        return torch.get_default_dtype()
    if not isinstance(params_dtype, torch.dtype):
        raise TypeError(f"params_dtype must be a torch.dtype, got {type(params_dtype).__name__}")
    return params_dtype


def pack_outputs(out, bias=None, ln_out=None, return_bias=False, return_layernorm_output=False):
    """TE's return convention: out, then bias if return_bias, then layernorm output if asked."""
    outputs = (out,)
    if return_bias:
        outputs += (bias,)
    if return_layernorm_output:
        outputs += (ln_out,)
    return outputs if len(outputs) > 1 else out


def check_positive_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def check_device(device) -> None:
    """A CUDA device on a machine without CUDA is named here, before any allocation fails."""
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device ({exc})") from None
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available on this machine; pass "
                         f"device='cpu' (TE's default device is 'cuda')")


def check_hidden_states(inp, hidden_size: int, params_dtype: torch.dtype, name: str) -> None:
    """The input's last dim is hidden_size and its dtype the parameters' (outside autocast,
    as TE requires), so a mismatch is named here rather than inside a matmul."""
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(inp).__name__}")
    if inp.is_meta:
        raise ValueError(f"{name} is a meta tensor: meta tensors have no data to run on; "
                         f"build the module on a real device (or to_empty() it) first")
    if inp.dim() == 0 or inp.shape[-1] != hidden_size:
        raise ValueError(f"{name} has last dim {inp.shape[-1] if inp.dim() else None} "
                         f"(shape {list(inp.shape)}), expected hidden_size={hidden_size}")
    if inp.dtype != params_dtype and not torch.is_autocast_enabled(inp.device.type):
        raise TypeError(f"{name} dtype {inp.dtype} differs from params_dtype {params_dtype}; "
                        f"cast the input or the module, or run under torch.autocast")


class FollowsParamsDtype:
    """Mixin: ``params_dtype`` follows the parameters through ``.to(dtype)``, ``.half()``,
    ``.bfloat16()``, so the input dtype check compares against what the module holds now (TE's
    modules run after ``model.to(torch.bfloat16)``). FP8 copies (one byte) do not count."""

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        dtype = next((p.dtype for p in self.parameters()
                      if p.dtype.is_floating_point and p.element_size() > 1), None)
        if dtype is not None:
            self.params_dtype = dtype
        return module

