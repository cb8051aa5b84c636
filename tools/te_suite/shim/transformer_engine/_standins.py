"""The few TE internals that TE's test helpers call on every test, expressed in transformer_fa.

None computes what a test checks: they answer questions about transformer_fa (which backends
support a configuration, that there is no FP8 state) so that TE's helpers can pick the
backends to compare. Everything else TE-internal is a placeholder (see _shim.py).
"""
import math
import types

import torch

from transformer_fa.attention import selection
from transformer_fa.attention.backends import ALL_BACKENDS
from transformer_fa.attention.params import AttentionParams

# TE's backend-selection cache flags. transformer_fa rereads NVTE_* on every call and keeps no
# such flags, so TE's writes here have nothing to invalidate.
_attention_backends = {}

# TE's cuDNN sub-backends by name. transformer_fa's FusedAttention is cuDNN's F16 SDPA for any
# sequence length ("F16_arbitrary_seqlen"); the others do not exist here.
FusedAttnBackend = {name: name for name in
                    ("F16_max512_seqlen", "F16_arbitrary_seqlen", "FP8", "No_Backend")}


class FP8GlobalStateManager:
    """transformer_fa keeps no FP8 state: there is nothing to reset, and FP8 is never on."""

    @staticmethod
    def reset() -> None:
        pass

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False


class AttentionLogging:
    """transformer_fa configures its "DotProductAttention" logger from NVTE_DEBUG itself."""
    _is_logging_setup = True

    @staticmethod
    def setup_logging() -> None:
        pass


class FlashAttentionUtils:
    """TE's facts about the flash-attn package. transformer_fa's FlashAttention is its own
    kernels, not that package: no version gates a feature (each backend's
    ``not_supported_reasons`` decides per configuration), and there is no FA3 / FA4."""
    v2_3_plus = True
    v3_is_installed = False
    v4_is_installed = False


def TEAttentionParams(**fields):
    """TE's AttentionParams(...) as built by TE's tests: the fields, kept for the adapter."""
    return types.SimpleNamespace(**fields)


def _unsupported_here(te) -> bool:
    """Requests of features transformer_fa does not have: no backend can serve them."""
    return bool(getattr(te, "fp8", False) or getattr(te, "context_parallel", False)
                or getattr(te, "inference_params", None) is not None
                or getattr(te, "has_score_mod", False) or getattr(te, "num_splits", 1) != 1)


def _params_from_te(te) -> AttentionParams:
    parts = te.qkv_layout.split("_")
    q_format = "".join(c for c in parts[0] if c.isalpha())
    kv_format = "".join(c for c in parts[-1] if c.isalpha())
    cuda = torch.cuda.is_available()
    bias_shape = te.core_attention_bias_shape
    return AttentionParams(
        qkv_format=q_format if q_format == kv_format else f"{q_format}_2{kv_format}",
        q_format=q_format, kv_format=kv_format, qkv_layout=te.qkv_layout,
        batch_size=te.batch_size, num_heads=te.num_heads, num_gqa_groups=te.num_gqa_groups,
        max_seqlen_q=te.max_seqlen_q, max_seqlen_kv=te.max_seqlen_kv,
        head_dim_qk=te.head_dim_qk, head_dim_v=te.head_dim_v, dtype=te.qkv_dtype,
        device_type="cuda" if cuda else "cpu",
        compute_capability=torch.cuda.get_device_capability() if cuda else None,
        attn_mask_type=te.attn_mask_type, window_size=tuple(te.window_size),
        core_attention_bias_type=te.core_attention_bias_type,
        core_attention_bias_shape=bias_shape,
        core_attention_bias_requires_grad=te.core_attention_bias_requires_grad,
        alibi_slopes_shape=(tuple(te.alibi_slopes_shape) if te.alibi_slopes_shape is not None
                            else None),
        attention_dropout=te.attention_dropout if te.is_training else 0.0,
        softmax_scale=1.0 / math.sqrt(te.head_dim_qk), deterministic=te.deterministic,
        requires_grad=te.is_training, softmax_type=te.softmax_type,
        return_max_logit=te.return_max_logit)


def get_attention_backend(te):
    """TE's answer shape, from transformer_fa's own backends:
    (use_flash, flash_version, use_fused, fused_sub_backend, use_unfused, [flash, fused,
    unfused] available)."""
    if _unsupported_here(te):
        return False, None, False, None, False, [False, False, False]
    params = _params_from_te(te)
    ok = {b.NAME: not b.not_supported_reasons(params) for b in ALL_BACKENDS}
    chosen = next((b.NAME for b in selection.preference_order(params) if ok[b.NAME]), None)
    flash, fused, unfused = ("FlashAttention", "FusedAttention", "UnfusedDotProductAttention")
    return (chosen == flash, None, chosen == fused,
            FusedAttnBackend["F16_arbitrary_seqlen"] if ok[fused] else None,
            chosen == unfused, [ok[flash], ok[fused], ok[unfused]])
