"""FlashAttention's support claims, checked without a GPU (a stand-in for the built extension)."""
import dataclasses
import types

import torch

from transformer_fa.attention.backends import flash
from transformer_fa.attention.params import AttentionParams


def gpu_params(**changes):
    base = AttentionParams(
        qkv_format="bshd", q_format="bshd", kv_format="bshd", qkv_layout="bshd_bshd_bshd",
        batch_size=2, num_heads=4, num_gqa_groups=4, max_seqlen_q=128, max_seqlen_kv=128,
        head_dim_qk=128, head_dim_v=128, dtype=torch.bfloat16, device_type="cuda",
        compute_capability=(9, 0), attn_mask_type="causal", window_size=(-1, 0),
        core_attention_bias_type="no_bias", core_attention_bias_shape=None,
        core_attention_bias_requires_grad=False, alibi_slopes_shape=None, attention_dropout=0.0,
        softmax_scale=0.088, deterministic=False, requires_grad=False)
    return dataclasses.replace(base, **changes)


def test_claims_exactly_what_the_gpu_tests_cover(monkeypatch):
    monkeypatch.setattr(flash, "is_built", lambda: True)
    monkeypatch.setattr(flash, "_extension", lambda: types.SimpleNamespace())
    for dtype in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            assert flash.not_supported_reasons(
                gpu_params(dtype=dtype, head_dim_qk=d, head_dim_v=d)) == []
    declined = {
        "backward": gpu_params(requires_grad=True),
        "sm80 (not run on one)": gpu_params(compute_capability=(8, 0)),
        "head dim 96": gpu_params(head_dim_qk=96, head_dim_v=96),
        "dqk != dv": gpu_params(head_dim_v=64),
        "float32": gpu_params(dtype=torch.float32),
        "dropout": gpu_params(attention_dropout=0.1),
        "alibi": gpu_params(core_attention_bias_type="alibi", alibi_slopes_shape=(4,)),
        "arbitrary": gpu_params(attn_mask_type="arbitrary", window_size=(-1, -1)),
    }
    for name, params in declined.items():
        assert flash.not_supported_reasons(params), name


def test_a_failing_check_is_a_reason_not_an_exception(monkeypatch):
    monkeypatch.setattr(flash, "is_built", lambda: 1 / 0)
    assert flash.not_supported_reasons(gpu_params()) == [
        "as its support check failed (ZeroDivisionError: division by zero)"]
