"""UnfusedDotProductAttention on CUDA in fp16/bf16 (run on the lent GPU; skipped without CUDA).

Error rule (FlashAttention's): for the output and every gradient, the max error against the
float64 reference is at most 2x that of the same math done in the input dtype, plus atol.
"""
import itertools

import pytest
import torch

from cases import output_rows
from test_unfused import CASES, run_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def unfused_only(monkeypatch):
    """These tests are about the unfused backend: switch the others off."""
    monkeypatch.setenv("NVTE_FLASH_ATTN", "0")
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
ATOL = 1e-3


def assert_within_rule(got, ref64, ref_lowp, what):
    err = (got.double() - ref64).abs().max().item() if got.numel() else 0.0
    base = (ref_lowp.double() - ref64).abs().max().item() if got.numel() else 0.0
    assert err <= 2 * base + ATOL, f"{what}: error {err:.3g} > 2 x {base:.3g} + {ATOL}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qkv_format,mask_type,window,gqa", CASES)
def test_forward_cuda(dtype, qkv_format, mask_type, window, gqa):
    case = run_case(qkv_format, mask_type, window, *gqa, dtype=dtype, dq=32, dv=32, device="cuda")
    assert case["out"].dtype == dtype and case["out"].is_cuda
    for i, (got, ref) in enumerate(zip(case["outs"], case["refs"])):
        seq = [t[i] for t in case["seqs"]]
        assert_within_rule(got, ref, case["reference"](i, *seq, dtype=dtype), f"out[{i}]")
    assert case["pad"].numel() == 0 or case["pad"].abs().max() == 0


GRAD_CASES = list(itertools.product(
    ["sbhd", "bshd", "thd", "thd_2bshd"],
    ["causal", "padding_causal_bottom_right", "no_mask"],
    [None, (4, 0)], [(4, 4), (4, 1)]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qkv_format,mask_type,window,gqa", GRAD_CASES)
def test_gradients_cuda(dtype, qkv_format, mask_type, window, gqa):
    case = run_case(qkv_format, mask_type, window, *gqa, dtype=dtype, dq=32, dv=32, grad=True,
                    device="cuda")
    gen = torch.Generator().manual_seed(1)
    grads_out = [torch.randn(r.shape, generator=gen, dtype=torch.float64) for r in case["refs"]]
    loss = sum((o.double() * g).sum() for o, g in zip(case["outs"], grads_out))
    got = torch.autograd.grad(loss, case["inputs"])
    (q_fmt, kv_fmt), (lens_q, lens_kv) = case["formats"], case["lens"]
    for i, seq in enumerate(zip(*case["seqs"])):
        per_dtype = {}
        for dt in (torch.float64, dtype):
            leaves = [t.to(dt).requires_grad_() for t in seq]
            ref = case["reference"](i, *leaves, dtype=dt)
            per_dtype[dt] = torch.autograd.grad((ref.double() * grads_out[i]).sum(), leaves)
        for idx, name, fmt, lens in ((0, "dq", q_fmt, lens_q), (1, "dk", kv_fmt, lens_kv),
                                     (2, "dv", kv_fmt, lens_kv)):
            g = got[idx].cpu()
            rows, _ = output_rows(g.reshape(*g.shape[:-2], -1), fmt, lens, g.shape[-2])
            assert_within_rule(rows[i], per_dtype[torch.float64][idx], per_dtype[dtype][idx],
                               f"{name}[{i}]")

