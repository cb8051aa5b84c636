"""Which of TE's tests are not run against transformer_fa, each with its reason.

A rule names a test function of a suite file (fnmatch pattern on ``file::function``),
optionally only for some parameter values, the reason (reasons.py: FP8 / parallelism /
KV cache / TE-internal API with no equivalent) and what exactly is missing. Tests that need
CUDA on a machine without it are not deselected here: the plugin reports them as skipped.
"""
import fnmatch
from typing import Any, Dict, NamedTuple, Optional

from reasons import FP8, KV_CACHE, PARALLELISM, TE_API


class Rule(NamedTuple):
    pattern: str  # "test_numerics.py::test_gpt_fp8_parameters"; fnmatch wildcards allowed
    reason: str  # one of reasons.ALL
    detail: str  # what the test needs that transformer_fa does not have
    params: Optional[Dict[str, Any]] = None  # only when every listed parameter has this value

    def matches(self, file_name: str, function: str, params: Dict[str, Any]) -> bool:
        if not fnmatch.fnmatchcase(f"{file_name}::{function}", self.pattern):
            return False
        return all(k in params and params[k] == v for k, v in (self.params or {}).items())


N = "test_numerics.py::"
A = "test_attention.py::"

RULES = [
    # --- test_numerics.py -------------------------------------------------------------------
    Rule(N + "test_gpt_*_activation_recompute", FP8,
         "FP8 recipe parameter (runs only with an FP8 recipe; with none pytest skips it)"),
    Rule(N + "test_gpt_full_activation_recompute_with_inner_autocast", FP8,
         "FP8 autocast inside checkpoint, FP8GlobalStateManager recompute buffers"),
    Rule(N + "test_checkpoint_*fp8*", FP8, "FP8 recompute regions (transformer_engine.pytorch"
         ".distributed.is_fp8_activation_recompute_enabled)"),
    Rule(N + "test_gpt_fp8_parameters", FP8, "FP8 model parameters"),
    Rule(N + "test_fp8gemm_with_unfused_quantization", FP8,
         "FP8 quantizers and general_gemm of transformer_engine_torch"),
    Rule(N + "test_linear_accuracy_save_original_input", FP8,
         "save_original_input only matters with FP8; the test runs with main_grad "
         "(fuse_wgrad_accumulation=True)"),
    Rule(N + "test_*_accuracy_delay_wgrad_compute", PARALLELISM,
         "delay_wgrad_compute / backward_dw() and fuse_wgrad_accumulation (main_grad) serve "
         "pipeline / data-parallel schedules"),
    Rule(N + "test_gpt_checkpointing", FP8,
         "saves and restores TE's FP8 extra state (_extra_state.UNSAFE_PICKLE_EXTRA_STATE_ENV)"),
    # --- test_attention.py ------------------------------------------------------------------
    Rule(A + "test_flash_attention_*", TE_API,
         "version policy of the flash-attn package (FlashAttentionUtils); transformer_fa's "
         "FlashAttention is its own kernels"),
    Rule(A + "test_dpa_fa4_*", TE_API, "flash-attn v4 package (FlashAttentionUtils)"),
    Rule(A + "test_dpa_num_splits", KV_CACHE, "num_splits (FlashAttention-3 split-KV decoding)"),
    Rule(A + "test_dpa_fp8_*", FP8, "FP8 attention"),
    Rule(A + "test_mha_fp8_vs_f16", FP8, "FP8 attention"),
    Rule(A + "test_dpa_fp8_vs_f16", FP8, "FP8 attention"),
    Rule(A + "test_custom_mha_fp8_vs_f16", FP8,
         "FP8 attention through transformer_engine_torch's fused_attn_fwd/bwd"),
]


def find_rule(file_name: str, function: str, params: Dict[str, Any]) -> Optional[Rule]:
    """The first rule that deselects this test, or None."""
    return next((r for r in RULES if r.matches(file_name, function, params)), None)
