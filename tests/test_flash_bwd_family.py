"""TRANSFORMER_FA_FLASH_BWD_FAMILY on CPU: its parsing, that the asked-for family reaches the
binding's bwd (through the autograd.Function and the torch.library ops), that a bad value is a
clear error before any kernel runs, and the debug-log line naming the backward's family.
The kernels' side (a forced sm90 backward on an H100, its refusals) is
tests/gpu/test_flash_sm90_bwd.py's job."""
import dataclasses

import pytest
import torch
from test_flash_support import gpu_params
from test_flash_wiring import CASES, TorchFlash, build, cpu_ops, grads_of  # noqa: F401

from transformer_fa.attention.backends import flash

ENV = "TRANSFORMER_FA_FLASH_BWD_FAMILY"


class FamilyRecordingFlash(TorchFlash):
    """The torch stand-in of the binding, recording the family each bwd is asked for (the
    binding's default, 0, where none is passed)."""

    def __init__(self):
        super().__init__()
        self.bwd_families = []

    def bwd(self, *args, family=0):
        self.bwd_families.append(family)
        return super().bwd(*args)


@pytest.fixture
def ext(monkeypatch):
    stand_in = FamilyRecordingFlash()
    monkeypatch.setattr(flash, "_ext", stand_in)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("TRANSFORMER_FA_FLASH_FAMILY", raising=False)
    return stand_in


@pytest.mark.parametrize("value,family", [("sm80", 80), ("sm90", 90), (" SM90 ", 90),
                                          ("auto", 0), ("", 0), (None, 0)])
def test_the_variable_names_a_family(monkeypatch, value, family):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert flash.requested_bwd_family() == family


@pytest.mark.parametrize("value,family", [("sm90", 90), ("sm80", 80), ("auto", 0)])
def test_the_backward_family_reaches_the_binding(ext, monkeypatch, value, family):
    monkeypatch.setenv(ENV, value)
    inputs, params, leaves = build(CASES["bshd-causal-gqa"])
    grads_of(flash.run(inputs, params), leaves)
    assert ext.bwd_families == [family]
    assert ext.calls[0][1]["family"] == 0  # the forward's family is TRANSFORMER_FA_FLASH_FAMILY's


def test_the_forward_family_does_not_pick_the_backward_one(ext, monkeypatch):
    monkeypatch.setenv("TRANSFORMER_FA_FLASH_FAMILY", "sm90")
    inputs, params, leaves = build(CASES["bshd-causal-gqa"])
    grads_of(flash.run(inputs, params), leaves)
    assert ext.calls[0][1]["family"] == 90 and ext.bwd_families == [0]


@pytest.mark.usefixtures("cpu_ops")  # the torch.library ops' CPU kernels around ext
def test_the_backward_family_reaches_the_binding_under_the_library_op(ext, monkeypatch):
    monkeypatch.setenv(ENV, "sm90")
    inputs, params, leaves = build(CASES["bshd-causal-gqa"])
    call = flash.FlashCall.from_params(params, return_lse=True)
    out, lse = torch.ops.transformer_fa.flash_attn_fwd(
        inputs.q, inputs.k, inputs.v, None, None, None, None, *call)
    torch.autograd.grad(out.sum(), leaves)
    assert call.bwd_family == 90 and ext.bwd_families == [90]


def test_an_unknown_value_is_a_clear_error_before_any_kernel(ext, monkeypatch):
    monkeypatch.setenv(ENV, "sm100")
    inputs, params, _ = build(CASES["bshd-causal-gqa"])
    with pytest.raises(ValueError, match="TRANSFORMER_FA_FLASH_BWD_FAMILY must be one of auto, "
                                         "sm80, sm90, got 'sm100'"):
        flash.run(inputs, params)
    assert ext.calls == []


class FamilyRules:
    """A stand-in of the binding's family rules (fwd_family, bwd_family): fixed answers, and
    the arguments bwd_family was asked with."""

    def __init__(self, fwd, bwd):
        self.fwd, self.bwd, self.bwd_args = fwd, bwd, None

    def fwd_family(self, *args):
        return self.fwd

    def bwd_family(self, *args):
        self.bwd_args = args
        return self.bwd


def test_the_debug_line_names_the_backward_family(monkeypatch):
    rules = FamilyRules(["sm90", ""], ["sm80", "its backward does not take ALiBi"])
    monkeypatch.setattr(flash, "_extension", lambda: rules)
    monkeypatch.setenv(ENV, "sm90")
    p = gpu_params(requires_grad=True, num_gqa_groups=2, deterministic=True)
    assert flash.describe_choice(p) == (
        "FlashAttention forward kernel family = sm90 (wgmma, TMA), backward = sm80 (not sm90: "
        "its backward does not take ALiBi)")
    # (arch, bf16, d, sq, skv, varlen, left, right, bottom_right, alibi, dropout, gqa,
    #  deterministic, family)
    assert rules.bwd_args == (90, True, 128, 128, 128, False, -1, 0, False, False, False, True,
                              True, 90)
    rules.fwd, rules.bwd = ["sm80", "why"], ["sm90", ""]
    assert flash.describe_choice(p) == ("FlashAttention kernel family = sm80 (not sm90: why), "
                                        "backward = sm90 (wgmma, TMA)")
    # Without gradients the line is the forward's alone.
    assert flash.describe_choice(dataclasses.replace(p, requires_grad=False)) == \
        "FlashAttention kernel family = sm80 (not sm90: why)"
