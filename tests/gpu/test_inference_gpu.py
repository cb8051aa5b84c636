"""KV cache inference on CUDA in bf16, with each backend forced (NVTE_FLASH_ATTN /
NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN): the cached steps of a TransformerLayer stack against
each whole sequence without a cache.

Error rule: the cached bf16 outputs' max error against the float32 reference (unfused, no
cache) is at most 2x that of the same stack in bf16 without a cache, plus ATOL. A backend that
declines the cache's varlen call is skipped with its reason (printed with -rs).
"""
import pytest
import torch

from kv_cache_cases import (SCHEDULE, Config, make_params, make_stack, reference_outputs,
                            rope_table, run_schedule, sequence_inputs)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CFG = Config(hidden=256, heads=4, gqa=2, max_seqlen=64)  # head dim 64: every backend's
BACKENDS = {"FlashAttention": "NVTE_FLASH_ATTN", "FusedAttention": "NVTE_FUSED_ATTN",
            "UnfusedDotProductAttention": "NVTE_UNFUSED_ATTN"}
ATOL = 2e-2
NO_BACKEND = "No dot product attention backend is available"


def force_backend(monkeypatch, backend):
    for name, var in BACKENDS.items():
        monkeypatch.setenv(var, "1" if name == backend else "0")


def run_or_skip(fn):
    """fn(), or a skip naming why the forced backend declined."""
    try:
        return fn()
    except (RuntimeError, ValueError) as exc:
        if NO_BACKEND in str(exc):
            pytest.skip(str(exc))
        raise


def max_error(outputs, reference):
    return max((out.float() - reference[seq][start:end]).abs().max().item()
               for seq, out, (start, end) in outputs)


@pytest.mark.parametrize("is_paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("qkv_format", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_cache_equals_recomputing_whole_sequences_cuda(backend, qkv_format, is_paged,
                                                       monkeypatch):
    dtype, device = torch.bfloat16, "cuda"
    rope = rope_table(device, cfg=CFG)
    inputs32 = sequence_inputs(SCHEDULE, device=device, cfg=CFG)
    # float32 reference: only the unfused backend serves float32.
    expected = reference_outputs(make_stack("bshd", device=device, cfg=CFG), inputs32, rope)

    force_backend(monkeypatch, backend)
    inputs = {seq: x.to(dtype) for seq, x in inputs32.items()}
    plain_stack = make_stack("bshd", dtype=dtype, device=device, cfg=CFG)
    plain = run_or_skip(lambda: reference_outputs(plain_stack, inputs, rope))
    base = max_error([(seq, out, (0, out.shape[0])) for seq, out in plain.items()], expected)

    stack = make_stack(qkv_format, dtype=dtype, device=device, cfg=CFG)
    params = make_params(qkv_format, is_paged, dtype=dtype, device=device, page_size=16,
                         cfg=CFG)
    outputs = []
    steps = run_schedule(stack, params, inputs, qkv_format, rope)
    for _, outs, positions in run_or_skip(lambda: list(steps)):
        outputs += [(seq, out, positions[seq]) for seq, out in outs.items()]
    assert stack[0].self_attention.core_attention.last_backend == backend
    err = max_error(outputs, expected)
    assert err <= 2 * base + ATOL, f"{backend}: cached error {err:.3g} > 2 x {base:.3g} + {ATOL}"
