"""The host work of an eager decode step with the KV cache: torch ops per layer and per step
(a budget: a regression guard, since every op costs the host several microseconds on a
GPU), the work shared by the layers of one step (RoPE's positions and angles), and the
one-token write of a decode step (a view, not a gather)."""
from collections import Counter, OrderedDict

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import transformer_fa as tfa
from transformer_fa.attention import rope
from kv_cache_cases import (make_params, make_stack, reference_outputs, rope_table,
                            run_schedule, run_stack, sequence_inputs)

FORMATS = ("bshd", "sbhd", "thd")

# Measured on 2026-11-25 (unfused backend, 2-layer stack, batch 3, one token a sequence):
# ops per layer 56 (bshd / sbhd; thd 58), per step besides the layers 9 to 19 (thd, paged).
# Before the decode step's host work was cut: 71 to 93 per layer, 20 to 45 per step.
OPS_PER_LAYER = 64
OPS_PER_STEP = 24


class OpCounter(TorchDispatchMode):
    """Counts the torch ops (ATen calls, views included) run inside it."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


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
    assert per_layer <= OPS_PER_LAYER, f"{per_layer} ops per layer"
    assert per_step <= OPS_PER_STEP, f"{per_step} ops per step besides the layers"
