"""What the backends share: the never-raise support check wrapper, the memory rule their
kernels need (copies for what breaks it), the dropout RNG draw, and the named call arguments
that their torch.library ops take as plain values."""
import functools
import typing
from typing import Callable, List

import torch

from ..params import AttentionParams


def never_raises(check: Callable[[AttentionParams], List[str]]):
    """A backend's reasons check whose own failure becomes a reason, never an exception in
    the user's face (selection then falls through to the next backend)."""
    @functools.wraps(check)
    def not_supported_reasons(params: AttentionParams) -> List[str]:
        try:
            return check(params)
        except Exception as exc:
            return [f"as its support check failed ({type(exc).__name__}: {exc})"]
    return not_supported_reasons


def strides_aligned(t: torch.Tensor) -> bool:
    """A unit stride in the last dim and 16-byte aligned strides in the others (dims of size
    1 do not count): what both the flash kernels' vector loads and cuDNN need."""
    st = t.stride()
    if st[-1] != 1 and t.shape[-1] != 1:
        return False
    size = t.element_size()
    return all(n == 1 or (s > 0 and s * size % 16 == 0) for s, n in zip(st[:-1], t.shape[:-1]))


def aligned(t: torch.Tensor) -> bool:
    """strides_aligned, and the data pointer on a 16-byte boundary."""
    return not t.data_ptr() & 15 and strides_aligned(t)


def fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy (always a new buffer, so it is aligned)."""
    return t.clone(memory_format=torch.contiguous_format)


def dropout_rng_state(device: torch.device) -> torch.Tensor:
    """int64 ``[2]`` = (Philox seed, offset) for a dropout kernel, drawn from torch's generator
    on ``device`` so that ``torch.manual_seed`` reproduces a run; saved for the backward,
    which regenerates the same mask from it."""
    return torch.randint(0, 2 ** 62, (2,), dtype=torch.int64, device=device)



# torch.library schema types of call-argument fields.
_SCHEMA_TYPES = {str: "str", int: "SymInt", float: "float", bool: "bool"}


def op_schema(call_type: type, tensors: str, returns: str, extra: str = "") -> str:
    """A torch.library op schema ``(tensors, <call_type's fields>, extra) -> returns``.

    call_type is a backend's NamedTuple of a call's non-tensor arguments (str, int, float,
    bool), built once per call. Custom ops take plain values, so its ops take the fields
    flattened after their tensors (``*call``) and rebuild it with ``call_type._make``; this
    schema is the one place the names and their order are written out for torch."""
    types = typing.get_type_hints(call_type)
    fields = [f"{_SCHEMA_TYPES[types[name]]} {name}" for name in call_type._fields]
    return f"({', '.join([tensors] + fields + ([extra] if extra else []))}) -> {returns}"


def reference_only_reasons(p: AttentionParams) -> List[str]:
    """Declines for what only the unfused reference computes today: TE's softmax variants,
    max logit, softcap, and a top-left diagonal for non-causal windows and ALiBi."""
    reasons = []
    if not p.is_bottom_right and not p.is_causal and (
            p.has_window or p.core_attention_bias_type == "alibi"):
        reasons.append("as it does not support bottom_right_diagonal = False with a sliding "
                       "window or ALiBi")
    if p.softmax_type != "vanilla":
        reasons.append(f"as it does not support softmax_type = {p.softmax_type}")
    if p.return_max_logit:
        reasons.append("as it does not support return_max_logit = True")
    if p.softcap > 0.0:
        reasons.append(f"as it does not support softcap = {p.softcap}")
    return reasons
