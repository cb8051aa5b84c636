"""Tensor and sequence parallelism (TP/SP) over torch.distributed, with TE's conventions.

A column-parallel linear holds ``out_features / tp_size`` rows of the weight: its input is
replicated (or, with ``sequence_parallel``, gathered along the first dim) and its output stays
split along the features. A row-parallel linear holds ``in_features / tp_size`` columns: its
input is split along the features, its partial outputs are summed over the group with an
all-reduce (or, with ``sequence_parallel``, a reduce-scatter along the first dim) and its bias,
held whole, is added after the sum.

As in TE, sequence parallelism splits the *first* dim of the activations (the sequence for
``sbhd``, TE's layout for SP). Every collective is an autograd function whose backward is the
dual collective (all-gather <-> reduce-scatter, identity <-> all-reduce).

The weights are initialized as one rank would: every rank initializes the whole weight with
the same RNG draws and keeps its slice, so a TP model built after ``torch.manual_seed(s)`` holds
slices of the single-process model built after the same seed.
"""
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

PARALLEL_MODES = (None, "column", "row")


# ------------------------------------------------------------------------- configuration

def resolve_tp(owner: str, tp_group, tp_size: int, parallel_mode=None,
               sequence_parallel: bool = False) -> Tuple[int, int]:
    """Validates TE's TP arguments; returns (tp_size, tp_rank). The size is the group's
    (TE's rule); without a group it must be 1, since the weights are sliced by the rank."""
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"{owner}: parallel_mode must be one of {PARALLEL_MODES}, "
                         f"got {parallel_mode!r}")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"{owner}: sequence_parallel must be a bool, got "
                        f"{type(sequence_parallel).__name__}")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"{owner}: tp_size must be a positive int, got {tp_size!r}")
    if tp_group is None:
        if tp_size > 1:
            needs = "sequence_parallel=True and " if sequence_parallel else ""
            raise ValueError(
                f"{owner}: {needs}tp_size={tp_size} need a tp_group (a torch.distributed "
                f"ProcessGroup): transformer_fa slices the initial weights by the rank in "
                f"the group at construction")
        return 1, 0
    if not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(f"{owner}: tp_group must be a torch.distributed ProcessGroup or None, "
                        f"got {type(tp_group).__name__}")
    size = dist.get_world_size(tp_group)
    if tp_size not in (1, size):
        raise ValueError(f"{owner}: tp_size={tp_size} does not match tp_group, which has "
                         f"{size} ranks")
    return size, dist.get_rank(tp_group)


def check_new_group(owner: str, tp_group, tp_size: int, tp_rank: int) -> None:
    """``set_tensor_parallel_group`` may swap the group, not the size or the rank the
    weights were sliced for."""
    size, rank = resolve_tp(owner, tp_group, tp_size)
    if (size, rank) != (tp_size, tp_rank):
        raise ValueError(f"{owner}: the new tp_group gives (tp_size, rank) = ({size}, {rank}), "
                         f"but the weights were sliced for ({tp_size}, {tp_rank})")


def pop_layer_kwargs(kwargs: dict) -> dict:
    """TE's TP arguments of a layer (MultiheadAttention, TransformerLayer), taken out of its
    keyword arguments: tp_group, tp_size, sequence_parallel, set_parallel_mode."""
    return dict(tp_group=kwargs.pop("tp_group", None), tp_size=kwargs.pop("tp_size", 1),
                sequence_parallel=kwargs.pop("sequence_parallel", False),
                set_parallel_mode=kwargs.pop("set_parallel_mode", False))


def linear_kwargs(tp: dict) -> Tuple[dict, dict]:
    """The (column, row) TP arguments of a layer's input and output projections; with
    ``set_parallel_mode=False`` neither is split (TE's)."""
    common = dict(tp_group=tp["tp_group"], tp_size=tp["tp_size"],
                  sequence_parallel=tp["sequence_parallel"])
    if not tp["set_parallel_mode"]:
        return common, common
    return dict(common, parallel_mode="column"), dict(common, parallel_mode="row")


def set_group_on_submodules(module: torch.nn.Module, tp_group) -> None:
    """TE's set_tensor_parallel_group of a layer: every submodule that has one."""
    for child in module.modules():
        if child is not module and hasattr(child, "set_tensor_parallel_group"):
            child.set_tensor_parallel_group(tp_group)


def divide(value: int, tp_size: int, name: str, owner: str) -> int:
    if value % tp_size:
        raise ValueError(f"{owner}: {name}={value} must be divisible by tp_size={tp_size}")
    return value // tp_size


def shard_rows(full: torch.Tensor, parts: Sequence[int], tp_size: int, rank: int
               ) -> torch.Tensor:
    """This rank's rows of a column-parallel weight made of ``parts`` stacked along dim 0
    (e.g. an activation's and its gate's halves): the rank's chunk of each part, in order."""
    pieces = [part.chunk(tp_size, 0)[rank] for part in full.split(list(parts), 0)]
    return torch.cat(pieces, 0)


def check_first_dim(inp: torch.Tensor, tp_size: int, owner: str) -> None:
    """A row-parallel output reduce-scattered along the first dim must split evenly."""
    if inp.dim() < 2 or inp.shape[0] % tp_size:
        raise ValueError(f"{owner}: with sequence_parallel the input's first (sequence) dim "
                         f"must be divisible by tp_size={tp_size}, got shape {list(inp.shape)}")


def mark_sequence_parallel(*params: Optional[torch.nn.Parameter]) -> None:
    """TE's marker on parameters replicated over the TP group but fed only this rank's part of
    the sequence: their gradients are partial sums (see allreduce_sequence_parallel_grads)."""
    for param in params:
        if param is not None:
            param.sequence_parallel = True


def allreduce_sequence_parallel_grads(module: torch.nn.Module, tp_group) -> None:
    """Sums over the TP group the gradients of the parameters marked ``sequence_parallel``
    (norm weights, row-parallel biases): call it after backward, before the optimizer step, as
    Megatron-LM does for TE modules. A no-op without sequence parallelism."""
    for param in module.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=tp_group)


# -------------------------------------------------------------------------- communication

def _gather(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    size = dist.get_world_size(group)
    out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


class _GatherAlongDim(torch.autograd.Function):
    """Concatenates every rank's ``x`` along ``dim``; backward: sum over the ranks, keep this
    rank's part (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return torch.cat(_gather(x, group), dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.movedim(ctx.dim, 0)
        return _reduce_scatter(grad, ctx.group).movedim(0, ctx.dim), None, None


class _SplitAlongDim(torch.autograd.Function):
    """Keeps this rank's chunk of ``dim``; backward: all-gather (the input was replicated)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return x.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)]

    @staticmethod
    def backward(ctx, grad):
        return torch.cat(_gather(grad, ctx.group), ctx.dim), None, None


class _GatherToReplicated(_GatherAlongDim):
    """_GatherAlongDim's all-gather for a consumer that every rank runs alike (a replicated
    loss): backward keeps this rank's chunk of the gradient, with no sum."""

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, ctx.dim)[rank], None, None


class _ReduceScatterFirstDim(torch.autograd.Function):
    """Sums over the ranks and keeps this rank's chunk of the first dim; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return torch.cat(_gather(grad, ctx.group), 0), None


class _AllReduce(torch.autograd.Function):
    """Sum over the ranks; backward: identity (each rank's output feeds the same loss)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    """Identity; backward: sum the gradients over the ranks (each used a part of the weight)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


def gather_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather whose backward sums the gradients over the ranks (a reduce-scatter)."""
    return _GatherAlongDim.apply(x, dim, group)


def scatter_to_sequence_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """A replicated activation -> this rank's part of the first dim (backward: all-gather),
    e.g. the embedding's output entering a sequence-parallel stack."""
    return _SplitAlongDim.apply(x, 0, group)


def gather_from_sequence_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """The parts of the first dim -> the whole, for a consumer that every rank runs alike
    (e.g. the final norm and the loss after a sequence-parallel stack)."""
    return _GatherToReplicated.apply(x, 0, group)


def column_parallel_input(inp: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The input of a column-parallel GEMM: gathered along the first dim (SP) or replicated."""
    if group is None or dist.get_world_size(group) == 1:
        return inp
    if sequence_parallel:
        return _GatherAlongDim.apply(inp, 0, group)
    return _CopyToGroup.apply(inp, group)


def row_parallel_output(out: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The output of a row-parallel GEMM: reduce-scattered along the first dim (SP) or
    all-reduced."""
    if group is None or dist.get_world_size(group) == 1:
        return out
    if sequence_parallel:
        return _ReduceScatterFirstDim.apply(out, group)
    return _AllReduce.apply(out, group)


__all__ = ["allreduce_sequence_parallel_grads", "column_parallel_input", "gather_along_dim",
           "gather_from_sequence_parallel", "row_parallel_output", "resolve_tp",
           "scatter_to_sequence_parallel"]
