"""The host work of an eager decode step with the KV cache: torch ops per layer and per step
(a budget: a regression guard, since every op costs the host several microseconds on a
GPU), the work shared by the layers of one step (RoPE's positions and angles), and the
one-token write of a decode step (a view, not a gather)."""
from collections import OrderedDict

import pytest
import torch

import sys
from pathlib import Path

import transformer_fa as tfa
from transformer_fa.attention import rope
from kv_cache_cases import (make_params, make_stack, reference_outputs, rope_table,
                            run_schedule, run_stack, sequence_inputs)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_host import OpCounter  # noqa: E402  (the one op counter)

FORMATS = ("bshd", "sbhd", "thd")

# Measured on 2026-11-25 (CPU, unfused backend, the 2-layer stack of kv_cache_cases,
# 3 sequences, one token each), ops per layer / per step besides the layers:
# bshd and sbhd 103 / 24-25, thd 97 / 33 (a one-token thd step attends as bshd); paged: 5
# more per layer, 4 more per step. The step's share grew by 3 (RoPE's signed sine, made
# once a step, saves 4 ops per layer). Before: bshd and sbhd 113 / 21-22, thd 138 / 30;
# before the first cut: bshd 139 / 29, thd 188 / 29, paged 144-193 / 59.
OPS_PER_LAYER = {"bshd": 115, "sbhd": 115, "thd": 109}
OPS_PER_PAGED_LAYER = 5  # the page table's view and slices
OPS_PER_STEP = 41


def decode_step_ops(qkv_format, is_paged, layers):
    """Torch ops of pre_step plus one decode step (one token for each of 3 sequences)
    through the first ``layers`` layers of the stack, after a prefill and a decode step."""
    stack = make_stack(qkv_format)[:layers]
    params = make_params(qkv_format, is_paged)
    table = rope_table()
    prompts = OrderedDict({0: 5, 1: 3, 2: 4})
    one_each = OrderedDict((seq, 1) for seq in prompts)
    batch = {"bshd": (3, 1, 32), "sbhd": (1, 3, 32), "thd": (3, 32)}[qkv_format]
    prefill = {"bshd": (3, 5, 32), "sbhd": (5, 3, 32), "thd": (12, 32)}[qkv_format]
    with torch.no_grad():
        for step, shape in ((prompts, prefill), (one_each, batch)):
            params.pre_step(step)
            run_stack(stack, torch.randn(shape), inference_params=params, rotary_pos_emb=table)
        x = torch.randn(batch)
        counter = OpCounter()
        with counter:
            params.pre_step(one_each)
            run_stack(stack, x, inference_params=params, rotary_pos_emb=table)
    return counter


@pytest.mark.parametrize("is_paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("qkv_format", FORMATS)
def test_decode_step_stays_within_its_op_budget(qkv_format, is_paged):
    one, two = (decode_step_ops(qkv_format, is_paged, n).total for n in (1, 2))
    per_layer, per_step = two - one, 2 * one - two
    budget = OPS_PER_LAYER[qkv_format] + (OPS_PER_PAGED_LAYER if is_paged else 0)
    assert per_layer <= budget, f"{per_layer} ops per layer"
    assert per_step <= OPS_PER_STEP, f"{per_step} ops per step besides the layers"


# Sequences joining and leaving in one-token steps (the write is a view of the new tokens),
# steps of two tokens for every sequence (a narrow, no gather), and of unequal lengths.
ONE_TOKEN_SCHEDULE = [
    {0: 3, 1: 2},
    {0: 1, 1: 1},
    {1: 1, 2: 1},  # 0 leaves, 2 joins with one token
    {2: 1, 1: 1, 3: 1},  # the order changes, 3 joins
    {3: 2, 2: 2},  # 1 leaves; two tokens each
    {3: 1},
]


@pytest.mark.parametrize("is_paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("qkv_format", FORMATS)
def test_one_token_steps_with_sequences_joining_and_leaving(qkv_format, is_paged):
    table = rope_table()
    stack = make_stack(qkv_format)
    inputs = sequence_inputs(ONE_TOKEN_SCHEDULE)
    expected = reference_outputs(make_stack("bshd"), inputs, table)
    params = make_params(qkv_format, is_paged)
    for step, outs, positions in run_schedule(stack, params, inputs, qkv_format, table,
                                              ONE_TOKEN_SCHEDULE):
        for seq, out in outs.items():
            start, end = positions[seq]
            torch.testing.assert_close(out, expected[seq][start:end], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"step {dict(step)}, seq {seq}: {m}")


@pytest.mark.parametrize("qkv_format", FORMATS)
def test_new_tokens_of_a_one_token_step_are_a_view(qkv_format):
    params = make_params(qkv_format, False)
    manager = params.cache_manager
    params.pre_step(OrderedDict({0: 2, 1: 1}))
    params.pre_step(OrderedDict({1: 1, 0: 1}))
    shape = {"bshd": (2, 3, 2, 8), "sbhd": (3, 2, 2, 8), "thd": (4, 2, 8)}[qkv_format]
    k = torch.randn(shape)
    new = manager._new_tokens(k, qkv_format)
    assert new.shape == (2, 2, 8) and new.data_ptr() == k.data_ptr()  # no copy
    first = {"bshd": k[:, 0], "sbhd": k[0], "thd": k[:2]}[qkv_format]
    assert torch.equal(new, first)
    if qkv_format != "thd":  # unequal step lengths: the gather, batch then position order
        params.pre_step(OrderedDict({1: 3, 0: 1}))
        new = manager._new_tokens(k, qkv_format)
        kb = k if qkv_format == "bshd" else k.transpose(0, 1)
        assert torch.equal(new, torch.cat([kb[0, :3], kb[1, :1]]))


def test_rope_positions_and_angles_are_computed_once_a_step():
    """The layers of a step and q and k share one positions tensor and one (cos, sin); a new
    step starts a new memo (the positions move on)."""
    stack = make_stack("bshd")
    params = make_params("bshd", False)
    table = rope_table()
    computed = []
    real = rope._angles

    def counting(*args):
        computed.append(args[1])
        return real(*args)

    params.pre_step(OrderedDict({0: 4, 1: 2}))
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(rope, "_angles", counting)
        run_stack(stack, torch.randn(2, 4, 32), inference_params=params, rotary_pos_emb=table)
        assert len(computed) == 1 and computed[0].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
        params.pre_step(OrderedDict({0: 1, 1: 1}))
        run_stack(stack, torch.randn(2, 1, 32), inference_params=params, rotary_pos_emb=table)
        assert len(computed) == 2 and computed[1].tolist() == [[4], [2]]


def test_rope_at_positions_equals_apply_rotary_pos_emb():
    table = tfa.RotaryPositionEmbedding(8)(16)
    starts = torch.tensor([3, 0, 7], dtype=torch.int32)
    for fmt, shape in (("bshd", (3, 2, 2, 8)), ("sbhd", (2, 3, 2, 8)), ("thd", (6, 2, 8))):
        t = torch.randn(shape)
        cu = torch.tensor([0, 2, 3, 5], dtype=torch.int32)  # thd: a padding row at the end
        positions = rope.step_positions(fmt, t, cu, starts)
        memo = {}
        for _ in range(2):  # the second call reads the memo
            torch.testing.assert_close(
                rope.apply_rotary_pos_emb_at(t, table, positions, fmt, memo=memo),
                tfa.apply_rotary_pos_emb(t, table, fmt, start_positions=starts, cu_seqlens=cu),
                atol=0, rtol=0)


def test_rope_memo_keeps_interleaved_and_half_pairings_apart():
    """Layers of one step may pair channels differently: the memo's sine (signed by the
    pairing) must not be shared between them."""
    table = tfa.RotaryPositionEmbedding(8)(16)
    starts = torch.tensor([3, 0], dtype=torch.int32)
    t = torch.randn(2, 1, 2, 8)
    positions = rope.step_positions("bshd", t, torch.tensor([0, 1, 2], dtype=torch.int32), starts)
    memo = {}
    for interleaved in (False, True, False):
        torch.testing.assert_close(
            rope.apply_rotary_pos_emb_at(t, table, positions, "bshd", interleaved, memo=memo),
            tfa.apply_rotary_pos_emb(t, table, "bshd", interleaved=interleaved,
                                     start_positions=starts), atol=0, rtol=0)


@pytest.mark.parametrize("is_paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("qkv_format", FORMATS)
def test_attention_call_over_the_cache_is_decided_once_a_step(monkeypatch, qkv_format, is_paged):
    """The layers of one step with equal attention calls share one backend decision
    (InferenceParams.step_memo); a layer whose call differs (another softmax_scale) gets
    its own, and a new step decides again. Outputs match separate InferenceParams."""
    from transformer_fa.attention import selection
    decided = []
    real = selection.select
    monkeypatch.setattr(selection, "select", lambda *a: decided.append(a) or real(*a))
    scales = (None, None, 0.5)  # layers 1 and 2 alike, layer 3 another scale
    modules = [tfa.DotProductAttention(4, 8, num_gqa_groups=2, qkv_format=qkv_format,
                                       layer_number=i + 1, softmax_scale=s)
               for i, s in enumerate(scales)]
    shared = make_params(qkv_format, is_paged)
    alone = [make_params(qkv_format, is_paged) for _ in modules]
    for m, params in zip(modules, alone):
        shared.allocate_memory(m.layer_number)
        params.allocate_memory(m.layer_number)
    steps = (OrderedDict({0: 3, 1: 2}), OrderedDict({0: 1, 1: 1}), OrderedDict({0: 1, 1: 1}))
    for step in steps:
        rows = {"bshd": (2, max(step.values())), "sbhd": (max(step.values()), 2),
                "thd": (sum(step.values()),)}[qkv_format]
        q, k, v = (torch.randn(*rows, h, 8) for h in (4, 2, 2))
        for params in (shared, *alone):
            params.pre_step(step)
        decided.clear()
        with torch.no_grad():
            outs = [m(q, k, v, inference_params=shared) for m in modules]
        assert len(decided) == 2, "layer 2 reuses layer 1's decision, layer 3 decides"
        with torch.no_grad():
            for m, params, out in zip(modules, alone, outs):
                torch.testing.assert_close(out, m(q, k, v, inference_params=params),
                                           atol=0, rtol=0)


def test_thd_step_of_equal_lengths_attends_as_bshd(monkeypatch):
    """A thd step adding the same number of tokens to every sequence, with no rows past
    them, is attended as the bshd step (a view: no padding of q and of the output); rows
    past the step's tokens keep the thd call and come back as zeros."""
    from transformer_fa.attention.backends import unfused
    formats = []
    real = unfused.run
    monkeypatch.setattr(unfused, "run", lambda inputs, p: formats.append(p.q_format)
                        or real(inputs, p))
    modules = {fmt: tfa.DotProductAttention(4, 8, num_gqa_groups=2, qkv_format=fmt,
                                            layer_number=1) for fmt in ("thd", "bshd")}
    params = {fmt: make_params(fmt, False) for fmt in modules}
    for p in params.values():
        p.allocate_memory(1)
    for step in (OrderedDict({0: 3, 1: 3}), OrderedDict({0: 1, 1: 1})):
        q, k, v = (torch.randn(2, max(step.values()), h, 8) for h in (4, 2, 2))
        for p in params.values():
            p.pre_step(step)
        formats.clear()
        with torch.no_grad():
            thd = modules["thd"](*(t.flatten(0, 1) for t in (q, k, v)),
                                 inference_params=params["thd"])
            bshd = modules["bshd"](q, k, v, inference_params=params["bshd"])
        assert formats == ["bshd", "bshd"]
        torch.testing.assert_close(thd, bshd.flatten(0, 1), atol=0, rtol=0)
    params["thd"].pre_step(OrderedDict({0: 1, 1: 1}))
    formats.clear()
    q, k, v = (torch.randn(3, h, 8) for h in (4, 2, 2))  # a row past the step's 2 tokens
    with torch.no_grad():
        out = modules["thd"](q, k, v, inference_params=params["thd"])
    assert formats == ["thd"] and out.shape == (3, 32) and not out[2].any()
