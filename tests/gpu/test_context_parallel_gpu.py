"""Context parallelism's CUDA path on one GPU (skipped without CUDA): a world of one over
NCCL. DotProductAttention treats a one-rank group as no CP (as TE), so these tests call the
CP entry point directly: the NCCL all-gather / all-to-all with their autograd, the index
tensors and the dtype handling on the device, against the full attention in float64.
The ring (p2p) needs two ranks: its math is covered by attend / attend_backward here and by
the CPU multi-process tests (tests/test_context_parallel.py)."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import transformer_fa as te
from transformer_fa.attention import context_parallel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEADS, GROUPS, DIM, BATCH, SEQ = 8, 4, 64, 2, 128
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


@pytest.fixture(scope="module")
def world_of_one():
    if not dist.is_nccl_available():
        pytest.skip("needs NCCL")
    with tempfile.TemporaryDirectory() as tmp:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'init')}",
                                rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("comm", ["all_gather", "a2a"])
def test_cp_entry_on_cuda_matches_full_attention(world_of_one, comm, mask, dtype):
    torch.manual_seed(0)
    shapes = [(BATCH, SEQ, h, DIM) for h in (HEADS, GROUPS, GROUPS)]
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.float64) for s in shapes)
    dout = torch.randn(BATCH, SEQ, HEADS * DIM, device="cuda", dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = te.DotProductAttention(HEADS, DIM, GROUPS, qkv_format="bshd",
                                       attn_mask_type=mask)
    expected = reference(*full)
    expected.backward(dout)

    dpa = te.DotProductAttention(HEADS, DIM, GROUPS, qkv_format="bshd", attn_mask_type=mask,
                                 cp_group=world_of_one, cp_comm_type=comm)
    local = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = context_parallel.attention(dpa, *local, "bshd", mask, None, refused={})
    assert out.dtype == dtype and out.is_cuda
    out.backward(dout.to(dtype))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    for name, mine, ref in zip("qkv", local, full):
        torch.testing.assert_close(mine.grad.double(), ref.grad, atol=tol, rtol=tol,
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("window", [None, (-1, 0), (16, 0)])
def test_block_backward_on_cuda_matches_autograd(window):
    """The p2p ring's per-block backward (from the LSE) against autograd of the block."""
    torch.manual_seed(0)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, device="cuda", requires_grad=True)
    k = torch.randn(BATCH, GROUPS, SEQ, DIM, device="cuda", requires_grad=True)
    v = torch.randn(BATCH, GROUPS, SEQ, DIM, device="cuda", requires_grad=True)
    out, lse = context_parallel.attend(q, k, v, DIM ** -0.5, 0, window)
    dout = torch.randn_like(out)
    out.backward(dout)
    delta = (dout * out.detach()).sum(-1)
    dq, dk, dv = context_parallel.attend_backward(q.detach(), k.detach(), v.detach(), dout,
                                                  lse.detach(), delta, DIM ** -0.5, 0, window)
    for name, mine, ref in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: n + m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,q_offset,sq,skv", [
    (None, 0, 128, 256),        # a p2p block without mask
    ((-1, 0), 0, 128, 128),     # the p2p diagonal block
    ((-1, 0), 192, 64, 256),    # all_gather: a local chunk at its global offset (bottom-right)
    ((16, 0), 0, 128, 128),     # a sliding window (all_gather / a2a)
])
@pytest.mark.parametrize("fused_switch", ["0", "1"])
def test_blocks_run_on_the_kernels(window, q_offset, sq, skv, dtype, fused_switch,
                                   monkeypatch):
    """fp16/bf16 CUDA blocks go through cuDNN where the selection picks FusedAttention (on
    Hopper, unless NVTE_FUSED_ATTN=0; not for sliding windows), else the flash kernels
    (forward with the LSE; backward from the final output and LSE), within the kernels'
    error rule of float64 math."""
    monkeypatch.setenv("NVTE_FUSED_ATTN", fused_switch)
    torch.manual_seed(0)
    q = torch.randn(BATCH, HEADS, sq, DIM, device="cuda", dtype=dtype)
    k = torch.randn(BATCH, GROUPS, skv, DIM, device="cuda", dtype=dtype)
    v = torch.randn(BATCH, GROUPS, skv, DIM, device="cuda", dtype=dtype)
    scale = DIM ** -0.5
    assert context_parallel._kernel_call(q, k, v, scale, q_offset, window) is not None
    out, lse = context_parallel.attend(q, k, v, scale, q_offset, window)
    cudnn = (fused_switch == "1" and window in (None, (-1, 0))
             and torch.cuda.get_device_capability() >= (9, 0))
    assert context_parallel.last_block_backend == ("FusedAttention" if cudnn
                                                   else "FlashAttention")
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = context_parallel.attend(*leaves, scale, q_offset, window)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-3, rtol=1e-3)
    dout = torch.randn_like(out).to(dtype)
    ref.backward(dout.double())
    delta = (dout.float() * out).sum(-1)
    # out contiguous in bhsd, as the p2p ring holds it (not in the kernels' bshd layout)
    grads = context_parallel.attend_backward(q, k, v, dout, lse, delta, scale, q_offset, window,
                                             out.contiguous())
    for name, mine, leaf in zip("qkv", grads, leaves):
        assert mine.dtype == dtype
        torch.testing.assert_close(mine.double(), leaf.grad, atol=5e-2, rtol=5e-2,
                                   msg=lambda m, n=name: f"d{n}: {m}")
