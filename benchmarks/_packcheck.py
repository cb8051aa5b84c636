import os, torch, transformer_fa as te
from transformer_fa.attention.backends import support
orig = support.packed_extent
def grads(backend, interleaved, packed):
    for n in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ[n] = "1" if n == backend else "0"
    import transformer_fa.attention.backends.flash as fl, transformer_fa.attention.backends.fused.ops as fo
    f = orig if packed else (lambda t: None)
    fl.packed_extent = fo.packed_extent = f
    torch.manual_seed(0)
    mha = te.MultiheadAttention(512, 8, attn_mask_type="causal", params_dtype=torch.bfloat16, qkv_weight_interleaved=interleaved, device="cuda")
    x = torch.randn(256, 2, 512, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    mha(x).float().square().sum().backward()
    return x.grad.float(), mha.layernorm_qkv.weight.grad.float() if hasattr(mha, "layernorm_qkv") else mha.qkv.weight.grad.float() if hasattr(mha,"qkv") else None
for backend in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
    for inter in (True, False):
        a = grads(backend, inter, True)[0]; b = grads(backend, inter, False)[0]
        print(backend, inter, "packed vs not: max diff", (a-b).abs().max().item(), "scale", b.abs().max().item())
