"""torch.compile with dynamic shapes on a GPU, through FlashAttention and FusedAttention.

One compiled TransformerLayer (bf16, RoPE, GQA, fullgraph=True, dynamic=True) runs three
shapes (batch and sequence length changing) and must compile one graph for all of them, run
the backend it was asked for, and match eager forward and backward. The backend is decided at
trace time for the first shape; the others reuse the graph, so this is the check that the
kernels' ops take symbolic sizes. Skipped without CUDA, or where the backend is not available.
"""
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from torch._dynamo.utils import counters  # noqa: E402

import transformer_fa as tfa  # noqa: E402
from test_compile import outputs_and_grads, packed_lengths  # noqa: E402
from transformer_fa.attention.rope import RotaryPositionEmbedding  # noqa: E402

HIDDEN, FFN, HEADS, GROUPS = 512, 768, 8, 2
HEAD_DIM = HIDDEN // HEADS  # 64
# No size equals a fixed one (heads, groups, head dim, hidden) at the first trace: dynamo gives
# equal sizes one symbol (duck shaping), which would pin the batch or the length.
SHAPES = [(5, 136), (6, 200), (7, 72)]
BACKENDS = {"FlashAttention": "NVTE_FUSED_ATTN", "FusedAttention": "NVTE_FLASH_ATTN"}


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_layer_compiles_once_for_a_family_of_shapes(backend, fmt, monkeypatch):
    monkeypatch.setenv(BACKENDS[backend], "0")  # the other kernel backend off
    # Compiled graphs run the norms and RoPE in PyTorch (torch.compile fuses them itself);
    # eager would take the Triton kernels, whose rounding differs (they have their own tests,
    # tests/gpu/test_triton_kernels_gpu.py): compare the same math.
    monkeypatch.setenv("TRANSFORMER_FA_TRITON_KERNELS", "0")
    torch.manual_seed(0)
    layer = tfa.TransformerLayer(
        HIDDEN, FFN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", activation="swiglu", attn_input_format=fmt,
        params_dtype=torch.bfloat16, device="cuda")
    freqs = RotaryPositionEmbedding(HEAD_DIM)(max(s for _, s in SHAPES))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for batch, seqlen in SHAPES:
        kwargs = dict(rotary_pos_emb=freqs)
        if fmt == "thd":
            cu = packed_lengths(batch, seqlen).cuda()
            x = torch.randn(int(cu[-1]), HIDDEN, device="cuda", dtype=torch.bfloat16)
            kwargs.update(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seqlen,
                          max_seqlen_kv=seqlen)
        else:
            x = torch.randn(batch, seqlen, HIDDEN, device="cuda", dtype=torch.bfloat16)
        params = list(layer.parameters())
        out_ref, grads_ref = outputs_and_grads(layer, [x], kwargs, params)
        if layer.self_attention.core_attention.last_backend != backend:
            pytest.skip(f"{backend} is not available here "
                        f"(eager ran {layer.self_attention.core_attention.last_backend})")
        out, grads = outputs_and_grads(compiled, [x], kwargs, params)
        assert layer.self_attention.core_attention.last_backend == backend
        torch.testing.assert_close(out, out_ref, atol=2e-2, rtol=2e-2)
        for grad, grad_ref in zip(grads, grads_ref):
            torch.testing.assert_close(grad, grad_ref, atol=5e-2, rtol=5e-2)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
