"""Launching a Triton kernel with less host time: ``fast(kernel)[grid](*args, **constexprs)``.

``kernel[grid](...)`` binds and specializes every argument in Python, then looks up the
compiled kernel: tens of microseconds per launch, more than a small kernel runs. An FP8
training step launches ~150 of them, and its host time, not the GPU, set the step time.
Here the compiled kernel is looked up by a key built from what Triton specializes on, and
launched through its own runner. The key is finer than Triton's, never coarser:

- tensors: dtype, device, and whether the address is 16-byte aligned;
- ints: whether 1, whether divisible by 16, whether they fit int32 (Triton's i32 / i64);
- floats, bools, None and the constexpr / option keywords: their type and value (constexprs
  and options are compared by value).

The first call with a new key goes through ``kernel[grid]`` (compiling if needed) and keeps
what it returns; later ones launch it through its runner (``compiled[grid]``, which calls
Triton's launch hooks as ``kernel[grid]`` does). Under the interpreter every call goes
through ``kernel[grid]``.
"""
import os
from typing import Any, Callable, Dict, Tuple

import torch


def _spec(arg: Any) -> Tuple:
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.device, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool) or arg is None:
        return (arg,)
    if isinstance(arg, int):
        return (int, arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31)
    if isinstance(arg, float):
        return (float,)
    return (type(arg), arg)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class _FastKernel:
    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = list(getattr(kernel, "arg_names", ()))
        self.compiled: Dict[Tuple, Any] = {}

    def __getitem__(self, grid) -> Callable:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def key(self, args, kwargs) -> Tuple[list, Tuple]:
        """(the kernel's parameters in order, the cache key) of a call that gives the
        non-constexpr parameters by position and the constexprs (and options) by keyword."""
        params = list(args) + [kwargs[name] for name in self.arg_names[len(args):]]
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.arg_names))
        return params, (torch.cuda.current_device(), tuple(map(_spec, params)), options)

    def _launch(self, grid, args, kwargs) -> None:
        missing = any(name not in kwargs for name in self.arg_names[len(args):])
        if missing or not self.arg_names or _interpreted():
            self.kernel[grid](*args, **kwargs)  # (a parameter left to its default: Triton's)
            return
        params, key = self.key(args, kwargs)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)  # compiles if needed, launches
            if compiled is not None:
                self.compiled[key] = compiled
            return
        compiled[tuple(grid) + (1,) * (3 - len(grid))](*params)  # the runner reads 3 dims


_FAST: Dict[Any, _FastKernel] = {}


def fast(kernel) -> _FastKernel:
    """``fast(kernel)[grid](*args, **kwargs)``: ``kernel[grid](*args, **kwargs)`` with the
    compiled kernel looked up by this module's key (the module docstring)."""
    launcher = _FAST.get(kernel)
    if launcher is None:
        launcher = _FAST[kernel] = _FastKernel(kernel)
    return launcher
