"""The layer benchmark's memory on CUDA: what TransformerLayer keeps for its backward against
the same block in plain PyTorch, and the bf16 LayerNorm that keeps no float32 copy."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import transformer_fa as te

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import profile_layer  # noqa: E402
from benchmarks.bench_attention import TorchBlock, tfa_layer  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("path", ["0", "1"], ids=["pytorch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_norm_low_precision_matches_the_float32_path(dtype, path, monkeypatch):
    """LayerNorm at hidden 2048 on x as it is, through PyTorch's CUDA kernel or the Triton
    kernel (TRANSFORMER_FA_FUSED_NORM; the modules take the Triton one there): it computes in
    float32 as the float32 path did, the same results within rounding, and only x (not a
    float32 copy) kept for the backward. PyTorch's kernel gives the float32 path's values
    within assert_close's default tolerances; the Triton kernel sums dgamma / dbeta in another
    float32 order, so its values are checked as the kernel tests check them (relative to the
    largest magnitude: fp16 failed the defaults by that rounding on the H200, 2026-11-28)."""
    monkeypatch.setenv("TRANSFORMER_FA_FUSED_NORM", path)

    def close(actual, expected):
        if path == "0":
            torch.testing.assert_close(actual, expected)
        else:
            from test_triton_kernels_gpu import assert_close  # the kernel tests' rule
            assert_close(actual, expected, dtype)

    torch.manual_seed(0)
    norm = te.LayerNorm(2048, params_dtype=dtype, device="cuda")
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
        norm.bias.normal_(0.0, 0.1)
    x = (torch.randn(4, 256, 2048, device="cuda") * 3 + 1).to(dtype).requires_grad_(True)
    w = norm.weight.detach().clone().requires_grad_(True)
    b = norm.bias.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    dy = torch.randn_like(x)

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = norm(x)
    y_ref = F.layer_norm(x_ref.float(), (2048,), w.float(), b.float(), 1e-5).to(dtype)
    close(y, y_ref)
    y.backward(dy)
    y_ref.backward(dy)
    close(x.grad, x_ref.grad)
    close(norm.weight.grad, w.grad)
    close(norm.bias.grad, b.grad)
    big = [t for t in saved if t.numel() == x.numel()]
    assert [t.dtype for t in big] == [dtype]


def test_layer_saves_no_more_than_the_torch_block():
    """bf16, the benchmark's configuration at a small shape: outside the core attention no
    more bytes than the plain-PyTorch block; with FlashAttention (q, k, v, out, lse, as
    SDPA's kernels) none in all."""
    b, s, hidden, heads, ffn = 2, 256, 512, 8, 2048
    saved = {}
    for name, block in (("ours", tfa_layer), ("torch", TorchBlock)):
        torch.manual_seed(0)
        layer = block(hidden, heads, ffn, torch.bfloat16, "cuda")
        x = torch.randn(b, s, hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        saved[name] = profile_layer.saved_tensors(layer, x)
        if name == "ours":
            backend = layer.self_attention.core_attention.last_backend
    ours, theirs = saved["ours"], saved["torch"]
    assert ours["rest_bytes"] <= theirs["rest_bytes"], (ours["tensors"], theirs["tensors"])
    assert ours["parameter_bytes"] == theirs["parameter_bytes"]
    if backend == "FlashAttention":
        assert ours["activation_bytes"] <= theirs["activation_bytes"], (ours["tensors"],
                                                                         theirs["tensors"])


@pytest.mark.parametrize("backend", ["FlashAttention", "FusedAttention"])
@pytest.mark.parametrize("interleaved", [True, False])
def test_fused_qkv_gradient_is_the_attention_backward_buffer(backend, interleaved, monkeypatch):
    """The fused QKV projection's output gradient is the buffer the attention backward wrote
    dq, dk, dv into (no concatenation of the three), and the gradients equal those of
    separate dq, dk, dv buffers."""
    from transformer_fa.attention.backends import flash
    from transformer_fa.attention.backends.fused import ops as fused_ops

    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv({"FlashAttention": "NVTE_FLASH_ATTN",
                        "FusedAttention": "NVTE_FUSED_ATTN"}[backend], "1")
    torch.manual_seed(0)
    mha = te.MultiheadAttention(512, 8, attn_mask_type="causal", params_dtype=torch.bfloat16,
                                qkv_weight_interleaved=interleaved, attention_dropout=0.0,
                                device="cuda")
    x = torch.randn(256, 2, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    seen = {}

    def keep_q_grad(module, args, out):
        args[0].register_hook(lambda g: seen.setdefault("dq", g))

    def keep_mixed_grad(module, args, out):
        (out[0] if isinstance(out, tuple) else out).register_hook(
            lambda g: seen.setdefault("mixed", g))

    hooks = (mha.core_attention.register_forward_hook(keep_q_grad),
             mha.qkv.register_forward_hook(keep_mixed_grad))
    mha(x).float().square().sum().backward()
    for hook in hooks:
        hook.remove()
    assert mha.core_attention.last_backend == backend
    assert seen["mixed"].untyped_storage().data_ptr() == seen["dq"].untyped_storage().data_ptr()

    grads = [x.grad] + [p.grad for p in mha.parameters()]
    mha.zero_grad(set_to_none=True)
    x.grad = None
    for module in (flash, fused_ops):  # separate dq, dk, dv buffers, concatenated
        monkeypatch.setattr(module, "packed_extent", lambda tensors: None)
    mha(x).float().square().sum().backward()
    for got, want in zip(grads, [x.grad] + [p.grad for p in mha.parameters()]):
        torch.testing.assert_close(got, want)
