"""FP8 training with TE's API: ``autocast``/``fp8_autocast``, per-module scaling state and the
FP8 GEMM that Linear, LayerNormLinear and LayerNormMLP run inside an enabled autocast.

An FP8 GEMM casts its input and weight to E4M3 with per-tensor scales and multiplies them with
``torch._scaled_mm`` (output in the activation dtype); its backward casts the output gradient
to E5M2 (``Format.HYBRID``) or E4M3 (``Format.E4M3``) for the dgrad and wgrad GEMMs.
Scales follow the recipe:

* ``DelayedScaling``: each tensor's amax goes into row 0 of an amax history; after the step
  (forward: when the outermost autocast exits, backward: at the end of the backward pass,
  TE's) the amax is taken from the history ("max" or "most_recent"), the history rolls, and
  ``scale = (fp8_max / amax) / 2**margin`` as TE computes it. The first step uses scale 1.
  On CUDA all modules' updates of one pass run in one kernel launch per recipe setting.
* ``Float8CurrentScaling``: the scale comes from the tensor's own amax, each time.

Under activation checkpointing the recomputation in the backward re-enters the forward's
autocast settings and casts with the scales the forward used (``CheckpointedRegion``).

FP8 needs a GPU of compute capability 8.9+ (TE's rule). ``torch._scaled_mm`` also runs FP8 on
CPU (slowly); ``TRANSFORMER_FA_FP8_ON_CPU=1`` allows that, for tests and numerics checks.
"""
import contextlib
import functools
import importlib
import io
import os
import warnings
from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch

from . import kernels
from .common.recipe import (DelayedScaling, Float8CurrentScaling, Format, Recipe,
                            split_accumulator)

_FP8_DTYPES = {Format.E4M3: torch.float8_e4m3fn, Format.E5M2: torch.float8_e5m2}
_FP32_MAX = torch.finfo(torch.float32).max
_ALLOW_CPU_ENV = "TRANSFORMER_FA_FP8_ON_CPU"


def is_fp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """TE's check: a CUDA GPU of compute capability 8.9 or higher (or CPU, when
    TRANSFORMER_FA_FP8_ON_CPU=1 allows torch._scaled_mm's CPU path)."""
    if os.environ.get(_ALLOW_CPU_ENV) == "1":
        available, reason = True, ""
    elif not torch.cuda.is_available():
        available, reason = False, (f"FP8 needs a CUDA GPU of compute capability 8.9 or "
                                    f"higher; none is available (set {_ALLOW_CPU_ENV}=1 to run "
                                    f"the FP8 GEMMs on CPU, slowly, for tests)")
    elif torch.cuda.get_device_capability() < (8, 9):
        available, reason = False, ("Device compute capability 8.9 or higher required for FP8 "
                                    "execution.")
    else:
        available, reason = True, ""
    return (available, reason) if return_reason else available


def _not_available(return_reason: bool = False):
    reason = "transformer_fa implements only the per-tensor FP8 recipes"
    return (False, reason) if return_reason else False


# TE's other quantization formats (MXFP8, FP8 block scaling, NVFP4) are not implemented.
is_mxfp8_available = _not_available
is_fp8_block_scaling_available = _not_available
is_nvfp4_available = _not_available


class _AutocastState:
    """The innermost autocast's settings, the modules whose forward scales the outermost
    autocast updates when it exits, and those whose backward scales the end of the running
    backward pass updates."""

    def __init__(self) -> None:
        self.enabled = False
        self.calibrating = False
        self.recipe: Optional[Recipe] = None
        self.group = None
        self.depth = 0
        # insertion-ordered, an O(1) membership test per GEMM
        self.metas_to_update: Dict["FP8Meta", None] = {}
        self.metas_after_backward: Dict["FP8Meta", None] = {}
        # the autograd graph tasks (backward passes) that have the update queued
        self.backward_passes: Set[int] = set()
        # activation checkpointing: the regions whose forward is running (each records the
        # forward state of its FP8 GEMMs), and the recomputation running, if any
        self.recording: List["CheckpointedRegion"] = []
        self.replaying: Optional["_Replay"] = None


_STATE = _AutocastState()


def fp8_enabled() -> bool:
    return _STATE.enabled


def fp8_active() -> bool:
    """GEMMs run in FP8 or record amaxes (calibration)."""
    return _STATE.enabled or _STATE.calibrating


def get_fp8_recipe() -> Optional[Recipe]:
    return _STATE.recipe


def _check_recipe(recipe, name: str) -> Recipe:
    if recipe is None:
        return DelayedScaling()  # TE's default recipe
    if not isinstance(recipe, (DelayedScaling, Float8CurrentScaling)):
        raise TypeError(f"{name} must be a transformer_fa.common.recipe.DelayedScaling or "
                        f"Float8CurrentScaling, got {type(recipe).__name__}")
    return recipe


class autocast:  # noqa: N801 (TE's name)
    """TE's ``autocast``: inside ``enabled=True`` the modules run their GEMMs in FP8 with the
    recipe's scaling; ``calibrating=True`` records amaxes (and updates delayed scales) while
    the GEMMs stay in high precision. Nested autocasts take the inner settings, restored on
    exit; the outermost exit updates the delayed forward scales (TE's)."""

    _name = "autocast"
    _recipe_arg = "recipe"

    def __init__(self, enabled: bool = True, calibrating: bool = False,
                 recipe: Optional[Recipe] = None, amax_reduction_group=None,
                 _graph: bool = False) -> None:
        self._enabled = bool(enabled)
        self._calibrating = bool(calibrating)
        self._recipe = _check_recipe(recipe, self._recipe_arg)
        self._group = amax_reduction_group
        self._saved = None
        if self._enabled:
            available, reason = is_fp8_available(return_reason=True)
            if not available:
                raise ValueError(f"{self._name}(enabled=True): {reason}")

    def __enter__(self):
        if self._saved is not None:
            raise RuntimeError(f"{self._name} cannot be entered twice at the same time")
        state = _STATE
        self._saved = (state.enabled, state.calibrating, state.recipe, state.group)
        state.enabled, state.calibrating = self._enabled, self._calibrating
        state.recipe, state.group = self._recipe, self._group
        state.depth += 1
        return self

    def __exit__(self, *exc) -> None:
        state = _STATE
        state.enabled, state.calibrating, state.recipe, state.group = self._saved
        self._saved = None
        state.depth -= 1
        if state.depth == 0:
            metas, state.metas_to_update = state.metas_to_update, {}
            # a reentrant checkpoint runs its training forward under no_grad
            if torch.is_grad_enabled() or state.recording:
                update_delayed_scales(metas, forward=True)


class fp8_autocast(autocast):  # noqa: N801 (TE's name)
    """TE's older name of ``autocast`` (``fp8_recipe``, ``fp8_group``)."""

    _name = "fp8_autocast"
    _recipe_arg = "fp8_recipe"

    def __init__(self, enabled: bool = True, calibrating: bool = False,
                 fp8_recipe: Optional[Recipe] = None, fp8_group=None,
                 _graph: bool = False) -> None:
        warnings.warn("fp8_autocast is deprecated and will be removed in a future release. Use "
                      "autocast(enabled=..., calibrating=..., recipe=..., "
                      "amax_reduction_group=...) instead.", DeprecationWarning, stacklevel=2)
        super().__init__(enabled, calibrating, fp8_recipe, fp8_group, _graph)


class quantized_model_init:  # noqa: N801 (TE's name)
    """TE's FP8 parameter creation. Parameters stay in high precision here (the FP8 GEMMs
    cast the weights once per step), so this accepts TE's arguments and changes nothing."""

    def __init__(self, enabled: bool = True, recipe=None,
                 preserve_high_precision_init_val: bool = False) -> None:
        _check_recipe(recipe, "recipe")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class fp8_model_init(quantized_model_init):  # noqa: N801 (TE's name)
    """TE's older name of ``quantized_model_init``."""

    def __init__(self, enabled: bool = True, recipe=None,
                 preserve_high_precision_init_val: bool = False) -> None:
        warnings.warn("fp8_model_init is deprecated and will be removed in a future release. Use "
                      "quantized_model_init(enabled=..., recipe=..., "
                      "preserve_high_precision_init_val=...) instead.", DeprecationWarning,
                      stacklevel=2)
        super().__init__(enabled, recipe, preserve_high_precision_init_val)


def compute_scale(amax: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                  margin: int = 0) -> torch.Tensor:
    """TE's scaling factor: (fp8_max / amax) / 2**margin; the old scale where amax is 0 or
    not finite, fp32's max where the quotient overflows. Correctly rounded divisions (a
    Python float over a tensor would be the reciprocal times the float, rounded twice), as
    the Triton update kernel computes them."""
    new = torch.full_like(amax, fp8_max).div_(amax).div_(2 ** margin)
    new = torch.where((amax > 0) & torch.isfinite(amax), new, scale)
    return torch.where(torch.isinf(new), torch.full_like(new, _FP32_MAX), new)


def update_amax_history(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                        recipe: DelayedScaling) -> None:
    """TE's delayed update of one amax history and its scales (update_amax_histories)."""
    update_amax_histories([(amax_history, scale)], fp8_max, recipe)


def update_amax_histories(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]], fp8_max: float,
                          recipe: DelayedScaling) -> None:
    """TE's delayed update, in place, of each (amax history [history_len, n], scale [n]) pair:
    amax from the history, new scale, history rolled by one with row 0 cleared for the next
    step's amaxes. On CUDA the built-in algorithms run as one Triton launch for all pairs
    (kernels/fp8_scale.py; histories of one length) with this code's results, bit for bit."""
    algo = recipe.amax_compute_algo
    if (not callable(algo) and recipe.scaling_factor_compute_algo is None
            and kernels.use_fp8_scale_update(*(t for pair in pairs for t in pair))):
        _scale_kernels().update_delayed_scalings(pairs, fp8_max, recipe.margin,
                                                 most_recent=algo == "most_recent")
        return
    for amax_history, scale in pairs:
        if callable(algo):
            amax = algo(amax_history)
        elif algo == "max":
            amax = amax_history.max(dim=0).values
        else:
            amax = amax_history[0].clone()
        if recipe.scaling_factor_compute_algo is not None:
            new_scale = recipe.scaling_factor_compute_algo(amax, scale, fp8_max, recipe)
        else:
            new_scale = compute_scale(amax, scale, fp8_max, recipe.margin)
        scale.copy_(new_scale)
        amax_history.copy_(torch.roll(amax_history, -1, 0))
        amax_history[0].zero_()


def update_delayed_scales(metas, forward: bool) -> None:
    """The delayed update of the metas' forward (input and weight) or backward (output
    gradient) scales, each meta's newest amaxes first reduced over its group: one
    update_amax_histories call (on CUDA one launch) per history length, recipe setting and
    fp8_max. The forward update drops the cached weight casts (their scales changed)."""
    groups: Dict[tuple, Tuple[DelayedScaling, float, List]] = {}
    for meta in metas:
        recipe = meta.recipe
        if not isinstance(recipe, DelayedScaling):
            continue
        if forward:
            history, scale, fp8_max = (meta.amax_history_fwd, meta.scale_fwd,
                                       recipe.fp8_format.value.max_fwd)
            meta.weight_cache = {}
            meta.recompute_state = None  # the recorded regions keep theirs
        else:
            history, scale, fp8_max = (meta.amax_history_bwd, meta.scale_bwd,
                                       recipe.fp8_format.value.max_bwd)
        _reduce_amax(history, meta.group, recipe)
        key = (history.shape[0], history.device, fp8_max, recipe.margin,
               recipe.amax_compute_algo, recipe.scaling_factor_compute_algo)
        groups.setdefault(key, (recipe, fp8_max, []))[2].append((history, scale))
    for recipe, fp8_max, pairs in groups.values():
        update_amax_histories(pairs, fp8_max, recipe)


def _update_at_end_of_backward(meta: "FP8Meta") -> None:
    """Registers the meta's backward scales for the update at the end of the running backward
    pass (TE's): the first FP8 backward of a pass queues the autograd engine's callback.
    The callback runs on the pass's streams, so a CUDA graph capture of a backward holds its
    launches."""
    state = _STATE
    if meta not in state.metas_after_backward:
        state.metas_after_backward[meta] = None
    task = torch._C._current_graph_task_id()
    if task not in state.backward_passes:
        state.backward_passes.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_end_of_backward, task))


def _end_of_backward(task: int) -> None:
    """Updates every registered meta: a nested pass (reentrant checkpointing) that queued its
    own callback takes the outer pass's registered metas along, each updated once."""
    state = _STATE
    state.backward_passes.discard(task)
    metas, state.metas_after_backward = state.metas_after_backward, {}
    update_delayed_scales(metas, forward=False)


def _reduce_amax(history: torch.Tensor, group, recipe: Recipe) -> None:
    """The newest amaxes (row 0 of the history) reduced over the group."""
    if (group is not None and getattr(recipe, "reduce_amax", False)
            and torch.distributed.is_initialized()):
        torch.distributed.all_reduce(history[0], op=torch.distributed.ReduceOp.MAX,
                                     group=group)


class _ForwardState(NamedTuple):
    """What a forward FP8 GEMM casts with: amax history [history_len, 2 * gemms], scales
    [2 * gemms] and the weight casts' cache."""
    amax_history: torch.Tensor
    scale: torch.Tensor
    weight_cache: dict


class FP8Meta:
    """One module's FP8 state (TE's ``fp8_meta``): for each of its GEMMs a forward scale and
    amax history for the input and the weight, and a backward one for the output gradient;
    and the weights' FP8 copies, cast once per weight version and scale."""

    def __init__(self, num_gemms: int = 1) -> None:
        self.num_gemms = num_gemms
        self.recipe: Optional[Recipe] = None
        self.group = None
        self.scale_fwd = self.amax_history_fwd = None
        self.scale_bwd = self.amax_history_bwd = None
        self.weight_cache = {}
        # the forward state a checkpointed region's recomputation casts with (see
        # _recompute_state), shared by the regions recorded until the next forward update
        self.recompute_state: Optional[_ForwardState] = None

    def forward_state(self) -> "_ForwardState":
        """The state the forward GEMMs cast with and record their amaxes into."""
        return _ForwardState(self.amax_history_fwd, self.scale_fwd, self.weight_cache)

    def _recompute_state(self) -> "_ForwardState":
        """For a checkpointed region's recomputation: delayed scaling casts with a copy of
        the current forward scales (the autocast's exit updates them before the backward
        recomputes), records its amaxes into a scratch history (not into the next step's
        row) and caches its weight casts apart. Current scaling has no state to keep."""
        if not isinstance(self.recipe, DelayedScaling):
            return self.forward_state()
        if self.recompute_state is None:
            self.recompute_state = _ForwardState(torch.zeros_like(self.amax_history_fwd),
                                                 self.scale_fwd.clone(), {})
        return self.recompute_state

    def _prepare(self, recipe: Recipe, device: torch.device) -> None:
        """(Re)make the state where the recipe's kind or history length changed."""
        history_len = getattr(recipe, "amax_history_len", 1)
        fresh = (self.scale_fwd is None or type(recipe) is not type(self.recipe)
                 or self.amax_history_fwd.shape[0] != history_len)
        self.recipe = recipe
        if fresh:
            n = self.num_gemms
            self.scale_fwd = torch.ones(2 * n, device=device)
            self.amax_history_fwd = torch.zeros(history_len, 2 * n, device=device)
            self.scale_bwd = torch.ones(n, device=device)
            self.amax_history_bwd = torch.zeros(history_len, n, device=device)
            self.weight_cache = {}
            self.recompute_state = None

    def record_forward(self, recipe: Recipe, inp: torch.Tensor, weight: torch.Tensor,
                       gemm: int) -> None:
        """Calibration: the amaxes of a high-precision GEMM's operands."""
        self._join(recipe, inp.device)
        if isinstance(recipe, DelayedScaling):
            for slot, tensor in ((2 * gemm, inp), (2 * gemm + 1, weight)):
                _record_amax(self.amax_history_fwd, slot, tensor)

    def _join(self, recipe: Recipe, device: torch.device) -> None:
        if recipe is not self.recipe:  # the same recipe object: the state fits it
            self._prepare(recipe, device)
        self.group = _STATE.group
        queue = _STATE.metas_to_update
        if self not in queue:
            queue[self] = None

    # TE keeps the FP8 state in the module's extra state: a pickled dict in a uint8 tensor.
    def get_extra_state(self) -> torch.Tensor:
        if not isinstance(self.recipe, DelayedScaling):
            return torch.empty(0, dtype=torch.uint8)  # current scaling has no state (TE's)
        state = {"recipe": self.recipe, "num_gemms": self.num_gemms,
                 "scale_fwd": self.scale_fwd.cpu(), "amax_history_fwd": self.amax_history_fwd.cpu(),
                 "scale_bwd": self.scale_bwd.cpu(), "amax_history_bwd": self.amax_history_bwd.cpu()}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    def set_extra_state(self, state, device: torch.device) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise TypeError(f"FP8 extra state must be a uint8 tensor (get_extra_state's), got "
                            f"{type(state).__name__}")
        loaded = torch.load(io.BytesIO(state.numpy().tobytes()), weights_only=False)
        if loaded["num_gemms"] != self.num_gemms:
            raise ValueError(f"FP8 extra state is for {loaded['num_gemms']} GEMMs, this module "
                             f"has {self.num_gemms}")
        self.recipe = loaded["recipe"]
        for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
            setattr(self, key, loaded[key].to(device))
        self.weight_cache = {}
        self.recompute_state = None


def _cast_kernels(tensor: torch.Tensor, *state: torch.Tensor):
    """The Triton FP8 cast module where it serves this tensor (CUDA, kernels on), else None:
    then the PyTorch code below runs, and it stays the reference."""
    if not kernels.use_fp8_cast(tensor, *state):
        return None
    return _kernel_module("fp8_cast")


def _scale_kernels():
    return _kernel_module("fp8_scale")


@functools.lru_cache(maxsize=None)
def _kernel_module(name: str):
    """kernels.<name>, imported once (they import triton: only after the kernels' checks)."""
    return importlib.import_module(f".kernels.{name}", __package__)


def _as_2d(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() > 2 else tensor


def _gelu_float32(tensor: torch.Tensor) -> torch.Tensor:
    """tanh GELU computed in float32 and kept there: what the cast kernel's ``gelu`` option
    casts (no rounding to the input's dtype in between)."""
    return torch.nn.functional.gelu(tensor.float(), approximate="tanh")


def _cast_source(tensor: torch.Tensor, gelu: bool,
                 dgelu_input: Optional[torch.Tensor]) -> torch.Tensor:
    """What the PyTorch path casts: the tensor, or in float32 gelu(tensor) (``gelu``), or
    GELU's input gradient from its output gradient ``tensor`` and input ``dgelu_input``
    (torch's gelu_backward)."""
    if gelu:
        return _gelu_float32(tensor)
    if dgelu_input is not None:
        return torch.ops.aten.gelu_backward(tensor.float(), dgelu_input.float(),
                                            approximate="tanh")
    return tensor


def _amax(tensor: torch.Tensor, gelu: bool = False,
          dgelu_input: Optional[torch.Tensor] = None) -> torch.Tensor:
    """max|tensor| (of _cast_source's tensor) as a float32 scalar (NaN if the tensor has one,
    as torch.amax)."""
    tensor = _as_2d(tensor.detach())
    if dgelu_input is not None:
        dgelu_input = _as_2d(dgelu_input.detach())
    cast_kernels = _cast_kernels(tensor, *_present(dgelu_input))
    if cast_kernels is None:
        return _cast_source(tensor, gelu, dgelu_input).abs().amax().float()
    amax = torch.zeros((), dtype=torch.float32, device=tensor.device)
    cast_kernels.fold_amax(tensor, amax, gelu=gelu, dgelu_input=dgelu_input)
    return amax


def _present(*tensors: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    return tuple(t for t in tensors if t is not None)


def _record_amax(history: torch.Tensor, slot: int, tensor: torch.Tensor) -> None:
    """history[0, slot] = max(history[0, slot], max|tensor|)."""
    tensor = _as_2d(tensor.detach())
    cast_kernels = _cast_kernels(tensor, history)
    if cast_kernels is None:
        history[0, slot] = torch.maximum(history[0, slot], _amax(tensor))
    else:
        cast_kernels.fold_amax(tensor, history[0, slot:slot + 1])


def _quantize(tensor: torch.Tensor, fmt: Format, fp8_max: float, recipe: Recipe,
              history: torch.Tensor, scales: torch.Tensor, slot: int,
              rowwise: bool = True, columnwise: bool = False, dbias: bool = False,
              gelu: bool = False, dgelu_input: Optional[torch.Tensor] = None):
    """(FP8 tensor, its transpose, the inverse scale) of a 2D tensor: the FP8 tensor row-major
    (None unless ``rowwise``) and its transpose contiguous (None unless ``columnwise``), the
    orientations torch._scaled_mm's operands need; with ``dbias`` a fourth item, the column
    sums ``tensor.sum(0)`` (a bias gradient). Delayed scaling records the amax and casts
    with the stored scale; current scaling casts with the scale from this tensor's amax. On
    CUDA the Triton kernels read the tensor once for the cast, the transpose, the delayed
    amax and the column sums (current scaling: one more read for the amax; the cast kernel
    computes the scale), with the PyTorch path's results (the sums: up to summation order).
    With ``gelu`` all of it is of ``gelu(tensor)`` (tanh GELU) computed in float32, which the
    kernel applies as it reads the tensor: an MLP's FP8 GEMM after its GELU casts the GELU's
    input and the GELU's output is never written in high precision (TE's activation cast).
    The kernel's float32 GELU is torch's up to its tanh's last bits, so its FP8 values are the
    PyTorch path's except where the float32 value lies on an FP8 rounding boundary.
    With a ``dgelu_input`` h, ``tensor`` is the gradient of gelu(h) and all of it (the column
    sums too, before rounding) is of GELU's input gradient in float32 (TE's dgelu cast): the
    GEMM before the GELU casts its output gradient without dh written in high precision."""
    tensor = tensor.detach()
    if dgelu_input is not None:
        dgelu_input = dgelu_input.detach()
    fp8_dtype = _FP8_DTYPES[fmt]
    delayed = isinstance(recipe, DelayedScaling)
    cast_kernels = _cast_kernels(tensor, history, scales, *_present(dgelu_input))
    if cast_kernels is not None:
        # one launch records the delayed amax or computes the current scale from the amax,
        # casts, writes the inverse scale and sums the columns
        scaling = (dict(scale=scales[slot], amax=history[0, slot:slot + 1]) if delayed
                   else dict(scale=None, scale_from_amax=_amax(tensor, gelu, dgelu_input)))
        quantized = cast_kernels.cast(tensor, fp8_dtype=fp8_dtype, fp8_max=fp8_max,
                                      rowwise=rowwise, columnwise=columnwise, dbias=dbias,
                                      gelu=gelu, dgelu_input=dgelu_input, **scaling)
        return quantized if dbias else quantized[:3]
    dtype = tensor.dtype
    tensor = _cast_source(tensor, gelu, dgelu_input)
    if delayed:
        scale = scales[slot]
        _record_amax(history, slot, tensor)
    else:
        amax = _amax(tensor)
        scale = compute_scale(amax, torch.ones_like(amax), fp8_max)
    data = (tensor.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    data_t = data.t().contiguous() if columnwise else None
    data = data.contiguous() if rowwise else None
    quantized = data, data_t, scale.reciprocal().reshape(())
    return (*quantized, tensor.sum(0).to(dtype)) if dbias else quantized


def check_fp8_gemm_shape(inp: torch.Tensor, features: Tuple[int, ...], owner: str) -> None:
    """torch._scaled_mm needs every GEMM dim a multiple of 16 (the backward's wgrad sums over
    the tokens); TE asserts such shapes as well, so a misfit is an error, not a slow path."""
    tokens = inp.numel() // inp.shape[-1] if inp.dim() else 0
    for name, size in (("tokens (the product of the input's leading dims)", tokens),
                       ("features", features)):
        sizes = size if isinstance(size, tuple) else (size,)
        if any(n % 16 for n in sizes):
            raise ValueError(f"{owner}: FP8 GEMMs need {name} to be multiples of 16, got "
                             f"{size} (input shape {list(inp.shape)}); pad the input or run "
                             f"outside fp8_autocast")


def _scaled_mm(a, b, scale_a, scale_b, out_dtype, split_accumulation: bool, bias=None):
    """split_accumulation False: cuBLASLt's fast accumulation (recipe.MMParams)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias,
                            out_dtype=out_dtype, use_fast_accum=not split_accumulation)


# torch._scaled_mm adds a bias in the GEMM's epilogue (in float32, one rounding) where the bias
# and the output are both bfloat16 or both float16 (its CUDA checks); a float32 output takes no
# bias there.
_EPILOGUE_BIAS_DTYPES = (torch.bfloat16, torch.float16)


def _bias_fits_epilogue(bias: torch.Tensor, out_dtype: torch.dtype) -> bool:
    return (bias.dtype == out_dtype and out_dtype in _EPILOGUE_BIAS_DTYPES
            and bias.dim() == 1 and bias.is_contiguous())


def _gemm_forward(inp, weight, bias, forward_state: "_ForwardState", gemm: int,
                  recipe: Recipe, need_dgrad: bool, need_wgrad: bool, gelu: bool = False):
    """One FP8 GEMM's forward: (inp @ weight^T [+ bias, in the epilogue], what its backward
    reads: the input's FP8 transpose (for the wgrad) and inverse scale, the weight's (for
    the dgrad)). With ``gelu`` the input's cast applies tanh GELU (``_quantize``)."""
    fp8_max = recipe.fp8_format.value.max_fwd
    x_fp8, x_t, x_scale_inv = _quantize(inp, Format.E4M3, fp8_max, recipe,
                                        forward_state.amax_history, forward_state.scale,
                                        2 * gemm, columnwise=need_wgrad, gelu=gelu)
    w_fp8, w_t, w_scale_inv = _weight_fp8(forward_state, weight, gemm, recipe, fp8_max,
                                          transpose=need_dgrad)
    out = _scaled_mm(x_fp8, w_fp8.t(), x_scale_inv, w_scale_inv, inp.dtype,
                     split_accumulator(recipe)[0], bias)
    return out, (x_t, x_scale_inv, w_t, w_scale_inv)


def _gemm_backward(grad_out, saved, meta: "FP8Meta", gemm: int, recipe: Recipe, needs,
                   dtypes, dgelu_input: Optional[torch.Tensor] = None):
    """One FP8 GEMM's (input, weight, bias) gradients, None where ``needs`` (dgrad, wgrad,
    bias gradient) says no, from one cast of the output gradient: row-major for the dgrad,
    transposed for the wgrad, the bias gradient from the cast's column sums. With a
    ``dgelu_input`` h (this GEMM's output went through a GELU) ``grad_out`` is gelu(h)'s
    gradient and the cast takes GELU's backward first (``_quantize``)."""
    x_t, x_scale_inv, w_t, w_scale_inv = saved
    need_dgrad, need_wgrad, need_bgrad = needs
    inp_dtype, weight_dtype = dtypes
    fmt = recipe.fp8_format
    grad_fmt = Format.E5M2 if fmt == Format.HYBRID else Format.E4M3
    quantized = _quantize(grad_out, grad_fmt, fmt.value.max_bwd, recipe,
                          meta.amax_history_bwd, meta.scale_bwd, gemm,
                          rowwise=need_dgrad, columnwise=need_wgrad, dbias=need_bgrad,
                          dgelu_input=dgelu_input)
    g_fp8, g_t, g_scale_inv = quantized[:3]
    grad_inp = grad_weight = None
    grad_bias = quantized[3] if need_bgrad else None
    _, dgrad_split, wgrad_split = split_accumulator(recipe)
    if need_dgrad:  # g @ W: W column-major is W^T row-major
        grad_inp = _scaled_mm(g_fp8, w_t.t(), g_scale_inv, w_scale_inv, inp_dtype, dgrad_split)
    if need_wgrad:  # g^T @ x: x column-major is x^T row-major
        grad_weight = _scaled_mm(g_t, x_t.t(), g_scale_inv, x_scale_inv, weight_dtype,
                                 wgrad_split)
    if isinstance(recipe, DelayedScaling):
        _update_at_end_of_backward(meta)
    return grad_inp, grad_weight, grad_bias


class _FP8Matmul(torch.autograd.Function):
    """inp @ weight^T with FP8 operands; dgrad and wgrad GEMMs in FP8 as well. Each operand is
    cast once, in the orientations its GEMMs need (torch._scaled_mm: first operand row-major,
    second column-major): the forward keeps the input's transpose for the wgrad and the
    weight's for the dgrad, the backward casts the output gradient row-major for the dgrad and
    transposed for the wgrad; a gradient nobody needs costs no transpose."""

    @staticmethod
    def forward(ctx, inp, weight, bias, meta, forward_state, gemm, recipe, grad_enabled):
        # needs_input_grad says True under no_grad as well: grad_enabled comes from outside
        need_dgrad = grad_enabled and ctx.needs_input_grad[0]
        need_wgrad = grad_enabled and ctx.needs_input_grad[1]
        out, saved = _gemm_forward(inp, weight, bias, forward_state, gemm, recipe, need_dgrad,
                                   need_wgrad)
        ctx.save_for_backward(*saved)
        ctx.meta, ctx.gemm, ctx.recipe = meta, gemm, recipe
        ctx.dtypes = (inp.dtype, weight.dtype)
        ctx.needs = (need_dgrad, need_wgrad,
                     bias is not None and grad_enabled and ctx.needs_input_grad[2])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = _gemm_backward(grad_out, ctx.saved_tensors, ctx.meta, ctx.gemm, ctx.recipe,
                               ctx.needs, ctx.dtypes)
        return *grads, None, None, None, None, None


class _FP8GeluMLP(torch.autograd.Function):
    """gelu(inp @ w1^T + b1) @ w2^T [+ b2]: two FP8 GEMMs (the meta's 0 and 1) and the tanh
    GELU between them, as TE's fused MLP: FC2's input cast applies the GELU to FC1's output
    h, and FC1's output-gradient cast applies GELU's backward to FC2's input gradient and h,
    so neither gelu(h) nor dh is written in high precision. ``b2``: only a bias the GEMM's
    epilogue takes; ``b1`` goes into the epilogue where it fits, else is added to h."""

    @staticmethod
    def forward(ctx, inp, w1, b1, w2, b2, meta, forward_states, recipe, grad_enabled):
        def need(i):
            return grad_enabled and ctx.needs_input_grad[i]

        fc1_needs = (need(0), need(1), b1 is not None and need(2))
        # FC1's gradients all start from FC2's dgrad
        fc2_needs = (any(fc1_needs), need(3), b2 is not None and need(4))
        b1_in_gemm = b1 is not None and _bias_fits_epilogue(b1, inp.dtype)
        h, fc1_saved = _gemm_forward(inp, w1, b1 if b1_in_gemm else None, forward_states[0],
                                     0, recipe, *fc1_needs[:2])
        if b1 is not None and not b1_in_gemm:
            h = h + b1
        out, fc2_saved = _gemm_forward(h, w2, b2, forward_states[1], 1, recipe,
                                       *fc2_needs[:2], gelu=True)
        ctx.save_for_backward(*fc1_saved, *fc2_saved, h if fc2_needs[0] else None)
        ctx.meta, ctx.recipe, ctx.needs = meta, recipe, (fc1_needs, fc2_needs)
        ctx.dtypes = ((inp.dtype, w1.dtype), (h.dtype, w2.dtype))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        (fc1_needs, fc2_needs), (fc1_dtypes, fc2_dtypes) = ctx.needs, ctx.dtypes
        grad_gelu, grad_w2, grad_b2 = _gemm_backward(grad_out, saved[4:8], ctx.meta, 1,
                                                     ctx.recipe, fc2_needs, fc2_dtypes)
        grad_inp = grad_w1 = grad_b1 = None
        if any(fc1_needs):
            grad_inp, grad_w1, grad_b1 = _gemm_backward(grad_gelu, saved[:4], ctx.meta, 0,
                                                        ctx.recipe, fc1_needs, fc1_dtypes,
                                                        dgelu_input=saved[8])
        return grad_inp, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None, None


def _weight_fp8(state: _ForwardState, weight: torch.Tensor, gemm: int, recipe: Recipe,
                fp8_max, transpose: bool):
    """(FP8 weight, its transpose or None, inverse scale), cast once per step: cached by the
    weight's identity and version (an optimizer step bumps the version; a delayed scale update
    clears the cache). The transpose (for the dgrad) is cast with the weight where asked for;
    a cached cast without it is redone once with it."""
    key = (gemm, id(weight), weight._version)
    # A CUDA graph capture casts: its replays follow optimizer steps the version can't see
    capturing = weight.is_cuda and torch.cuda.is_current_stream_capturing()
    cached = state.weight_cache.get(gemm)
    if (not capturing and cached is not None and cached[0] == key
            and (cached[1][1] is not None or not transpose)):
        return cached[1]
    cast = _quantize(weight, Format.E4M3, fp8_max, recipe, state.amax_history, state.scale,
                     2 * gemm + 1, columnwise=transpose)
    if not capturing:  # (the capture's buffers belong to the graph)
        state.weight_cache[gemm] = (key, cast)
    return cast


def fp8_matmul(inp: torch.Tensor, weight: torch.Tensor, meta: FP8Meta, gemm: int = 0,
               bias: Optional[torch.Tensor] = None):
    """inp @ weight^T [+ bias] under the current autocast's recipe: FP8 with enabled=True (the
    input flattened to 2D for the GEMM; the bias added in the GEMM's epilogue where
    torch._scaled_mm takes it, else after the GEMM), high precision otherwise (amaxes recorded
    when calibrating)."""
    state = _STATE
    recipe = state.recipe
    if not state.enabled:
        # (a recomputation's amaxes would land in the next step's row)
        if state.calibrating and state.replaying is None:
            meta.record_forward(recipe, inp, weight, gemm)
        return torch.nn.functional.linear(inp, weight, bias)
    forward_state = _forward_state(meta, recipe, inp.device)
    fused_bias = bias if bias is not None and _bias_fits_epilogue(bias, inp.dtype) else None
    flat = inp.dim() == 2
    out = _FP8Matmul.apply(inp if flat else inp.reshape(-1, inp.shape[-1]), weight, fused_bias,
                           meta, forward_state, gemm, recipe, torch.is_grad_enabled())
    if not flat:
        out = out.reshape(*inp.shape[:-1], weight.shape[0])
    if bias is not None and fused_bias is None:
        out = out + bias
    return out


def fp8_gelu_mlp(inp: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: Optional[torch.Tensor],
                 fc2_weight: torch.Tensor, fc2_bias: Optional[torch.Tensor],
                 meta: FP8Meta) -> torch.Tensor:
    """gelu(inp @ fc1_weight^T + fc1_bias) @ fc2_weight^T [+ fc2_bias] (tanh GELU) inside an
    enabled FP8 autocast, FC1 and FC2 the meta's GEMMs 0 and 1 (LayerNormMLP's), with the
    GELU in FC2's input cast and its backward in FC1's gradient cast (_FP8GeluMLP)."""
    recipe = _STATE.recipe
    # one forward state per GEMM, in the GEMMs' order (a recomputation replays them)
    forward_states = [_forward_state(meta, recipe, inp.device) for _ in range(2)]
    fused_bias = (fc2_bias if fc2_bias is not None and _bias_fits_epilogue(fc2_bias, inp.dtype)
                  else None)
    out = _FP8GeluMLP.apply(inp.reshape(-1, inp.shape[-1]), fc1_weight, fc1_bias, fc2_weight,
                            fused_bias, meta, forward_states, recipe, torch.is_grad_enabled())
    out = out.reshape(*inp.shape[:-1], fc2_weight.shape[0])
    if fc2_bias is not None and fused_bias is None:
        out = out + fc2_bias
    return out


def _forward_state(meta: FP8Meta, recipe: Recipe, device: torch.device) -> _ForwardState:
    """The state an FP8 GEMM of this meta casts with: in a recomputation the one its forward
    recorded, else the meta's own (the meta joins the autocast's update). Each checkpointed
    region whose forward is running records the state for its recomputation (a region
    nested in a recomputation records the recorded one)."""
    state = _STATE
    if state.replaying is not None:
        forward_state = state.replaying.next_state(meta)
        recorded = forward_state
    else:
        meta._join(recipe, device)
        forward_state = meta.forward_state()
        recorded = meta._recompute_state() if state.recording else None
    for region in state.recording:
        region.gemms.append((meta, recorded))
    return forward_state


class CheckpointedRegion:
    """FP8 for one activation-checkpointed call (TE's checkpoint, LayerNormMLP's
    ``checkpoint=True``). Made when the call starts, it keeps the autocast's settings (the
    recomputation in the backward runs after the autocast exited) and, while ``forward()``
    runs the region, each FP8 GEMM's forward state: for delayed scaling the scales the
    forward cast with (the outermost autocast's exit updates them before the backward).
    ``recompute()`` re-enters those settings and casts with those scales; its amaxes go to
    scratch and its GEMMs join no autocast's update, so no autocast exit updates the forward
    scales a second time (TE's: the step's forward bookkeeping happened in the forward)."""

    def __init__(self) -> None:
        state = _STATE
        self.autocast = (state.enabled, state.calibrating, state.recipe, state.group)
        # a training forward (a reentrant checkpoint runs it under no_grad)
        self.training = torch.is_grad_enabled()
        self.gemms: List[Tuple[FP8Meta, _ForwardState]] = []

    @contextlib.contextmanager
    def forward(self):
        if not self.training:  # no recomputation will follow
            yield
            return
        recording = _STATE.recording
        recording.append(self)
        try:
            yield
        finally:
            recording.remove(self)

    @contextlib.contextmanager
    def recompute(self):
        state = _STATE
        saved = (state.enabled, state.calibrating, state.recipe, state.group, state.replaying)
        state.enabled, state.calibrating, state.recipe, state.group = self.autocast
        state.replaying = _Replay(self.gemms)
        try:
            yield
        finally:
            (state.enabled, state.calibrating, state.recipe, state.group,
             state.replaying) = saved


class _Replay:
    """A recomputation's walk through its forward's recorded FP8 GEMMs, in order."""

    def __init__(self, gemms: List[Tuple[FP8Meta, _ForwardState]]) -> None:
        self.gemms = gemms
        self.position = 0

    def next_state(self, meta: FP8Meta) -> _ForwardState:
        if self.position >= len(self.gemms) or self.gemms[self.position][0] is not meta:
            raise RuntimeError(
                f"checkpoint: the recomputation's FP8 GEMM number {self.position + 1} is not "
                f"the forward's (the forward ran {len(self.gemms)}); the checkpointed "
                f"function must run the same FP8 modules in the same order each time")
        self.position += 1
        return self.gemms[self.position - 1][1]
