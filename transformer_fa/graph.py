"""TE's ``make_graphed_callables`` over torch.cuda.make_graphed_callables, FP8 included.

With ``fp8_enabled=True`` (TE 2.x: ``enabled=True``) each module's forward is captured inside
``autocast(enabled=True, recipe=fp8_recipe)``: the graphs hold the FP8 casts, the amax
records, the weight casts (redone on every replay: the optimizer changes the weights between
replays) and the delayed-scaling updates (the forward's at the autocast's exit, the
backward's at the end of the backward pass, from the autograd engine's callback, which runs
on the captured pass's stream). All of FP8's state lives in device tensors updated in
place, so a replay does what an eager step under the same autocast does.
"""
import gc
from typing import Callable, Dict, Optional, Tuple, Union

import torch

from . import fp8
from .common.recipe import Recipe

# TE's scheduling arguments (pipeline-parallel orders, hooks, buffer reuse) are not supported
_TE_ONLY = ("_order", "_num_layers_per_chunk", "retain_graph_in_backward",
            "_reuse_graph_input_output_buffers")


class _FP8Forward(torch.nn.Module):
    """``module(*args)`` inside ``autocast(enabled=True, recipe=recipe)``: what gets captured.
    Its parameters are the module's (torch's capture makes their gradients outputs)."""

    def __init__(self, module: torch.nn.Module, recipe: Optional[Recipe]):
        super().__init__()
        self.module, self.recipe = module, recipe

    def forward(self, *args):
        with fp8.autocast(enabled=True, recipe=self.recipe):
            return self.module(*args)


def make_graphed_callables(modules, sample_args, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False,
                           sample_kwargs: Optional[Union[Dict, Tuple[Dict, ...]]] = None,
                           fp8_enabled: bool = False, fp8_calibrating: bool = False,
                           fp8_recipe: Optional[Recipe] = None, fp8_group=None,
                           fp8_weight_caching: bool = False, pool=None, *,
                           enabled: Optional[bool] = None, calibrating: Optional[bool] = None,
                           recipe: Optional[Recipe] = None, amax_reduction_group=None,
                           cache_quantized_params: Optional[bool] = None,
                           **te_kwargs) -> Union[Callable, Tuple[Callable, ...]]:
    """CUDA-graph ``modules`` (a callable or a tuple of them) for ``sample_args``, as TE's
    function does. FP8 (``fp8_enabled`` / ``enabled``, with ``fp8_recipe`` / ``recipe``)
    takes modules (their forwards run under the autocast, see the module docstring) and
    returns, per module, a module whose forward is the graphed one (the original is its
    ``.module``). Not supported: FP8 calibration, an amax reduction group, TE's weight caching
    (``is_first_microbatch``) and TE's scheduling arguments (``_order``, ...)."""
    if te_kwargs:
        name = next(iter(te_kwargs))
        raise TypeError(f"make_graphed_callables() got an unsupported argument {name!r}"
                        + (" (TE's pipeline scheduling)" if name in _TE_ONLY else ""))
    use_fp8 = bool(fp8_enabled or enabled)
    recipe = fp8._check_recipe(recipe if recipe is not None else fp8_recipe, "fp8_recipe")
    for name, value in (("fp8_calibrating/calibrating", fp8_calibrating or calibrating),
                        ("fp8_group/amax_reduction_group", fp8_group or amax_reduction_group),
                        ("fp8_weight_caching/cache_quantized_params",
                         fp8_weight_caching or cache_quantized_params)):
        if value:
            raise ValueError(f"make_graphed_callables: {name}={value!r} is not supported "
                             f"(FP8 graphs run plain FP8 autocast steps)")
    if sample_kwargs:
        raise ValueError("make_graphed_callables: sample_kwargs is not supported (torch's "
                         "CUDA graph capture takes positional tensors); pass them in sample_args")
    single = not isinstance(modules, tuple)
    callables = (modules,) if single else modules
    if use_fp8:
        for m in callables:
            if not isinstance(m, torch.nn.Module):
                raise TypeError(f"make_graphed_callables(fp8_enabled=True) graphs modules "
                                f"(their parameters get gradients), got {type(m).__name__}")
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables needs CUDA (CUDA graphs), which is not "
                           "available on this machine")
    if use_fp8:
        available, reason = fp8.is_fp8_available(return_reason=True)
        if not available:
            raise ValueError(f"make_graphed_callables(fp8_enabled=True): {reason}")
        wrapped = tuple(_FP8Forward(m, recipe) for m in callables)
        modules = wrapped[0] if single else wrapped
    # torch's capture no longer collects garbage first, so Python's collector could run inside
    # a capture and finalize objects of earlier work there. Seen once: in the layer benchmark
    # (after eager rows in the same process) a capture failed with "operation failed due to a
    # previous error during capture", which the same capture alone never did. So: collect
    # before, and no collection until the graphs are built.
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        return torch.cuda.make_graphed_callables(
            modules, sample_args, num_warmup_iters=num_warmup_iters,
            allow_unused_input=allow_unused_input, pool=pool)
    finally:
        if collecting:
            gc.enable()
