"""FusedAttention's Python side on CPU: what it declines without asking cuDNN, the one cache
its support check and plan builder share, and the ALiBi bias it hands cuDNN. (Its numbers
are tests/gpu/test_fused.py's job.)"""
import contextlib
import dataclasses
import types

import pytest
import torch

from transformer_fa.attention import masks
from transformer_fa.attention.backends import fused
from transformer_fa.attention.backends.fused import plans, reasons
from transformer_fa.attention.params import AttentionParams


def gpu_params(**changes) -> AttentionParams:
    base = AttentionParams(
        qkv_format="bshd", q_format="bshd", kv_format="bshd", qkv_layout="bshd_bshd_bshd",
        batch_size=2, num_heads=4, num_gqa_groups=4, max_seqlen_q=128, max_seqlen_kv=128,
        head_dim_qk=64, head_dim_v=64, dtype=torch.bfloat16, device_type="cuda",
        compute_capability=(9, 0), attn_mask_type="causal", window_size=(-1, 0),
        core_attention_bias_type="no_bias", core_attention_bias_shape=None,
        core_attention_bias_requires_grad=False, alibi_slopes_shape=None, attention_dropout=0.0,
        softmax_scale=0.125, deterministic=False, requires_grad=True)
    return dataclasses.replace(base, **changes)


def test_claims_the_plain_features():
    assert reasons.feature_reasons(gpu_params()) == []
    assert reasons.feature_reasons(gpu_params(core_attention_bias_type="post_scale_bias",
                                              core_attention_bias_shape="1hss")) == []


@pytest.mark.parametrize("change, reason", [
    ({"softmax_type": "off-by-one"}, "as it does not support softmax_type = off-by-one"),
    ({"softmax_type": "learnable"}, "as it does not support softmax_type = learnable"),
    ({"return_max_logit": True}, "as it does not support return_max_logit = True"),
    ({"softcap": 30.0}, "as it does not support softcap = 30.0"),
    ({"core_attention_bias_type": "post_scale_bias", "core_attention_bias_shape": "111s"},
     "as it does not support core_attention_bias_shape = 111s"),
])
def test_declines_what_it_does_not_claim(change, reason):
    assert reasons.feature_reasons(gpu_params(**change)) == [reason]


def test_support_check_and_plan_builder_share_the_validated_graph(monkeypatch):
    """The graph the support check validated for a Spec is the one the plan builder builds
    (no second make_graph), and a verdict is asked of cuDNN once."""
    made = []

    def make_graph(spec, handle):
        made.append(spec)
        return types.SimpleNamespace(spec=spec)

    built = []

    class Plan:
        def __init__(self, g, spec, device_index, fast_execute):
            built.append((g, fast_execute))
            self.spec = spec

    monkeypatch.setattr(plans, "make_graph", make_graph)
    monkeypatch.setattr(plans, "Plan", Plan)
    monkeypatch.setattr(torch.cuda, "device", contextlib.nullcontext)  # CPU tensors here
    monkeypatch.setattr(plans.cudnn_lib, "handle", lambda device_index: None)
    cache = plans.GraphCache(fast_execute=False)
    spec = fused.spec.spec_from_params(gpu_params(), backward=False)
    assert cache.verdict(spec, None) is None
    assert cache.verdict(spec, None) is None
    assert made == [spec]
    q = torch.zeros(2, 128, 4, 64)
    plan = cache.plan(cache.forward, ("key",), lambda: spec, (q, q, q))
    assert made == [spec] and built[0][0].spec is spec and built[0][1] is False
    assert cache.plan(cache.forward, ("key",), lambda: spec, (q, q, q)) is plan
    assert len(built) == 1
    cache.clear()
    assert not (cache.verdicts or cache.validated or cache.forward or cache.backward)


def test_a_rejection_is_a_cached_verdict(monkeypatch):
    calls = []

    def make_graph(spec, handle):
        calls.append(spec)
        raise RuntimeError("not   supported\n here")

    monkeypatch.setattr(plans, "make_graph", make_graph)
    monkeypatch.setattr(plans.cudnn_lib, "handle", lambda device_index: None)
    cache = plans.GraphCache()
    spec = fused.spec.spec_from_params(gpu_params(), backward=True)
    assert cache.verdict(spec, 0) == "not supported here"
    assert cache.verdict(spec, 0) == "not supported here"
    assert len(calls) == 1 and not cache.validated


@pytest.mark.parametrize("mask, sq, skv", [("no_mask", 300, 20), ("causal", 300, 20),
                                           ("causal_bottom_right", 40, 400)])
def test_alibi_bias_is_relative_to_the_row_maximum(mask, sq, skv):
    """Each row's maximum is 0 (small values where the weight is) and the softmax is that
    of the absolute bias."""
    slopes = torch.tensor([0.7, 0.3])
    p = gpu_params(num_heads=2, num_gqa_groups=2, max_seqlen_q=sq, max_seqlen_kv=skv,
                   attn_mask_type=mask, core_attention_bias_type="alibi",
                   alibi_slopes_shape=(2,), dtype=torch.float32)
    bias = fused._alibi_bias(slopes, p, None, None)
    absolute = masks.alibi_bias(slopes, mask, torch.tensor([sq]), torch.tensor([skv]), sq, skv)
    assert bias.shape == absolute.shape == (1, 2, sq, skv)
    assert torch.equal(bias.amax(-1), torch.zeros(1, 2, sq))
    assert absolute.amin() < -100  # the absolute one is large far from the diagonal
    torch.testing.assert_close(bias.softmax(-1), absolute.softmax(-1))


def test_call_arguments_flatten_in_schema_order():
    call = fused.FusedCall.from_params(gpu_params(q_format="thd", kv_format="thd",
                                                  max_seqlen_q=130, max_seqlen_kv=7), True)
    assert (call.max_seqlen_q, call.max_seqlen_kv) == (256, 128)  # thd buckets
    schema = fused.ops.FWD_SCHEMA
    names = [arg.split()[-1] for arg in schema[1:schema.index(")")].split(", ")]
    assert names[7:] == list(fused.FusedCall._fields)
    assert fused.FusedCall._make(tuple(call)) == call
