"""Tensor and sequence parallelism over gloo (2 ranks): every TP module's output, input gradient
and parameter gradients must equal the matching slices of a single-process run of the module
built with the same seed (float64); DDP (and FSDP2) training steps must give the losses of one
process on the same global batch. One spawn runs every case (tests/distributed_utils.py).
"""
import pytest
import torch
import torch.distributed as dist

from distributed_utils import assert_case_passed, close, no_communication, run_cases

import transformer_fa as te
from transformer_fa import parallel

SEQ, BATCH, HIDDEN, HEADS, GROUPS = 4, 2, 16, 4, 2
F64 = dict(params_dtype=torch.float64, device="cpu")


def build(cls, *args, seed=0, **kwargs):
    torch.manual_seed(seed)
    return cls(*args, **F64, **kwargs)


def slice_maps(module, reference):
    """Where each of this rank's parameters comes from in the single-process module: a flat
    index into the reference weight (weights hold unique random values, so the values say),
    the reference rows of a column-parallel bias, or None for a parameter held whole."""
    ref = dict(reference.named_parameters())
    maps = {}
    for name, param in module.named_parameters():
        if param.shape == ref[name].shape:
            maps[name] = None
        elif param.dim() == 2:
            where = {v: i for i, v in enumerate(ref[name].flatten().tolist())}
            maps[name] = torch.tensor([where[v] for v in param.flatten().tolist()]).view(
                param.shape)
    for name, param in module.named_parameters():
        if name not in maps:  # a column-parallel bias follows its weight's rows
            weight = name[: -len("bias")] + "weight"
            maps[name] = maps[weight][:, 0] // ref[weight].shape[1]
    return maps


def sliced(tensor, index):
    if index is None:
        return tensor
    return tensor.flatten()[index] if index.dim() == 2 else tensor[index]


def randomize_whole_and_bias(module, reference, maps):
    """Norm weights and biases start at 1 and 0: give them random values (the same on both
    sides) so that the test sees them."""
    ref = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in module.named_parameters():
            if maps[name] is None or maps[name].dim() == 1:
                ref[name].copy_(torch.randn_like(ref[name]))
                param.copy_(sliced(ref[name], maps[name]))


def compare(world, rank, group, make, split_in, split_out, inputs=1, sp=False, kwargs=None,
            shape=(SEQ, BATCH, HIDDEN), device="cpu", dtype=torch.float64, tol=None):
    """Runs ``make(tp_kwargs)`` with and without TP on the same full input and checks output,
    input gradients, and parameter gradients (against the reference's, sliced).
    split_in/split_out: how this rank's tensors relate to the full ones: "seq" (chunk of the
    first dim), "features" (chunk of the last dim), "rows" (the weight's output rows), None.
    ``make`` builds in float64 on the CPU (the slices are found by value); both modules then
    run on ``device`` in ``dtype``, compared with tolerance ``tol`` (atol = rtol) or close()'s
    default. ``shape``: the full input's."""
    reference = make({})
    module = make(dict(tp_group=group, sequence_parallel=sp))
    maps = slice_maps(module, reference)
    covered = [None] * world  # every reference element is on exactly one rank
    dist.all_gather_object(covered, {n: m.flatten().tolist() for n, m in maps.items()
                                     if m is not None and m.dim() == 2})
    for name, ref_param in reference.named_parameters():
        if name in covered[0]:
            assert sorted(sum((c[name] for c in covered), [])) == list(
                range(ref_param.numel())), f"{name} is not split over the ranks"
    randomize_whole_and_bias(module, reference, maps)
    reference.to(device, dtype)
    module.to(device, dtype)
    maps = {name: None if index is None else index.to(device) for name, index in maps.items()}

    def local(full, how, rows=None):
        if how == "seq":
            return full.chunk(world, 0)[rank]
        if how == "features":
            return full.chunk(world, -1)[rank]
        if how == "rows":
            return full[..., rows]
        return full

    torch.manual_seed(1)
    xs = [torch.randn(shape, dtype=torch.float64).to(device, dtype).requires_grad_()
          for _ in range(inputs)]
    out_full = reference(*xs, **(kwargs or {}))
    rows = maps.get("weight", None)
    rows = None if rows is None else rows[:, 0] // reference.weight.shape[1]
    dout = torch.randn(out_full.shape, dtype=torch.float64).to(device, dtype)
    (out_full * dout).sum().backward()
    xs_local = [local(x.detach(), split_in).requires_grad_() for x in xs]
    out = module(*xs_local, **(kwargs or {}))
    (out * local(dout, split_out, rows)).sum().backward()
    close(out, local(out_full, split_out, rows), "output", tol=tol)
    for i, (mine, x) in enumerate(zip(xs_local, xs)):
        close(mine.grad, local(x.grad, split_in), f"grad of input {i}", tol=tol)
    parallel.allreduce_sequence_parallel_grads(module, group)
    ref = dict(reference.named_parameters())
    for name, param in module.named_parameters():
        close(param.grad, sliced(ref[name].grad, maps[name]), f"grad of {name}", tol=tol)


def linear_case(mode, sp, bias):
    def make(tp):
        mode_kwargs = dict(parallel_mode=mode) if tp else {}
        return build(te.Linear, HIDDEN, 2 * HIDDEN if mode == "column" else HIDDEN, bias=bias,
                     **mode_kwargs, **tp)

    def run(world, rank, group):
        if mode == "column":
            compare(world, rank, group, make, "seq" if sp else None, "rows", sp=sp)
        else:
            compare(world, rank, group, make, "features", "seq" if sp else None, sp=sp)
    return run


def layernorm_linear_case(sp, normalization):
    def make(tp):
        mode_kwargs = dict(parallel_mode="column") if tp else {}
        return build(te.LayerNormLinear, HIDDEN, 2 * HIDDEN, normalization=normalization,
                     **mode_kwargs, **tp)
    return lambda world, rank, group: compare(world, rank, group, make,
                                              "seq" if sp else None, "rows", sp=sp)


def layer_case(cls, sp, args, **layer_kwargs):
    """LayerNormMLP, MultiheadAttention or TransformerLayer with set_parallel_mode: input and
    output both whole (or this rank's part of the sequence with sequence_parallel)."""
    def make(tp):
        mode_kwargs = dict(set_parallel_mode=True) if tp else {}
        return build(cls, *args, **layer_kwargs, **mode_kwargs, **tp)
    how = "seq" if sp else None
    return lambda world, rank, group: compare(world, rank, group, make, how, how,
                                              sp=sp)


CASES = {}
for _sp in (False, True):
    _tag = "sp" if _sp else "tp"
    for _bias in (False, True):
        for _mode in ("column", "row"):
            CASES[f"linear-{_mode}-{_tag}-bias{int(_bias)}"] = linear_case(_mode, _sp, _bias)
    CASES[f"layernorm_linear-{_tag}"] = layernorm_linear_case(_sp, "LayerNorm")
    CASES[f"layernorm_mlp-gelu-{_tag}"] = layer_case(te.LayerNormMLP, _sp,
                                                   args=(HIDDEN, 2 * HIDDEN))
    CASES[f"layernorm_mlp-swiglu-rms-{_tag}"] = layer_case(
        te.LayerNormMLP, _sp, args=(HIDDEN, 2 * HIDDEN), activation="swiglu",
        normalization="RMSNorm")
    CASES[f"mha-{_tag}"] = layer_case(te.MultiheadAttention, _sp, args=(HIDDEN, HEADS),
                                      num_gqa_groups=GROUPS, attention_dropout=0.0,
                                      input_layernorm=True)
    CASES[f"mha-fused-{_tag}"] = layer_case(
        te.MultiheadAttention, _sp, args=(HIDDEN, HEADS), num_gqa_groups=GROUPS,
        attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=_sp)
    CASES[f"transformer_layer-{_tag}"] = layer_case(
        te.TransformerLayer, _sp, args=(HIDDEN, 2 * HIDDEN, HEADS), num_gqa_groups=GROUPS,
        hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=_sp, activation="swiglu")
CASES["layernorm_linear-rms-sp"] = layernorm_linear_case(True, "RMSNorm")
# L2Normalization of q and k (no weights) splits with the heads
CASES["mha-l2-qk-norm-tp"] = layer_case(te.MultiheadAttention, False, args=(HIDDEN, HEADS),
                                        num_gqa_groups=GROUPS, attention_dropout=0.0,
                                        qk_norm_type="L2Normalization")


def errors_case(world, rank, group):
    """Bad TP configuration or input: a clear error, before any communication."""
    x = torch.randn(SEQ + 1, BATCH, HIDDEN // world, dtype=torch.float64)
    with no_communication():
        row = build(te.Linear, HIDDEN, HIDDEN, parallel_mode="row", tp_group=group,
                    sequence_parallel=True)
        with pytest.raises(ValueError, match="first \\(sequence\\) dim must be divisible"):
            row(x)
    cases = [
        (ValueError, "num_attention_heads=3 must be divisible by tp_size=2",
         lambda: build(te.MultiheadAttention, 12, 3, tp_group=group, set_parallel_mode=True)),
        (ValueError, "num_gqa_groups=1 must be divisible by tp_size=2",
         lambda: build(te.TransformerLayer, HIDDEN, HIDDEN, HEADS, num_gqa_groups=1,
                       tp_group=group, set_parallel_mode=True)),
        (ValueError, "parallel_mode must be one of",
         lambda: build(te.Linear, HIDDEN, HIDDEN, parallel_mode="columns")),
        (ValueError, "qk_norm_type with tensor parallelism is not supported",
         lambda: build(te.MultiheadAttention, HIDDEN, HEADS, tp_group=group,
                       set_parallel_mode=True, qk_norm_type="RMSNorm")),
        (ValueError, "sequence_parallel=True and tp_size=2 need a tp_group",
         lambda: build(te.Linear, HIDDEN, HIDDEN, parallel_mode="column", tp_size=2,
                       sequence_parallel=True)),
        (ValueError, "tp_size=4 does not match tp_group",
         lambda: build(te.Linear, HIDDEN, HIDDEN, tp_size=4, tp_group=group)),
        (ValueError, "out_features=15 must be divisible by tp_size=2",
         lambda: build(te.Linear, HIDDEN, 15, parallel_mode="column", tp_group=group)),
        (ValueError, "LayerNormMLP: ffn_hidden_size=15 must be divisible",
         lambda: build(te.LayerNormMLP, HIDDEN, 15, set_parallel_mode=True, tp_group=group)),
        (ValueError, "parallel_mode='row' would normalize",
         lambda: build(te.LayerNormLinear, HIDDEN, HIDDEN, parallel_mode="row")),
        (TypeError, "tp_group must be a torch.distributed ProcessGroup",
         lambda: build(te.Linear, HIDDEN, HIDDEN, tp_group="group")),
        (TypeError, "unexpected keyword argument 'set_parallel_mode'",
         lambda: build(te.Linear, HIDDEN, HIDDEN, set_parallel_mode=True)),
    ]
    with no_communication():
        for error, pattern, call in cases:
            with pytest.raises(error, match=pattern):
                call()


def dropout_case(world, rank, group):
    """Under sequence parallelism the hidden dropout, like the attention dropout under TP,
    draws from TE's RNG tracker (one seed per rank): the default generator, which must stay
    in step over the group, is left as it was, and a tracker reset to its seed replays."""
    tracker = te.CudaRNGStatesTracker()
    layer = build(te.TransformerLayer, HIDDEN, 2 * HIDDEN, HEADS, hidden_dropout=0.5,
                  attention_dropout=0.5, tp_group=group, set_parallel_mode=True,
                  sequence_parallel=True, get_rng_state_tracker=lambda: tracker)
    x = torch.randn(SEQ // world, BATCH, HIDDEN, dtype=torch.float64)
    outputs = []
    for _ in range(2):
        tracker.reset()
        tracker.add("model-parallel-rng", 1234 + rank)
        before = torch.get_rng_state()
        outputs.append(layer(x))
        assert torch.equal(torch.get_rng_state(), before), "dropout drew from the default RNG"
    close(outputs[0], outputs[1], "replayed output")


def data_parallel_case(wrap, device="cpu", dtype=torch.float64, tol=None):
    """Two TransformerLayers trained 3 SGD steps under DDP or FSDP2, each rank on its half of
    the batch: the losses (averaged over the ranks) are one process's on the whole batch.
    Built in float64 on the CPU, run on ``device`` in ``dtype`` (tolerance ``tol``)."""
    def run(world, rank, group):
        def make():
            torch.manual_seed(0)
            return torch.nn.Sequential(*(
                te.TransformerLayer(HIDDEN, 2 * HIDDEN, HEADS, hidden_dropout=0.0,
                                    attention_dropout=0.0, **F64) for _ in range(2))).to(
                device, dtype)
        reference, model = make(), wrap(make(), group)
        batches = [torch.randn(SEQ, 2 * world, HIDDEN, dtype=torch.float64).to(device, dtype)
                   for _ in range(3)]
        for model_, x_of in ((reference, lambda x: x),
                             (model, lambda x: x.chunk(world, 1)[rank])):
            opt = torch.optim.SGD(model_.parameters(), lr=0.5)
            losses = []
            for x in batches:
                loss = model_(x_of(x)).square().mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            if model_ is reference:
                expected = torch.stack(losses)
        got = torch.stack(losses)
        dist.all_reduce(got, group=group)
        close(got / world, expected, "losses", tol=tol)
    return run


def ddp(model, group):
    return torch.nn.parallel.DistributedDataParallel(model, process_group=group)


def fsdp2(model, group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(group, next(model.parameters()).device.type)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


CASES["errors"] = errors_case
CASES["dropout-tracker-sp"] = dropout_case
CASES["ddp"] = data_parallel_case(ddp)
CASES["fsdp2"] = data_parallel_case(fsdp2)


@pytest.fixture(scope="module")
def tp_results():
    return run_cases(__name__, 2)


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_matches_one_process(tp_results, case):
    assert_case_passed(tp_results, case)
