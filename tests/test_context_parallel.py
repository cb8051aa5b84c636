"""Context parallelism over gloo: each rank's output and gradients must equal the slice of a
single-process run on the full tensors (float64), for every cp_comm_type, mask and format.

The distributed cases run in one spawn per world size (tests/distributed_utils.py).
"""
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

from distributed_utils import assert_case_passed, close, no_communication, run_cases

import transformer_fa as te
from transformer_fa.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

HEADS, GROUPS, DIM, BATCH = 8, 4, 8, 2
COMMS = ("p2p", "all_gather", "a2a")
WORLDS = (2, 4)


def shard(x, dim, world, rank):
    """TE's load-balanced part of rank ``rank``: chunks rank and 2*world-1-rank of 2*world."""
    chunks = x.chunk(2 * world, dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim)


# -------------------------------------------------------------------- distributed cases

SIZES = dict(heads=HEADS, groups=GROUPS, dim=DIM, batch=BATCH)


def draw_attention_inputs(seq, fmt, kv_factor=1, heads=HEADS, groups=GROUPS, dim=DIM,
                          batch=BATCH, device="cpu"):
    """The full q, k, v and output gradient (float64, the same on every rank)."""
    torch.manual_seed(0)

    def full(s, h):
        shape = (s, batch, h, dim) if fmt == "sbhd" else (batch, s, h, dim)
        return torch.randn(shape, dtype=torch.float64).to(device)
    q, k, v = full(seq, heads), full(seq * kv_factor, groups), full(seq * kv_factor, groups)
    dout = torch.randn(q.shape[:-2] + (heads * dim,), dtype=torch.float64).to(device)
    return (q, k, v), dout


def run_attention(dpa, tensors, dout, dtype=torch.float64, cu_args=None):
    """Forward and backward of ``dpa`` on copies of ``tensors`` in ``dtype``: the output and
    the q, k, v gradients."""
    leaves = [t.detach().to(dtype, copy=True).requires_grad_() for t in tensors]
    out = dpa(*leaves, **(cu_args or {}))
    out.backward(dout.to(dtype))
    return out, [t.grad for t in leaves]


def close_outputs(got, expected, part, tol=None):
    """(output, [dq, dk, dv]) against the full run's, cut to this rank's part by ``part``."""
    (out, grads), (out_full, grads_full) = got, expected
    close(out, part(out_full), "output", tol=tol)
    for name, mine, ref in zip("qkv", grads, grads_full):
        close(mine, part(ref), f"d{name}", tol=tol)


def attention_case(comm, mask, fmt, window=None, kv_factor=1, seq_per_rank=4, sizes=SIZES,
                   device="cpu", dtype=torch.float64, tol=None, cp_context=nullcontext):
    """DotProductAttention under CP (in ``dtype``, inside ``cp_context()``) against the
    full-sequence module in float64, forward and backward; tolerance ``tol`` (atol = rtol)
    or close()'s default."""
    def run(world, rank, group):
        seq_dim = 0 if fmt == "sbhd" else 1
        full, dout = draw_attention_inputs(seq_per_rank * world, fmt, kv_factor,
                                           device=device, **sizes)
        heads, dim, groups = sizes["heads"], sizes["dim"], sizes["groups"]
        args = dict(qkv_format=fmt, attn_mask_type=mask, window_size=window)
        expected = run_attention(te.DotProductAttention(heads, dim, groups, **args), full, dout)

        def part(t):
            return shard(t, seq_dim, world, rank)
        dpa = te.DotProductAttention(heads, dim, groups, cp_group=group, cp_comm_type=comm,
                                     cp_global_ranks=list(range(world)), **args)
        with cp_context():
            got = run_attention(dpa, [part(t) for t in full], part(dout), dtype)
        close_outputs(got, expected, part, tol)
    return run


def shard_thd(x, cu_padded, world, rank):
    """TE's thd part of rank ``rank``: each padded sequence sharded as above."""
    bounds = cu_padded.tolist()
    return torch.cat([shard(x[start:end], 0, world, rank)
                      for start, end in zip(bounds[:-1], bounds[1:])])


def thd_case(comm, mask, pad, window=None, sizes=SIZES, device="cpu", dtype=torch.float64,
             tol=None, cp_context=nullcontext):
    """thd under CP (TE's convention: global cu_seqlens and cu_seqlens_*_padded, every padded
    length divisible by 2 * cp_size) against the full thd call in float64, forward and
    backward; with ``pad`` the sequences are ragged (padding tokens at each sequence's end),
    without it cu_seqlens_*_padded is not given. The CP run as in attention_case."""
    def run(world, rank, group):
        chunk = 2 * world
        lengths = [3, 2 * chunk, chunk + 1, 0] if pad else [chunk, 2 * chunk]
        padded = [-(-n // chunk) * chunk for n in lengths]

        def cumulative(values):
            return torch.tensor([0] + values, dtype=torch.int32, device=device).cumsum(
                0, dtype=torch.int32)
        cu, cu_padded = cumulative(lengths), cumulative(padded)
        cu_args = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu)
        if pad:
            cu_args.update(cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded)
        heads, groups, dim = sizes["heads"], sizes["groups"], sizes["dim"]
        torch.manual_seed(0)
        total = int(cu_padded[-1])
        q = torch.randn(total, heads, dim, dtype=torch.float64).to(device)
        k, v = (torch.randn(total, groups, dim, dtype=torch.float64).to(device)
                for _ in range(2))
        dout = torch.randn(total, heads * dim, dtype=torch.float64).to(device)
        args = dict(qkv_format="thd", attn_mask_type=mask, window_size=window)
        expected = run_attention(te.DotProductAttention(heads, dim, groups, **args),
                                 (q, k, v), dout, cu_args=cu_args)

        def part(t):
            return shard_thd(t, cu_padded, world, rank)
        dpa = te.DotProductAttention(heads, dim, groups, cp_group=group, cp_comm_type=comm,
                                     **args)
        with cp_context():
            got = run_attention(dpa, [part(t) for t in (q, k, v)], part(dout), dtype, cu_args)
        close_outputs(got, expected, part, tol)
    return run


def layer_case(comm, fmt):
    """A TransformerLayer with RoPE and set_context_parallel_group against the full layer:
    outputs, input gradients and (summed over the ranks) parameter gradients."""
    def run(world, rank, group):
        seq, hidden = 4 * world, HEADS * DIM
        seq_dim = 0 if fmt == "sbhd" else 1

        def make():
            torch.manual_seed(1)
            return te.TransformerLayer(hidden, 2 * hidden, HEADS, num_gqa_groups=GROUPS,
                                       hidden_dropout=0.0, attention_dropout=0.0,
                                       attn_input_format=fmt, device="cpu",
                                       params_dtype=torch.float64)
        reference, layer = make(), make()
        layer.set_context_parallel_group(group, list(range(world)), None, comm)
        freqs = RotaryPositionEmbedding(DIM)(seq).to("cpu", torch.float64)
        x = torch.randn((seq, BATCH, hidden) if fmt == "sbhd" else (BATCH, seq, hidden),
                        dtype=torch.float64, requires_grad=True)
        out_full = reference(x, rotary_pos_emb=freqs)
        out_full.sum().backward()
        x_local = shard(x.detach(), seq_dim, world, rank).requires_grad_()
        out = layer(x_local, rotary_pos_emb=freqs)
        out.sum().backward()
        close(out, shard(out_full, seq_dim, world, rank), "output")
        close(x_local.grad, shard(x.grad, seq_dim, world, rank), "input grad")
        for (name, param), ref in zip(layer.named_parameters(), reference.parameters()):
            dist.all_reduce(param.grad, group=group)
            close(param.grad, ref.grad, f"grad of {name}")
    return run


def tensor_parallel_case(world, rank, group):
    """DotProductAttention(tp_group=...) given the global head counts attends this rank's
    heads: its output and gradients are the head slice of the full run (GQA: the kv heads
    split alike)."""
    torch.manual_seed(0)
    q = torch.randn(BATCH, 6, HEADS, DIM, dtype=torch.float64)
    k, v = (torch.randn(BATCH, 6, GROUPS, DIM, dtype=torch.float64) for _ in range(2))
    expected = [t.clone().requires_grad_() for t in (q, k, v)]
    out_full = te.DotProductAttention(HEADS, DIM, GROUPS, qkv_format="bshd")(*expected)
    out_full.sum().backward()
    local = [t.chunk(world, 2)[rank].clone().requires_grad_() for t in (q, k, v)]
    dpa = te.DotProductAttention(HEADS, DIM, GROUPS, qkv_format="bshd", tp_group=group,
                                 tp_size=world)
    assert (dpa.tp_size, dpa.num_attention_heads, dpa.num_gqa_groups) == (
        world, HEADS // world, GROUPS // world)
    out = dpa(*local)
    out.sum().backward()
    close(out, out_full.chunk(world, -1)[rank], "output")
    for name, mine, ref in zip("qkv", local, expected):
        close(mine.grad, ref.grad.chunk(world, 2)[rank], f"d{name}")
    with pytest.raises(ValueError, match="tp_size=3 does not match tp_group"):
        te.DotProductAttention(HEADS, DIM, tp_group=group, tp_size=3)
    with pytest.raises(ValueError, match=f"num_gqa_groups={world // 2} must be divisible by "
                                         f"tp_size={world}"):
        te.DotProductAttention(HEADS, DIM, world // 2, tp_group=group)


def errors_case(world, rank, group):
    """Bad CP input raises a ValueError naming the problem, before any communication."""
    def dpa(**kwargs):
        args = dict(qkv_format="bshd", cp_group=group)
        args.update(kwargs)
        heads = args.pop("heads", HEADS)
        return te.DotProductAttention(heads, DIM, args.pop("groups", GROUPS), **args)

    def qkv(seq, heads=HEADS, groups=GROUPS, fmt="bshd"):
        shape = (BATCH, seq) if fmt == "bshd" else (seq, BATCH)
        return (torch.randn(shape + (heads, DIM)), torch.randn(shape + (groups, DIM)),
                torch.randn(shape + (groups, DIM)))

    def thd(tokens):
        return (torch.randn(tokens, HEADS, DIM), torch.randn(tokens, GROUPS, DIM),
                torch.randn(tokens, GROUPS, DIM))

    def cu(lengths):  # global lengths; with cp_size = world the sizes above scale by 2/world
        scaled = [n * world // 2 for n in lengths]
        return torch.tensor([0] + scaled, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    cases = [
        ("divisible by 2 \\* cp_size", lambda: dpa()(*qkv(3))),
        ("cu_seqlens_q_padded \\(or cu_seqlens_q without it\\) must give every sequence a "
         "length divisible by 2 \\* cp_size", lambda: dpa(qkv_format="thd")(
             *thd(8), cu_seqlens_q=cu([3, 5]), cu_seqlens_kv=cu([4, 4]))),
        ("cu_seqlens_kv_padded .* divisible by 2 \\* cp_size", lambda: dpa(qkv_format="thd")(
            *thd(8), cu_seqlens_q=cu([3, 3]), cu_seqlens_kv=cu([3, 3]),
            cu_seqlens_q_padded=cu([4, 4]), cu_seqlens_kv_padded=cu([3, 5]))),
        ("cu_seqlens_q has a sequence longer than its padded length", lambda: dpa(
            qkv_format="thd")(*thd(8), cu_seqlens_q=cu([5, 3]), cu_seqlens_kv=cu([4, 4]),
                              cu_seqlens_q_padded=cu([4, 4]))),
        ("needs 8 tokens on each rank", lambda: dpa(qkv_format="thd")(
            *thd(4), cu_seqlens_q=cu([8, 8]), cu_seqlens_kv=cu([8, 8]))),
        ("qkv_format='thd' with cp_comm_type='a2a'", lambda: dpa(
            qkv_format="thd", cp_comm_type="a2a")(*thd(8), cu_seqlens_q=cu([4, 4]),
                                                  cu_seqlens_kv=cu([4, 4]))),
        ("causal thd attention .* needs the same cu_seqlens", lambda: dpa(qkv_format="thd")(
            *thd(8), cu_seqlens_q=cu([4, 4]), cu_seqlens_kv=cu([8, 0]))),
        ("window_size=\\(2, 0\\) with cp_comm_type='p2p'", lambda: dpa(
            qkv_format="thd", window_size=(2, 0))(*thd(8), cu_seqlens_q=cu([4, 4]),
                                                  cu_seqlens_kv=cu([4, 4]))),
        ("cu_seqlens_q \\(a tensor\\) is not supported", lambda: dpa()(
            *qkv(4), cu_seqlens_q=cu([4, 4]), cu_seqlens_kv=cu([4, 4]))),
        ("attn_mask_type='padding' with context", lambda: dpa(attn_mask_type="padding")(
            *qkv(4), attention_mask=torch.zeros(BATCH, 1, 1, 4, dtype=torch.bool))),
        ("window_size=\\(2, 0\\) with cp_comm_type='p2p'", lambda: dpa(window_size=(2, 0))(
            *qkv(4))),
        ("num_gqa_groups=1 divisible by cp_size", lambda: dpa(cp_comm_type="a2a", groups=1)(
            *qkv(4, groups=1))),
        ("core_attention_bias_type \\('alibi'\\)", lambda: dpa()(
            *qkv(4), core_attention_bias_type="alibi")),
        ("softmax_type='off-by-one'", lambda: dpa(softmax_type="off-by-one")(*qkv(4))),
        ("attention_dropout=0.1 in training", lambda: dpa(attention_dropout=0.1)(*qkv(4))),
        ("causal attention with context parallelism needs as many queries", lambda: dpa()(
            qkv(4)[0], *qkv(8)[1:])),
    ]
    with no_communication():
        for pattern, call in cases:
            with pytest.raises(ValueError, match=pattern):
                call()
        with pytest.raises(ValueError, match="cp_global_ranks=.* does not match cp_group"):
            dpa(cp_global_ranks=list(range(1, world + 1)))


CASES = {}
for _comm in COMMS:
    for _mask in ("causal", "no_mask"):
        for _fmt in ("bshd", "sbhd"):
            CASES[f"{_comm}-{_mask}-{_fmt}"] = attention_case(_comm, _mask, _fmt)
    CASES[f"{_comm}-cross-no_mask"] = attention_case(_comm, "no_mask", "bshd", kv_factor=2)
    CASES[f"{_comm}-layer-rope"] = layer_case(_comm, "sbhd" if _comm == "a2a" else "bshd")
for _comm in ("all_gather", "a2a"):
    CASES[f"{_comm}-causal-window"] = attention_case(_comm, "causal", "bshd", window=(3, 0))
    CASES[f"{_comm}-no_mask-window"] = attention_case(_comm, "no_mask", "sbhd", window=(2, 1))
for _comm in ("p2p", "all_gather"):
    for _mask in ("causal", "no_mask"):
        CASES[f"{_comm}-{_mask}-thd-padded"] = thd_case(_comm, _mask, pad=True)
    CASES[f"{_comm}-causal-thd"] = thd_case(_comm, "causal", pad=False)
CASES["all_gather-causal-thd-window"] = thd_case("all_gather", "causal", True, window=(2, 0))
CASES["tensor-parallel-heads"] = tensor_parallel_case
CASES["errors"] = errors_case


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def cp_results(request):
    return run_cases(__name__, request.param)


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_matches_full_sequence(cp_results, case):
    assert_case_passed(cp_results, case)


# ------------------------------------------------------------------- single-process tests

@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("world", [2, 4])
def test_rope_cp_rank_matches_full_sequence_sliced(fmt, world):
    seq = 8 * world
    freqs = RotaryPositionEmbedding(DIM)(seq + 4).cpu()
    torch.manual_seed(0)
    if fmt == "thd":
        lengths = [4 * world, 8 * world]  # each divisible by 2 * world
        cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
        t = torch.randn(sum(lengths), HEADS, DIM)
        full = apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu)
        for rank in range(world):
            local = torch.cat([shard(part, 0, world, rank)
                               for part in (t[:lengths[0]], t[lengths[0]:])])
            expected = torch.cat([shard(part, 0, world, rank)
                                  for part in (full[:lengths[0]], full[lengths[0]:])])
            got = apply_rotary_pos_emb(local, freqs, "thd", cu_seqlens=cu, cp_size=world,
                                       cp_rank=rank)
            torch.testing.assert_close(got, expected)
        return
    seq_dim = 0 if fmt == "sbhd" else 1
    shape = (seq, BATCH, HEADS, DIM) if fmt == "sbhd" else (BATCH, seq, HEADS, DIM)
    t = torch.randn(shape)
    start = torch.tensor([0, 3])
    for start_positions in (None, start):
        full = apply_rotary_pos_emb(t, freqs, fmt, start_positions=start_positions)
        for rank in range(world):
            got = apply_rotary_pos_emb(shard(t, seq_dim, world, rank), freqs, fmt,
                                       start_positions=start_positions, cp_size=world,
                                       cp_rank=rank)
            torch.testing.assert_close(got, shard(full, seq_dim, world, rank))


def test_rope_cp_arguments_are_checked():
    freqs = RotaryPositionEmbedding(DIM)(16).cpu()
    t = torch.randn(6, BATCH, HEADS, DIM)
    with pytest.raises(ValueError, match="cp_rank must be an int in \\[0, cp_size=2\\)"):
        apply_rotary_pos_emb(t, freqs, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="cp_size must be a positive int"):
        apply_rotary_pos_emb(t, freqs, cp_size=0)
    with pytest.raises(ValueError, match="needs an even number"):
        apply_rotary_pos_emb(t[:5], freqs, cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match="exceed the 16 positions"):
        apply_rotary_pos_emb(t, freqs, cp_size=4, cp_rank=0)
    with pytest.raises(ValueError, match="divisible by 2 \\* cp_size = 4"):
        apply_rotary_pos_emb(t[:, 0], freqs, "thd", cp_size=2,
                             cu_seqlens=torch.tensor([0, 6, 12], dtype=torch.int32))


def test_cp_arguments_are_checked_without_a_group():
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        te.DotProductAttention(HEADS, DIM, cp_comm_type="ring")
    with pytest.raises(TypeError, match="cp_stream must be a torch.cuda.Stream"):
        te.DotProductAttention(HEADS, DIM, cp_stream=object())
    with pytest.raises(TypeError, match="cp_group must be a torch.distributed ProcessGroup"):
        te.DotProductAttention(HEADS, DIM, cp_group="group")
    with pytest.raises(ValueError, match="'a2a\\+p2p' .* is not supported yet"):
        te.DotProductAttention(HEADS, DIM, cp_group=[None, None], cp_comm_type="a2a+p2p")
    mha = te.MultiheadAttention(HEADS * DIM, HEADS, device="cpu")
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        mha.set_context_parallel_group(None, None, None, "ring")
    # No group: single-device attention, whatever the comm type says.
    dpa = te.DotProductAttention(HEADS, DIM, cp_comm_type="a2a")
    assert dpa(*(torch.randn(6, BATCH, HEADS, DIM) for _ in range(3))).shape == (
        6, BATCH, HEADS * DIM)
