"""TE's activation checkpointing and RNG state tracker, on a single device."""
import functools
from contextlib import contextmanager
from typing import Callable, Dict

import torch

from . import fp8


def checkpoint(function: Callable, *args, **kwargs):
    """TE's ``checkpoint``: recompute ``function(*args, **kwargs)`` in the backward
    (torch.utils.checkpoint). TE's own keywords: ``use_reentrant`` (default True, as TE),
    ``distribute_saved_activations`` (False only: no tensor parallelism here),
    ``get_rng_state_tracker`` (its states are restored for the recomputation), ``tp_group``.
    FP8 modules inside recompute under the FP8 autocast the forward ran in, with the scales
    it cast with (fp8.CheckpointedRegion), so the recomputation equals the forward."""
    use_reentrant = kwargs.pop("use_reentrant", True)
    if kwargs.pop("distribute_saved_activations", False):
        raise ValueError("checkpoint: distribute_saved_activations=True needs tensor "
                         "parallelism, which transformer_fa does not have; pass False")
    kwargs.pop("tp_group", None)
    get_rng_state_tracker = kwargs.pop("get_rng_state_tracker", None)
    if use_reentrant:
        # The reentrant implementation passes gradients to positional tensors only: a keyword
        # tensor that needs a gradient would silently get none.
        for key, value in kwargs.items():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise ValueError(f"checkpoint(use_reentrant=True): keyword argument {key!r} "
                                 f"is a tensor that requires grad; pass it positionally")
        function = functools.partial(function, **kwargs)
        kwargs = {}
    tracker = None if get_rng_state_tracker is None else get_rng_state_tracker()
    return torch.utils.checkpoint.checkpoint(_Recomputable(function, tracker), *args,
                                             use_reentrant=use_reentrant, **kwargs)


class _Recomputable:
    """The function torch's checkpoint runs: the first call is the forward, each later one a
    recomputation in a backward pass. A recomputation runs in the forward's FP8 autocast
    state and draws the tracked random numbers the forward drew (dropout masks match),
    then leaves both where they were."""

    def __init__(self, function: Callable, tracker) -> None:
        self.function = function
        self.tracker = tracker
        # made now: a reentrant checkpoint runs the forward under no_grad
        self.fp8 = fp8.CheckpointedRegion()
        self.tracked_at_forward = None
        self.forward_ran = False

    def __call__(self, *args, **kwargs):
        if not self.forward_ran:
            self.forward_ran = True
            if self.tracker is not None:
                self.tracked_at_forward = _cloned(self.tracker.get_states())
            with self.fp8.forward():
                return self.function(*args, **kwargs)
        with self.fp8.recompute(), self._tracked_states_at_forward():
            return self.function(*args, **kwargs)

    @contextmanager
    def _tracked_states_at_forward(self):
        if self.tracker is None:
            yield
            return
        current = _cloned(self.tracker.get_states())
        self.tracker.set_states(_cloned(self.tracked_at_forward))
        try:
            yield
        finally:
            self.tracker.set_states(current)


def _cloned(states: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {name: state.clone() for name, state in states.items()}


def _rng_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _rng_device() == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if _rng_device() == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """TE's tracker of named RNG states: ``add(name, seed)`` creates one, ``fork(name)``
    runs a block on it and keeps its advance, leaving the default generator as it was.
    It tracks the CUDA generator of the current device, or the CPU generator on a machine
    without CUDA (so the same code runs, and is reproducible, on CPU)."""

    def __init__(self) -> None:
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        original = _get_rng_state()
        generator = torch.cuda if _rng_device() == "cuda" else torch.random
        generator.manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(original)

    @contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"cuda rng state {name} is not added")
        original = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(original)


__all__ = ["checkpoint", "CudaRNGStatesTracker"]
