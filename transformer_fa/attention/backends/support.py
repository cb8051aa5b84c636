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
    shape, size = t.shape, t.element_size()
    if t.is_contiguous() and shape[-1] * size % 16 == 0 and t.numel():
        # The common case, answered without the loop (a call's hot path): the stride of
        # every dim of more than one element is then a multiple of the last dim's size.
        return True
    st = t.stride()
    if st[-1] != 1 and shape[-1] != 1:
        return False
    for s, n in zip(st[:-1], shape[:-1]):
        if n != 1 and (s <= 0 or s * size % 16):
            return False
    return True


def aligned(t: torch.Tensor) -> bool:
    """strides_aligned, and the data pointer on a 16-byte boundary."""
    return not t.data_ptr() & 15 and strides_aligned(t)


def fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy (always a new buffer, so it is aligned)."""
    return t.clone(memory_format=torch.contiguous_format)


def needs_grad(*tensors) -> bool:
    """Whether autograd will want gradients of any of the call's tensors (None: absent)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # (a loop, not any() over a generator: the calls' hot path)
        if t is not None and t.requires_grad:
            return True
    return False


def bindable(p: AttentionParams) -> bool:
    """Whether a backend's bind() may serve the call: the dense calls of DotProductAttention's
    memo whose runner needs only q, k and v (no lengths, dropout draw, bias, softmax offset),
    outside a trace."""
    return not (p.is_varlen or p.is_compiling or p.attention_dropout > 0.0
                or p.core_attention_bias_type != "no_bias" or p.softmax_type != "vanilla")


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


def _dense(shape, stride) -> bool:
    """Whether shape/stride is the contiguous layout (dims of size 1 may have any stride)."""
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def packed_extent(tensors) -> typing.Optional[typing.Tuple[int, int]]:
    """(first storage offset, numel) of the one dense block that ``tensors`` tile exactly, as
    the pieces of a split do (TE's packed layouts: along a new dim as in 3hd/h3d, or along an
    existing one, e.g. the heads of a fused GQA projection); None if they do not.

    Gradients allocated as one buffer of that block, with each tensor's own strides and
    offset, are then the pieces of one gradient: the split's backward takes the buffer as
    it is instead of concatenating the pieces."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    if first.numel() == 0 or any(
            t.dtype != first.dtype or t.device != first.device or t.dim() != first.dim()
            or t.stride() != first.stride() or t.untyped_storage().data_ptr() != storage
            for t in tensors):
        return None
    ts = sorted(tensors, key=lambda t: t.storage_offset())
    offsets = [t.storage_offset() for t in ts]
    shape, stride = list(first.shape), list(first.stride())
    numel = sum(t.numel() for t in ts)
    for j in range(first.dim()):  # along an existing dim: sizes may differ there only
        if all(t.shape[:j] == first.shape[:j] and t.shape[j + 1:] == first.shape[j + 1:]
               for t in ts) and all(
                offsets[i + 1] - offsets[i] == ts[i].shape[j] * stride[j]
                for i in range(len(ts) - 1)):
            whole = shape[:j] + [sum(t.shape[j] for t in ts)] + shape[j + 1:]
            if _dense(whole, stride):
                return offsets[0], numel
    step = offsets[1] - offsets[0] if len(ts) > 1 else 0
    if step > 0 and all(t.shape == first.shape for t in ts) and all(
            offsets[i + 1] - offsets[i] == step for i in range(len(ts) - 1)):
        for j in range(first.dim() + 1):  # along a new dim of stride `step`
            if _dense(shape[:j] + [len(ts)] + shape[j:], stride[:j] + [step] + stride[j:]):
                return offsets[0], numel
    return None


def grads_like(tensors, alloc=torch.empty, extent=None):
    """Gradient buffers for ``tensors``: with their ``packed_extent`` (not None), views of one
    new buffer with the tensors' own strides; else each contiguous on its own. alloc:
    torch.empty, or torch.zeros where rows stay unwritten."""
    if extent is None:
        return tuple(alloc(t.shape, dtype=t.dtype, device=t.device) for t in tensors)
    start, numel = extent
    first = tensors[0]
    buffer = alloc(numel, dtype=first.dtype, device=first.device)
    return tuple(buffer.as_strided(t.shape, t.stride(), t.storage_offset() - start)
                 for t in tensors)
