"""TE's ``make_graphed_callables`` over torch.cuda.make_graphed_callables (no FP8)."""
from typing import Callable, Dict, Optional, Tuple, Union

import torch

_FP8_ARGS = ("fp8_enabled", "fp8_calibrating", "fp8_recipe", "fp8_group", "fp8_weight_caching",
             "enabled", "calibrating", "recipe", "amax_reduction_group",
             "cache_quantized_params")


def make_graphed_callables(modules, sample_args, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False,
                           sample_kwargs: Optional[Union[Dict, Tuple[Dict, ...]]] = None,
                           pool=None, **te_kwargs) -> Union[Callable, Tuple[Callable, ...]]:
    """CUDA-graph ``modules`` (a callable or a tuple of them) for ``sample_args``, as TE's
    function does for non-FP8 work. TE's FP8 arguments are accepted at their off values;
    TE's scheduling arguments (``_order``, hooks, ...) are not supported."""
    for name, value in te_kwargs.items():
        if name not in _FP8_ARGS:
            raise TypeError(f"make_graphed_callables() got an unsupported argument {name!r}")
        if value:
            raise ValueError(f"make_graphed_callables: {name}={value!r} needs FP8, which is not "
                             f"supported yet; leave it unset")
    if sample_kwargs:
        raise ValueError("make_graphed_callables: sample_kwargs is not supported (torch's "
                         "CUDA graph capture takes positional tensors); pass them in sample_args")
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables needs CUDA (CUDA graphs), which is not "
                           "available on this machine")
    return torch.cuda.make_graphed_callables(
        modules, sample_args, num_warmup_iters=num_warmup_iters,
        allow_unused_input=allow_unused_input, pool=pool)
