"""Backend selection: env switches, each backend's reasons, preference order, TE-style logs.

Environment (read on every call):
  NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN   "0" removes that backend
  NVTE_DEBUG=1 with NVTE_DEBUG_LEVEL=0/1/2               warnings / info / debug logs
The decision is cached per (params, switches, log level, flash kernel families), so the hot
path is one dict lookup; the log lines come when a decision is made.

Under torch.compile the decision is made once per trace and baked into the graph. With dynamic
shapes the batch size and sequence lengths are symbolic; the decision is made for the shape
being traced (the symbols' hints), without a guard on them, so one graph serves the whole
family of shapes. What the backends decide by (dtype, head dims, mask, layout, device, ...)
is static in the graph (changing it recompiles).
"""
from __future__ import annotations

import logging
import platform
from types import ModuleType
from typing import Dict, List, Tuple

import torch
from torch.fx.experimental import symbolic_shapes

from . import constants, environment
from .backends import ALL_BACKENDS, flash, fused, unfused
from .params import FIELD_NAMES, AttentionParams

logger = logging.getLogger("DotProductAttention")

SWITCHES = {
    flash.NAME: constants.ENV_FLASH_ATTN,
    fused.NAME: constants.ENV_FUSED_ATTN,
    unfused.NAME: constants.ENV_UNFUSED_ATTN,
}
_LOG_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}
_BACKENDS_BY_NAME = {b.NAME: b for b in ALL_BACKENDS}
_cache: Dict[tuple, str] = {}  # decisions by (fields, switches, log level, kernel families)
_entries: Dict[tuple, Tuple[ModuleType, AttentionParams]] = {}  # the same, with params built
_CACHE_LIMIT = 1024
_log_level_set = None  # the level last applied to the logger (plain global: cheap to trace)


# (the backward's family too: the Hopper preference for training calls asks which would run)
ENV_VARS = tuple(SWITCHES.values()) + (
    constants.ENV_DEBUG, constants.ENV_DEBUG_LEVEL, constants.ENV_ALLOW_NONDETERMINISTIC_ALGO,
    constants.ENV_FLASH_FAMILY, constants.ENV_FLASH_BWD_FAMILY)

# The raw values of ENV_VARS now (None where unset; str or bytes).
read_env = environment.reader(ENV_VARS)


def _is_zero(value) -> bool:
    return value in ("0", b"0")


def log_level(env: tuple) -> int:
    """The level NVTE_DEBUG / NVTE_DEBUG_LEVEL ask for (TE: their product, 0/1/2)."""
    debug, debug_level = int(env[3] or 0), int(env[4] or 0)
    return _LOG_LEVELS.get(debug * debug_level, logging.DEBUG)


def deterministic_requested(env: tuple) -> bool:
    """NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, or torch's deterministic mode."""
    return _is_zero(env[5]) or torch.are_deterministic_algorithms_enabled()


def _configure_logging(level: int) -> None:
    global _log_level_set
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(levelname)-8s | %(name)-19s]: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    _log_level_set = level


def preference_order(params: AttentionParams) -> Tuple[ModuleType, ...]:
    """Which backend wins when several can run.

    On Hopper (sm90+) cuDNN's fused attention is faster than our kernels for most call shapes
    (benchmarks/results), so FusedAttention goes first there, except for the shapes where
    FlashAttention was measured faster (``flash.faster_than_cudnn``); elsewhere FlashAttention
    goes first. The unfused reference is always last.
    """
    if params.compute_capability is not None and params.compute_capability >= (9, 0):
        if flash.faster_than_cudnn(params) is not None:
            return (flash, fused, unfused)
        return (fused, flash, unfused)
    return ALL_BACKENDS


def _log_hopper_preference(params: AttentionParams, available: Dict[str, bool]) -> None:
    """The debug line that says why one of FlashAttention and FusedAttention went first on
    Hopper, where both could run."""
    if (params.compute_capability is None or params.compute_capability < (9, 0)
            or not (available[flash.NAME] and available[fused.NAME])):
        return
    why = flash.faster_than_cudnn(params)
    if why is not None:
        logger.debug("Preferring %s to %s on Hopper: %s", flash.NAME, fused.NAME, why)
    else:
        logger.debug("Preferring %s to %s on Hopper: cuDNN was measured faster for this call "
                     "shape (FlashAttention first only where flash.FASTER_THAN_CUDNN_FORWARD "
                     "or FASTER_THAN_CUDNN_TRAINING says)", fused.NAME, flash.NAME)


def _run_config(params: AttentionParams) -> dict:
    config = {"transformer_fa_version": _version(), "torch_version": torch.__version__,
              "python": platform.python_version(), "flash_extension_built": flash.is_built()}
    config.update(fused.versions())
    config.update(params.as_log_dict())
    return config


def _version() -> str:
    from .. import __version__
    return __version__


def _decide(params: AttentionParams, enabled: Dict[str, bool]) -> str:
    if logger.isEnabledFor(logging.DEBUG):  # the config asks cuDNN for its versions
        logger.debug("Running with config=%s", _run_config(params))
    reasons: Dict[str, List[str]] = {}
    for backend in ALL_BACKENDS:
        switch = SWITCHES[backend.NAME]
        if not enabled[backend.NAME]:
            reasons[backend.NAME] = [f"due to {switch}=0"]
        else:
            reasons[backend.NAME] = backend.not_supported_reasons(params)
        for reason in reasons[backend.NAME]:
            logger.debug("Disabling %s %s", backend.NAME, reason)
    available = {b.NAME: not reasons[b.NAME] for b in ALL_BACKENDS}
    logger.debug("Available backends = {%s}",
                 ", ".join(f"{name}={ok}" for name, ok in available.items()))
    if logger.isEnabledFor(logging.DEBUG):
        _log_hopper_preference(params, available)
    for backend in preference_order(params):
        if available[backend.NAME]:
            logger.info("Selected backend = %s", backend.NAME)
            describe = getattr(backend, "describe_choice", None)
            if describe is not None and logger.isEnabledFor(logging.DEBUG):
                logger.debug("%s", describe(params))
            return backend.NAME
    details = "; ".join(f"{name}: {', '.join(r)}" for name, r in reasons.items())
    raise ValueError(
        f"No dot product attention backend is available for the provided inputs. {details}")


@torch.compiler.assume_constant_result
def _select_name(fields: tuple, enabled: Tuple[bool, ...], level: int, families: tuple) -> str:
    # Under torch.compile this runs once at trace time and its answer is baked into the graph
    # (which is why it takes plain tuples: those are constants to the tracer). families: the
    # raw TRANSFORMER_FA_FLASH_FAMILY and TRANSFORMER_FA_FLASH_BWD_FAMILY, which
    # FlashAttention's verdict and the Hopper preference depend on.
    key = (fields, enabled, level, families)
    name = _cache.get(key)
    if name is None:
        params = AttentionParams(*fields)
        if level != _log_level_set:
            _configure_logging(level)
        name = _decide(params, dict(zip(SWITCHES, enabled)))
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = name
    return name


# The hint of a symbolic int without a guard on it (dynamo knows this function, torch 2.13+).
_hint = getattr(symbolic_shapes, "optimization_hint", None)
# Older torch has no guard-free hint in traced code, and assume_constant_result refuses a
# symbolic argument: there the sizes a shape family varies in are decided for a fixed
# representative size instead (what the backends decide by is the dtype, head dims, mask,
# layout and device; their size limits are checked again by the kernels' own bindings).
_SIZE_FIELDS = ("batch_size", "max_seqlen_q", "max_seqlen_kv")
_REPRESENTATIVE_SIZE = 128


def _static(value):
    """A field value with every symbolic int replaced by its hint (traced code only: the
    tracer shows a SymInt as an int, and a plain int is its own hint)."""
    if type(value) is int:
        return _hint(value)
    if type(value) is tuple:
        return tuple(_static(item) for item in value)
    return value


def _guard_float(value):
    guard = getattr(symbolic_shapes, "guard_scalar", None)
    return value if guard is None else guard(value)


def _static_fields(fields: tuple) -> tuple:
    """The fields as constants for assume_constant_result (see _hint)."""
    if _hint is not None:
        return tuple(_static(value) for value in fields)
    out = dict(zip(FIELD_NAMES, fields))
    for name in _SIZE_FIELDS:
        out[name] = _REPRESENTATIVE_SIZE
    if out["alibi_slopes_shape"] is not None and len(out["alibi_slopes_shape"]) == 2:
        out["alibi_slopes_shape"] = (_REPRESENTATIVE_SIZE, out["num_heads"])
    return tuple(out[name] for name in FIELD_NAMES)


def select(fields: tuple, env: tuple) -> Tuple[ModuleType, AttentionParams]:
    """The backend to run a call with, and the call's AttentionParams.

    ``fields`` are the AttentionParams values in order (``params.params_fields``) and ``env``
    is ``read_env()``: the hot path looks the decision up by them and builds the params
    object only on a miss. Raises ValueError when no backend can run.
    """
    if torch.compiler.is_compiling():
        enabled = tuple(not _is_zero(value) for value in env[:3])
        # dynamic=True makes float settings (dropout, scale) symbolic too: guard on them.
        fields = tuple(_guard_float(value) if type(value) is float else value
                       for value in fields)
        # assume_constant_result takes constants only: decide for the traced shape's hints.
        name = _select_name(_static_fields(fields), enabled, log_level(env), env[6:])
        return _BACKENDS_BY_NAME[name], AttentionParams(*fields)
    key = (fields, env)
    entry = _entries.get(key)
    if entry is None:
        enabled = tuple(not _is_zero(value) for value in env[:3])
        name = _select_name(fields, enabled, log_level(env), env[6:])
        if len(_entries) >= _CACHE_LIMIT:
            _entries.clear()
        entry = _entries[key] = (_BACKENDS_BY_NAME[name], AttentionParams(*fields))
    return entry


def clear_cache() -> None:
    """Forgets every decision, and the backends' own support verdicts and plans."""
    _cache.clear()
    _entries.clear()
    flash.clear_cache()
    fused.clear_cache()
