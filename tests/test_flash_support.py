"""FlashAttention's support claims, checked without a GPU (a stand-in for the built extension)."""
import dataclasses
import logging
import types

import torch

from transformer_fa.attention import selection
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


def built_extension(monkeypatch, **attrs):
    """A stand-in for the built extension: what the support check looks at."""
    ext = types.SimpleNamespace(
        fwd=None, bwd=None, HEAD_DIMS=(64, 128, 192, 256),
        INSTANTIATIONS=[f"{t}_hdim{d}" for t in ("fp16", "bf16") for d in (64, 128, 192, 256)])
    for name, value in attrs.items():
        setattr(ext, name, value)
    monkeypatch.setattr(flash, "is_built", lambda: True)
    monkeypatch.setattr(flash, "_extension", lambda: ext)
    return ext


def test_claims_exactly_what_the_gpu_tests_cover(monkeypatch):
    built_extension(monkeypatch)
    claimed = []
    for dtype in (torch.float16, torch.bfloat16):
        for d in range(8, 257, 8):  # every multiple of 8: tests/gpu/test_flash.py runs each
            claimed.append(gpu_params(dtype=dtype, head_dim_qk=d, head_dim_v=d,
                                      requires_grad=True))
    claimed += [
        gpu_params(requires_grad=False),
        gpu_params(attention_dropout=0.1, requires_grad=True),
        gpu_params(core_attention_bias_type="alibi", alibi_slopes_shape=(4,)),
        gpu_params(core_attention_bias_type="alibi", alibi_slopes_shape=(2, 4),
                   attn_mask_type="causal_bottom_right", requires_grad=True),
        gpu_params(deterministic=True, requires_grad=True),
        gpu_params(num_gqa_groups=1, requires_grad=True),
        gpu_params(window_size=(64, 0), requires_grad=True),
        gpu_params(attn_mask_type="no_mask", window_size=(32, 16)),
        gpu_params(qkv_format="thd", q_format="thd", kv_format="thd",
                   qkv_layout="thd_thd_thd", attn_mask_type="padding_causal_bottom_right",
                   requires_grad=True, attention_dropout=0.2),
    ]
    for params in claimed:
        assert flash.not_supported_reasons(params) == [], params
    declined = {
        "sm80 (not run on one)": gpu_params(compute_capability=(8, 0)),
        "head dim 100": gpu_params(head_dim_qk=100, head_dim_v=100),
        "head dim 264": gpu_params(head_dim_qk=264, head_dim_v=264),
        "dqk != dv": gpu_params(head_dim_v=64),
        "dqk != dv, both claimed alone": gpu_params(head_dim_qk=192, head_dim_v=128),
        "float32": gpu_params(dtype=torch.float32),
        "arbitrary": gpu_params(attn_mask_type="arbitrary", window_size=(-1, -1)),
        "post_scale_bias": gpu_params(core_attention_bias_type="post_scale_bias",
                                      core_attention_bias_shape="1hss"),
        "pre_scale_bias": gpu_params(core_attention_bias_type="pre_scale_bias",
                                     core_attention_bias_shape="1hss"),
        "dropout 1": gpu_params(attention_dropout=1.0),
        "cpu": gpu_params(device_type="cpu", compute_capability=None),
    }
    for name, params in declined.items():
        assert flash.not_supported_reasons(params), name


def test_declines_what_the_build_lacks(monkeypatch):
    built_extension(monkeypatch, INSTANTIATIONS=["bf16_hdim64", "bf16_hdim128"])
    assert flash.not_supported_reasons(gpu_params(head_dim_qk=128, head_dim_v=128)) == []
    assert flash.not_supported_reasons(gpu_params(head_dim_qk=96, head_dim_v=96)) == []
    reasons = flash.not_supported_reasons(gpu_params(head_dim_qk=160, head_dim_v=160))
    assert reasons == ["as this build has no bf16_hdim192 kernel for head dim 160 (built: "
                       "bf16_hdim64, bf16_hdim128 of the sm80 family, which serves every call; "
                       "see TRANSFORMER_FA_FLASH_KERNELS)"], reasons
    reasons = flash.not_supported_reasons(gpu_params(dtype=torch.float16))
    assert reasons and "no fp16_hdim128 kernel" in reasons[0], reasons


def test_a_failing_check_is_a_reason_not_an_exception(monkeypatch):
    monkeypatch.setattr(flash, "is_built", lambda: 1 / 0)
    assert flash.not_supported_reasons(gpu_params()) == [
        "as its support check failed (ZeroDivisionError: division by zero)"]


def test_declines_te_features_it_lacks_and_the_log_says_why(monkeypatch):
    built_extension(monkeypatch)
    cases = {
        "off-by-one": (dict(softmax_type="off-by-one"),
                       "as it does not support softmax_type = off-by-one"),
        "learnable": (dict(softmax_type="learnable"),
                      "as it does not support softmax_type = learnable"),
        "max logit": (dict(return_max_logit=True),
                      "as it does not support return_max_logit = True"),
        "softcap": (dict(softcap=30.0), "as it does not support softcap = 30.0"),
    }
    logger = logging.getLogger("DotProductAttention")
    lines = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        for name, (changes, reason) in cases.items():
            assert flash.not_supported_reasons(gpu_params(**changes)) == [reason], name
            lines.clear()
            chosen = selection._decide(gpu_params(**changes),
                                       dict.fromkeys(selection.SWITCHES, True))
            assert f"Disabling FlashAttention {reason}" in lines, (name, lines)
            assert chosen != flash.NAME, name
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_decode_kernel_takes_forward_only_decode_sized_calls(monkeypatch):
    """The split-KV decode kernel serves forward-only calls of at most DECODE_MAX_ROWS query
    rows per KV head (and then reads paged caches whose pages hold whole 16-key chunks); a
    prefill, a call needing gradients, dropout, ALiBi or a named kernel family do not use it."""
    monkeypatch.delenv("TRANSFORMER_FA_FLASH_FAMILY", raising=False)
    step = gpu_params(max_seqlen_q=4, num_heads=32, num_gqa_groups=8, max_seqlen_kv=4096,
                      attn_mask_type="padding_causal_bottom_right")
    assert flash.uses_decode_kernel(step)  # 4 tokens x 4 heads per KV head = 16 rows
    assert flash.reads_kv_pages(dataclasses.replace(step, kv_page_size=64))
    assert not flash.reads_kv_pages(dataclasses.replace(step, kv_page_size=8))
    assert not flash.reads_kv_pages(step)  # not paged
    prefill = dataclasses.replace(step, max_seqlen_q=17, kv_page_size=64)  # 68 rows
    assert not flash.uses_decode_kernel(prefill) and not flash.reads_kv_pages(prefill)
    for change in (dict(requires_grad=True), dict(attention_dropout=0.1),
                   dict(core_attention_bias_type="alibi", alibi_slopes_shape=(32,))):
        assert not flash.uses_decode_kernel(dataclasses.replace(step, **change)), change
    monkeypatch.setenv("TRANSFORMER_FA_FLASH_FAMILY", "sm80")
    assert not flash.uses_decode_kernel(step)
