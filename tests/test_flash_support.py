"""FlashAttention's support claims against the kernels a build has (no GPU needed)."""
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


def test_reasons_follow_the_kernels_this_build_has(monkeypatch):
    ext = types.SimpleNamespace(INSTANTIATIONS=["bf16_hdim128"])
    monkeypatch.setattr(flash, "is_built", lambda: True)
    monkeypatch.setattr(flash, "_extension", lambda: ext)
    assert flash.not_supported_reasons(gpu_params()) == []
    reasons = flash.not_supported_reasons(gpu_params(dtype=torch.float16, head_dim_qk=64,
                                                     head_dim_v=64))
    assert reasons == ["as this build has no fp16_hdim64 kernel (built: bf16_hdim128; "
                       "see TRANSFORMER_FA_FLASH_KERNELS)"]
    assert flash.not_supported_reasons(gpu_params(requires_grad=True)) == [
        "as the FlashAttention backward is not implemented yet"]
    assert "compute capability" in flash.not_supported_reasons(
        gpu_params(compute_capability=(8, 0)))[0]


def test_a_failing_check_is_a_reason_not_an_exception(monkeypatch):
    monkeypatch.setattr(flash, "is_built", lambda: 1 / 0)
    assert flash.not_supported_reasons(gpu_params()) == [
        "as its support check failed (ZeroDivisionError: division by zero)"]
