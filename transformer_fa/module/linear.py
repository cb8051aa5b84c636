"""Linear, LayerNormLinear and LayerNormMLP with TransformerEngine's arguments and parameter names.

Parameter names follow TE so state dicts line up: ``weight``/``bias``; with ``parameters_split``
one ``<name>_weight``/``<name>_bias`` per split (e.g. ``query_weight``); the norm of the fused
modules is ``layer_norm_weight``/``layer_norm_bias``; the MLP has ``fc1_*`` and ``fc2_*``.
"""
from collections import OrderedDict
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .. import distributed, fp8, kernels, parallel
from ._common import (
    FollowsParamsDtype,
    check_device,
    check_hidden_states,
    check_no_fp8_tensors,
    check_positive_int,
    check_te_only_kwargs,
    default_init_method,
    pack_outputs,
    resolve_dtype,
)
from .activations import get_activation
from .layernorm import apply_add_norm, apply_norm, make_norm_params


def parallel_linear(inp, weight, bias, return_bias=False, row_group=None,
                    sequence_parallel=False, fp8_meta=None, gemm=0):
    """(x W^T [+ b], bias or None): the bias is returned instead of added if ``return_bias``.
    With a ``row_group`` (row-parallel) the partial outputs are summed over the group first
    (reduce-scattered along the first dim with ``sequence_parallel``), then the bias added.
    Inside an FP8 (or calibrating) autocast, x W^T is ``fp8.fp8_matmul`` with the module's
    ``fp8_meta``, which adds the bias (in its GEMM's epilogue where it can) unless the bias
    is returned or must wait for the reduction."""
    quantized = fp8_meta is not None and fp8.fp8_active()
    if not return_bias and row_group is None:  # the bias goes into the GEMM
        if quantized:
            return fp8.fp8_matmul(inp, weight, fp8_meta, gemm, bias=bias), None
        if kernels.use_bias_grad_kernels(inp, weight, bias):
            return _LinearBiasGrad.apply(inp, weight, bias), None
        return F.linear(inp, weight, bias), None
    out = fp8.fp8_matmul(inp, weight, fp8_meta, gemm) if quantized else F.linear(inp, weight)
    return reduce_and_add_bias(out, bias, return_bias, row_group, sequence_parallel)


def reduce_and_add_bias(out, bias, return_bias, row_group, sequence_parallel):
    """parallel_linear's end for a GEMM output without its bias: the row-parallel reduction,
    then the bias added or returned."""
    if row_group is not None:
        out = parallel.row_parallel_output(out, row_group, sequence_parallel)
    if bias is None:
        return out, None
    if return_bias:
        return out, bias.to(out.dtype)
    return out + bias, None


# The Functions below compute x W^T + b as F.linear does (the bias in cuBLAS's epilogue) and
# its input and weight gradients with autograd's GEMMs, but the bias gradient, autograd's
# g.sum(0) at about half of the memory bandwidth, with the column-sum kernels (TE's dbias).
# kernels.use_bias_grad_kernels says where they serve.

def _save_gemm_operands(ctx, inp, weight, *others) -> None:
    """What x W^T's gradients read, as autograd keeps them: x for dW, W for dx."""
    needs_dx, needs_dw = ctx.needs_input_grad[:2]
    ctx.save_for_backward(inp if needs_dw else None, weight if needs_dx else None, *others)
    ctx.inp_shape = inp.shape


def _gemm_grads(ctx, grad2d: torch.Tensor, inp, weight):
    """(dx, dW) of x W^T from the [tokens, out_features] output gradient, the GEMMs autograd
    runs for F.linear over the flattened tokens (dx = g W, dW = g^T x); None where not
    needed. (ctx.saved_tensors is read once per backward: checkpointing allows no more.)"""
    needs_dx, needs_dw = ctx.needs_input_grad[:2]
    dx = (grad2d @ weight).view(ctx.inp_shape) if needs_dx else None
    dw = grad2d.t() @ inp.reshape(-1, inp.shape[-1]) if needs_dw else None
    return dx, dw


def _rows(grad: torch.Tensor) -> torch.Tensor:
    """The output gradient as a contiguous [tokens, features] matrix."""
    return grad.reshape(-1, grad.shape[-1]).contiguous()


class _LinearBiasGrad(torch.autograd.Function):
    """y = x W^T + b, the bias gradient summed by column_sum."""

    @staticmethod
    def forward(ctx, inp, weight, bias):
        _save_gemm_operands(ctx, inp, weight)
        return F.linear(inp, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        from ..kernels.bias_grad import column_sum

        grad2d = _rows(grad)
        return *_gemm_grads(ctx, grad2d, *ctx.saved_tensors), column_sum(grad2d)


class _LinearGelu(torch.autograd.Function):
    """y = gelu(x W^T + b) (tanh GELU, the Triton kernel's): the backward computes GELU's
    gradient and the bias gradient in one pass over the gradient and the saved GEMM output
    (TE's dgelu + dbias)."""

    @staticmethod
    def forward(ctx, inp, weight, bias):
        from ..kernels.bias_grad import gelu as gelu_kernel

        pre_activation = F.linear(inp, weight, bias)
        _save_gemm_operands(ctx, inp, weight, pre_activation)
        return gelu_kernel(pre_activation)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        from ..kernels.bias_grad import dgelu_column_sum

        inp, weight, pre_activation = ctx.saved_tensors
        grad_pre, grad_bias = dgelu_column_sum(_rows(grad), _rows(pre_activation))
        return *_gemm_grads(ctx, grad_pre, inp, weight), grad_bias


class _JoinRows(torch.autograd.Function):
    """torch.cat along dim 0 of tensors that lie back to back in one buffer: a view of it."""

    @staticmethod
    def forward(ctx, *parts):
        ctx.rows = [p.shape[0] for p in parts]
        return _joined_view(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad.split(ctx.rows)


def _joined_view(parts: List[torch.Tensor]) -> torch.Tensor:
    first = parts[0]
    return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride(),
                            first.storage_offset())


def _back_to_back(parts: List[torch.Tensor]) -> bool:
    """Whether ``parts`` are contiguous and follow one another in one storage."""
    first = parts[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for p in parts:
        if (not p.is_contiguous() or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]
                or p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset):
            return False
        offset += p.numel()
    return True


def join_rows(parts: List[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) along dim 0, without a copy where the parts are views of one buffer
    (a split Linear's parameters, unless something, e.g. ``.to()``, moved them apart)."""
    if len(parts) == 1:
        return parts[0]
    if not torch.compiler.is_compiling() and _back_to_back(parts):
        if not (torch.is_grad_enabled() and any(p.requires_grad for p in parts)):
            return _joined_view(parts)  # no autograd node to build (inference)
        return _JoinRows.apply(*parts)
    return torch.cat(parts, dim=0)


def _split_sizes(parameters_split, out_features: int) -> List[Tuple[str, int]]:
    """TE's parameters_split: a tuple of names (equal split) or a dict name -> size."""
    if parameters_split is None:
        return [("", out_features)]
    if isinstance(parameters_split, (tuple, list)):
        if len(parameters_split) == 0 or out_features % len(parameters_split) != 0:
            raise ValueError(
                f"parameters_split {tuple(parameters_split)} must split out_features="
                f"{out_features} into equal parts"
            )
        size = out_features // len(parameters_split)
        splits = [(name, size) for name in parameters_split]
    elif isinstance(parameters_split, dict):
        splits = list(parameters_split.items())
        if sum(size for _, size in splits) != out_features:
            raise ValueError(
                f"parameters_split sizes {dict(splits)} must add up to out_features={out_features}"
            )
    else:
        raise TypeError("parameters_split must be None, a tuple of names or a dict of sizes")
    return [(name.rstrip("_") + "_", size) for name, size in splits]


class _FP8State:
    """TE's per-module FP8 state: scales and amax histories (``fp8_meta``), kept in the
    module's extra state so that checkpoints carry them."""

    def _init_fp8(self, num_gemms: int) -> None:
        self.fp8_meta = fp8.FP8Meta(num_gemms)

    def _check_fp8_shapes(self, inp: torch.Tensor, *features: int) -> None:
        """The GEMMs' in/out features and the tokens fit torch._scaled_mm (before any runs)."""
        if fp8.fp8_enabled():
            fp8.check_fp8_gemm_shape(inp, (inp.shape[-1],) + features, type(self).__name__)

    def get_extra_state(self) -> torch.Tensor:
        return self.fp8_meta.get_extra_state()

    def set_extra_state(self, state) -> None:
        device = next(self.parameters()).device
        self.fp8_meta.set_extra_state(state, device)


class _TensorParallel:
    """TE's tensor-parallel state of a module: group, size, rank, mode, sequence_parallel."""

    _TP_KWARGS = ("tp_group", "tp_size", "parallel_mode", "sequence_parallel")

    def _init_tensor_parallel(self, owner, tp_group=None, tp_size=1, parallel_mode=None,
                              sequence_parallel=False) -> None:
        self.tp_size, self.tp_rank = parallel.resolve_tp(owner, tp_group, tp_size,
                                                         parallel_mode, sequence_parallel)
        self.tp_group = tp_group
        self.parallel_mode = parallel_mode
        self.sequence_parallel = sequence_parallel and self.tp_size > 1  # TE's rule

    def set_tensor_parallel_group(self, tp_group) -> None:
        """TE's: the group to communicate over (same size and rank as at construction)."""
        parallel.check_new_group(type(self).__name__, tp_group, self.tp_size, self.tp_rank)
        self.tp_group = tp_group


class Linear(_FP8State, _TensorParallel, FollowsParamsDtype, torch.nn.Module):
    """y = x W^T + b, TE's ``Linear`` on a single device."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parameters_split: Optional[Union[Tuple[str, ...], "OrderedDict[str, int]"]] = None,
        device: Union[torch.device, str] = "cuda",
        **te_kwargs,
    ) -> None:
        super().__init__()
        self._init_linear(in_features, out_features, init_method, bias, return_bias,
                          params_dtype, parameters_split, device, te_kwargs)

    def _init_linear(self, in_features, out_features, init_method, bias, return_bias,
                     params_dtype, parameters_split, device, te_kwargs) -> None:
        owner = type(self).__name__
        # Internal: the parts of a fused weight that shard separately (a gate's halves, the
        # q/k/v blocks of a non-interleaved fused projection); a split's parts by default.
        shard_parts = te_kwargs.pop("_tp_shard_parts", None)
        tp = {key: te_kwargs.pop(key) for key in self._TP_KWARGS if key in te_kwargs}
        check_te_only_kwargs(te_kwargs, owner)
        check_device(device)
        check_positive_int(in_features, "in_features")
        check_positive_int(out_features, "out_features")
        self._init_tensor_parallel(owner, **tp)
        mode, tp_size = self.parallel_mode, self.tp_size
        self.use_bias = bias
        self.return_bias = return_bias
        self.params_dtype = dtype = resolve_dtype(params_dtype)
        init_method = init_method if init_method is not None else default_init_method()

        # Init the whole weight, then split it: an init that depends on the shape
        # (e.g. xavier) sees the same matrix TE's does, and under tensor parallelism each
        # rank keeps its slice of the very weight one process would have.
        weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
        init_method(weight)
        splits = _split_sizes(parameters_split, out_features)
        if mode == "column":
            for name, size in splits:
                parallel.divide(size, tp_size, f"out_features{' of ' + name if name else ''}",
                                owner)
            splits = [(name, size // tp_size) for name, size in splits]
            parts = [n * tp_size for _, n in splits] if shard_parts is None else shard_parts
            weight = parallel.shard_rows(weight, parts, tp_size, self.tp_rank)
            out_features //= tp_size
        elif mode == "row":
            in_features = parallel.divide(in_features, tp_size, "in_features", owner)
            weight = weight.chunk(tp_size, 1)[self.tp_rank]
        self._init_fp8(num_gemms=1)
        self.in_features = in_features  # this rank's, as TE's
        self.out_features = out_features
        self._weight_names = [prefix + "weight" for prefix, _ in splits]
        self._bias_names = [prefix + "bias" for prefix, _ in splits] if bias else []
        # TE's registration order, all weights then all biases: optimizer states, which
        # follow parameters(), then carry over from TE.
        # The splits are views of one buffer, back to back, so that full_weight() and
        # full_bias() are views of it too: no copy each forward, none kept for the backward.
        sizes = [n for _, n in splits]
        weights = weight.clone(memory_format=torch.contiguous_format).split(sizes)
        for name, part in zip(self._weight_names, weights):
            self.register_parameter(name, torch.nn.Parameter(part))
        # A row-parallel bias is whole: added once, after the sum over the ranks.
        biases = torch.zeros(sum(sizes), dtype=dtype, device=device).split(sizes)
        for name, part in zip(self._bias_names, biases):
            self.register_parameter(name, torch.nn.Parameter(part))
        if not bias and parameters_split is None:
            self.register_parameter("bias", None)
        if mode in ("column", "row") and tp_size > 1:
            # TE's (and Megatron's) markers of a weight split over the TP group.
            for name in self._weight_names + (self._bias_names if mode == "column" else []):
                getattr(self, name).tensor_model_parallel = True
                getattr(self, name).partition_dim = 0 if mode == "column" else 1
        if mode == "row" and self.sequence_parallel:
            parallel.mark_sequence_parallel(*(getattr(self, n) for n in self._bias_names))

    def _cat(self, names: List[str]) -> Optional[torch.Tensor]:
        if not names:
            return None
        return join_rows([getattr(self, n) for n in names])

    def full_weight(self) -> torch.Tensor:
        """The [out_features, in_features] weight, splits concatenated."""
        return self._cat(self._weight_names)

    def full_bias(self) -> Optional[torch.Tensor]:
        return self._cat(self._bias_names)

    def _apply(self, fn, *args, **kwargs):
        """.to(), .cuda(), .half() ... convert each parameter on its own: put the splits back
        into one buffer, so that the joins stay views (the parameters stay the same objects)."""
        module = super()._apply(fn, *args, **kwargs)
        for names in (self._weight_names, self._bias_names):
            params = [getattr(self, name) for name in names]
            if len(params) > 1 and not _back_to_back(params):
                with torch.no_grad():
                    parts = torch.cat(params).split([p.shape[0] for p in params])
                for param, part in zip(params, parts):
                    param.data = part
        return module

    def _project(self, inp: torch.Tensor):
        """(x W^T [+ b], bias) where the bias is returned, not added, if return_bias."""
        return self._gemm(self._parallel_input(inp))

    def _parallel_input(self, inp: torch.Tensor) -> torch.Tensor:
        if self.parallel_mode != "column":
            return inp
        return parallel.column_parallel_input(inp, self.tp_group, self.sequence_parallel)

    def _gemm(self, inp: torch.Tensor):
        """The input is made contiguous first, as TE's GEMMs read it: the weight gradient's
        GEMM then sums in the same order whatever the input's strides (bitwise equal)."""
        row_group = self.tp_group if self.parallel_mode == "row" else None
        return parallel_linear(inp.contiguous(), self.full_weight(), self.full_bias(),
                               self.return_bias, row_group, self.sequence_parallel,
                               self.fp8_meta)

    def _check_input(self, inp: torch.Tensor) -> None:
        check_hidden_states(inp, self.in_features, self.params_dtype, "inp")
        self._check_fp8_shapes(inp, self.out_features)
        if self.parallel_mode == "row" and self.sequence_parallel:
            parallel.check_first_dim(inp, self.tp_size, type(self).__name__)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: Optional[bool] = False, fp8_grad: Optional[bool] = False):
        check_no_fp8_tensors(type(self).__name__, fp8_output, fp8_grad)
        self._check_input(inp)
        out, bias = self._project(inp)
        return pack_outputs(out, bias, return_bias=self.return_bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}")


class LayerNormLinear(Linear):
    """Norm then Linear, TE's ``LayerNormLinear``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_layernorm_output: bool = False,
        parameters_split: Optional[Union[Tuple[str, ...], "OrderedDict[str, int]"]] = None,
        zero_centered_gamma: bool = False,
        device: Union[torch.device, str] = "cuda",
        **te_kwargs,
    ) -> None:
        torch.nn.Module.__init__(self)
        check_device(device)
        # The norm's parameters come first, as TE registers them.
        self.layer_norm_weight, layer_norm_bias = make_norm_params(
            in_features, normalization, zero_centered_gamma, params_dtype, device
        )
        self.register_parameter("layer_norm_bias", layer_norm_bias)
        self.return_layernorm_output_gathered = te_kwargs.pop(
            "return_layernorm_output_gathered", False)
        if te_kwargs.get("parallel_mode") == "row":
            raise ValueError("LayerNormLinear: parallel_mode='row' would normalize a part of "
                             "the features; use 'column' (or None)")
        self._init_linear(in_features, out_features, init_method, bias, return_bias,
                          params_dtype, parameters_split, device, te_kwargs)
        if self.sequence_parallel:  # the norm sees this rank's part of the sequence
            parallel.mark_sequence_parallel(self.layer_norm_weight, self.layer_norm_bias)
        self.eps = eps
        self.normalization = normalization
        self.zero_centered_gamma = zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None,
                fp8_output: Optional[bool] = False, fp8_grad: Optional[bool] = False, *,
                _pass_input: bool = False):
        """With sequence_parallel the norm runs on this rank's part of the sequence and its
        output is gathered for the GEMM; the layernorm output returned is this rank's part
        unless return_layernorm_output_gathered (TE's). ``_pass_input`` (not TE's):
        ``(outputs, inp)`` for a caller that uses inp again (TransformerLayer's residual), inp
        handed back out of the norm, whose backward then adds that use's gradient into its
        own (apply_norm's ``pass_input``)."""
        check_no_fp8_tensors(type(self).__name__, fp8_output, fp8_grad)
        self._check_input(inp)
        ln_out = apply_norm(inp, self.normalization, self.layer_norm_weight,
                            self.layer_norm_bias, self.eps, self.zero_centered_gamma,
                            _pass_input)
        if _pass_input:
            ln_out, inp = ln_out
        gathered = self._parallel_input(ln_out)
        out, bias = self._gemm(gathered)
        if self.return_layernorm_output_gathered:
            ln_out = gathered
        outputs = pack_outputs(out, bias, ln_out, self.return_bias, self.return_layernorm_output)
        return (outputs, inp) if _pass_input else outputs


class LayerNormMLP(_FP8State, _TensorParallel, FollowsParamsDtype, torch.nn.Module):
    """Norm -> FC1 -> activation -> FC2, TE's ``LayerNormMLP``.

    For gated activations (geglu, reglu, swiglu, ...) FC1 has 2 * ffn_hidden_size outputs.
    ``activation_params`` are TE's (``clamped_swiglu``: limit, alpha, glu_linear_offset);
    ``checkpoint=True`` recomputes the MLP in the backward instead of keeping its activations.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        return_bias: bool = False,
        init_method: Optional[Callable] = None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        activation_params: Optional[dict] = None,
        output_layer_init_method: Optional[Callable] = None,
        params_dtype: Optional[torch.dtype] = None,
        return_layernorm_output: bool = False,
        zero_centered_gamma: bool = False,
        device: Union[torch.device, str] = "cuda",
        checkpoint: bool = False,
        **te_kwargs,
    ) -> None:
        super().__init__()
        set_parallel_mode = te_kwargs.pop("set_parallel_mode", False)
        self.return_layernorm_output_gathered = te_kwargs.pop(
            "return_layernorm_output_gathered", False)
        tp = {key: te_kwargs.pop(key) for key in ("tp_group", "tp_size", "sequence_parallel")
              if key in te_kwargs}
        check_te_only_kwargs(te_kwargs, type(self).__name__)
        check_device(device)
        check_positive_int(hidden_size, "hidden_size")
        check_positive_int(ffn_hidden_size, "ffn_hidden_size")
        self._init_tensor_parallel(type(self).__name__, **tp)
        self.set_parallel_mode = set_parallel_mode
        if set_parallel_mode:
            parallel.divide(ffn_hidden_size, self.tp_size, "ffn_hidden_size", type(self).__name__)
        # set_parallel_mode: FC1 column-parallel, FC2 row-parallel (TE's).
        fc1_tp = dict(tp, parallel_mode="column" if set_parallel_mode else None)
        fc2_tp = dict(tp, parallel_mode="row" if set_parallel_mode else None)
        self.activation_fn, gated = get_activation(activation, activation_params)
        self.activation = activation
        self.activation_params = activation_params
        self.checkpoint = checkpoint
        self.params_dtype = resolve_dtype(params_dtype)
        self._init_fp8(num_gemms=2)  # FC1 is GEMM 0, FC2 GEMM 1
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.eps = eps
        self.normalization = normalization
        self.zero_centered_gamma = zero_centered_gamma
        self.return_bias = return_bias
        self.return_layernorm_output = return_layernorm_output
        self.use_bias = bias

        self.layer_norm_weight, layer_norm_bias = make_norm_params(
            hidden_size, normalization, zero_centered_gamma, params_dtype, device
        )
        self.register_parameter("layer_norm_bias", layer_norm_bias)
        fc1_out = 2 * ffn_hidden_size if gated else ffn_hidden_size
        # Reuse Linear for parameter creation; keep TE's flat fc1_*/fc2_* names on this module.
        # A gated FC1 shards its activation and gate halves separately, so that each rank
        # gates its own part of the hidden features.
        fc1 = Linear(
            hidden_size, fc1_out, init_method, bias, params_dtype=params_dtype, device=device,
            _tp_shard_parts=(ffn_hidden_size, ffn_hidden_size) if gated else None, **fc1_tp
        )
        fc2 = Linear(
            ffn_hidden_size,
            hidden_size,
            output_layer_init_method,
            bias,
            params_dtype=params_dtype,
            device=device,
            **fc2_tp,
        )
        for prefix, linear in (("fc1_", fc1), ("fc2_", fc2)):
            self.register_parameter(prefix + "weight", linear.weight)
            self.register_parameter(prefix + "bias", linear.bias)
        if self.sequence_parallel:  # the norm sees this rank's part of the sequence
            parallel.mark_sequence_parallel(self.layer_norm_weight, self.layer_norm_bias)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        check_hidden_states(inp, self.hidden_size, self.params_dtype, "inp")
        self._check_fp8_shapes(inp, *self.fc1_weight.shape[:1], *self.fc2_weight.shape)
        if self.checkpoint and torch.is_grad_enabled():
            # TE's checkpoint: the recomputation runs in the forward's FP8 autocast state
            return distributed.checkpoint(self._forward, inp, use_reentrant=False)
        return self._forward(inp)

    def add_residual_then_forward(self, inp: torch.Tensor, residual: torch.Tensor):
        """(forward(inp + residual), inp + residual): TransformerLayer's residual add before
        this MLP, fused into its norm (apply_add_norm)."""
        check_hidden_states(inp, self.hidden_size, self.params_dtype, "inp")
        self._check_fp8_shapes(inp, *self.fc1_weight.shape[:1], *self.fc2_weight.shape)
        if self.checkpoint and torch.is_grad_enabled():
            return distributed.checkpoint(self._forward, inp, residual, use_reentrant=False)
        return self._forward(inp, residual)

    def _forward(self, inp: torch.Tensor, residual: Optional[torch.Tensor] = None):
        norm_args = (self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                     self.zero_centered_gamma)
        if residual is None:
            ln_out = apply_norm(inp, *norm_args)
        else:
            ln_out, inp = apply_add_norm(inp, residual, *norm_args)
        gathered = ln_out
        if self.set_parallel_mode:
            gathered = parallel.column_parallel_input(ln_out, self.tp_group,
                                                      self.sequence_parallel)
        row_group = self.tp_group if self.set_parallel_mode else None
        if self._fuses_fp8_gelu():
            # the bias goes into the GEMMs unless returned or reduced first
            fc2_bias = None if self.return_bias or row_group is not None else self.fc2_bias
            out = fp8.fp8_gelu_mlp(gathered, self.fc1_weight, self.fc1_bias, self.fc2_weight,
                                   fc2_bias, self.fp8_meta)
            out, bias = reduce_and_add_bias(out, None if fc2_bias is not None else self.fc2_bias,
                                            self.return_bias, row_group, self.sequence_parallel)
        else:
            hidden = self._fc1_and_activation(gathered)
            out, bias = parallel_linear(hidden, self.fc2_weight, self.fc2_bias,
                                        self.return_bias, row_group, self.sequence_parallel,
                                        self.fp8_meta, gemm=1)
        if self.return_layernorm_output_gathered:
            ln_out = gathered
        outputs = pack_outputs(out, bias, ln_out, self.return_bias, self.return_layernorm_output)
        return outputs if residual is None else (outputs, inp)

    def _fuses_fp8_gelu(self) -> bool:
        """Inside an FP8 autocast FC1, GELU and FC2 run as one FP8 Function with the GELU in
        FC2's input cast and its backward in FC1's gradient cast (fp8.fp8_gelu_mlp; TE's
        fused activation casts)."""
        return self.activation == "gelu" and fp8.fp8_enabled()

    def _fc1_and_activation(self, inp: torch.Tensor) -> torch.Tensor:
        if (self.activation == "gelu" and not fp8.fp8_active()
                and kernels.use_bias_grad_kernels(inp, self.fc1_weight, self.fc1_bias)):
            return _LinearGelu.apply(inp, self.fc1_weight, self.fc1_bias)
        fc1_out, _ = parallel_linear(inp, self.fc1_weight, self.fc1_bias,
                                     fp8_meta=self.fp8_meta, gemm=0)
        return self.activation_fn(fc1_out)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation!r}, normalization={self.normalization!r}"
        )
