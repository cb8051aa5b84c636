"""The split-KV decode kernel (csrc/flash/sm80/decode_kernel.cuh) against float32 math: a few
query tokens per sequence against a long K/V, contiguous and paged (block tables, pages in
shuffled order), ragged cached lengths, GQA/MQA groups, bottom-right causal masks and sliding
windows, every head dim, forced and chosen numbers of splits; and DotProductAttention routing
forward-only decode calls to it.
"""
import math

import pytest
import torch

import transformer_fa as te
from transformer_fa.attention.backends import flash

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and flash.is_built()),
                                reason="needs CUDA and the built kernels")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def reference(q, k, v, lens, causal, window):
    """float32 attention of q [b, sq, h, d] over the first lens[i] keys of k, v [b, s, h_k, d];
    bottom-right diagonal; rows with no key are zeros."""
    b, sq, h, d = q.shape
    group = h // k.shape[2]
    out = torch.zeros(b, sq, h, d, dtype=torch.float32, device=q.device)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        kk = k[i, :n].float().repeat_interleave(group, dim=1)  # [n, h, d]
        vv = v[i, :n].float().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[i].float(), kk) / math.sqrt(d)
        qpos = torch.arange(sq, device=q.device)[:, None] + n - sq
        kpos = torch.arange(n, device=q.device)[None, :]
        keep = torch.ones(sq, n, dtype=torch.bool, device=q.device)
        left, right = window
        if causal:
            right = 0
        if right >= 0:
            keep &= kpos <= qpos + right
        if left >= 0:
            keep &= kpos >= qpos - left
        s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[i] = torch.einsum("hqk,khd->qhd", p, vv)
    return out


def paged(k, v, page_size, generator):
    """k, v [b, s, h_k, d] as shuffled page pools and the block table that reads them back."""
    b, s = k.shape[:2]
    pages = math.ceil(s / page_size)
    pad = pages * page_size - s
    kp, vp = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)) for t in (k, v))
    order = torch.randperm(b * pages, generator=generator).to(k.device)
    pool_k = torch.empty(b * pages, page_size, *k.shape[2:], dtype=k.dtype, device=k.device)
    pool_v = torch.empty_like(pool_k)
    pool_k[order] = kp.reshape(b * pages, page_size, *k.shape[2:])
    pool_v[order] = vp.reshape(b * pages, page_size, *k.shape[2:])
    table = order.view(b, pages).to(torch.int32)
    return pool_k, pool_v, table


CASES = [
    # b, sq, h, h_k, d, s_cache, lens (None: all), causal, window, page_size, splits
    (2, 1, 8, 2, 128, 1000, None, False, (-1, -1), None, 0),
    (3, 1, 32, 8, 128, 4096, [4096, 17, 0], False, (-1, -1), None, 0),
    (2, 1, 8, 8, 64, 777, [777, 300], True, (-1, -1), None, 3),
    (2, 4, 8, 2, 128, 600, [600, 33], True, (-1, -1), None, 0),
    (2, 3, 16, 2, 256, 900, [900, 5], True, (100, -1), None, 0),
    (1, 1, 32, 1, 128, 5000, None, False, (-1, -1), None, 0),  # MQA: two row tiles
    (2, 2, 6, 2, 192, 300, [300, 299], True, (-1, -1), None, 1),
    (2, 1, 8, 2, 128, 2048, [2048, 1500], False, (-1, -1), 16, 0),
    (2, 5, 8, 2, 64, 2000, [2000, 64], True, (-1, -1), 64, 0),
    (3, 1, 16, 4, 128, 4096, [4096, 100, 1], False, (256, -1), 256, 7),
    (2, 2, 8, 2, 96, 700, [700, 45], True, (-1, -1), 16, 0),  # d96 on the d128 kernel
    (2, 1, 8, 2, 128, 1000, [1000, 477], False, (-1, -1), 48, 0),  # a page size not a power of 2
    (2, 3, 16, 4, 256, 900, [900, 113], True, (200, -1), 80, 3),
]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_decode_kernel_matches_reference(case, dtype):
    b, sq, h, h_k, d, s, lens, causal, window, page_size, splits = case
    dtype = DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, h, d, generator=gen).to("cuda", dtype)
    k = torch.randn(b, s, h_k, d, generator=gen).to("cuda", dtype)
    v = torch.randn(b, s, h_k, d, generator=gen).to("cuda", dtype)
    seqlens = None if lens is None else torch.tensor(lens, dtype=torch.int32, device="cuda")
    expected = reference(q, k, v, lens or [s] * b, causal, window)
    if page_size is None:
        out = te.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=causal,
                                         window_size=window, num_splits=splits)
    else:
        pool_k, pool_v, table = paged(k, v, page_size, gen)
        out = te.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=seqlens,
                                         block_table=table, causal=causal, window_size=window,
                                         num_splits=splits)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


# 2-32 splits: each warp writes its own partial (24 and 32: 96 and 128 partials, past the 64 the
# merge loads ahead; the shorter sequence leaves the last splits without keys); 1, 33 and 64:
# the CTA merges its warps (33: a partial per CTA, one past the per-warp limit). Paged too, in
# 48-key pages (not a power of 2; the last one partly filled), read through the block table.
@pytest.mark.parametrize("page_size", [None, 48], ids=["contiguous", "paged48"])
@pytest.mark.parametrize("splits", [1, 2, 5, 24, 32, 33, 64])
def test_every_split_count_gives_the_same_result(splits, page_size):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 8, 128, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2, 3000, 2, 128, generator=gen).to("cuda", torch.bfloat16)
            for _ in range(2))
    lens = torch.tensor([3000, 1234], dtype=torch.int32, device="cuda")
    if page_size is None:
        out = te.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=splits)
    else:
        pool_k, pool_v, table = paged(k, v, page_size, gen)
        out = te.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens,
                                         block_table=table, num_splits=splits)
    expected = reference(q, k, v, [3000, 1234], False, (-1, -1))
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_bad_arguments_are_clear_errors():
    q = torch.randn(1, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 32, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="page_size"):
        te.flash_attn_with_kvcache(q, k[:, :8], k[:, :8], cache_seqlens=8,
                                   block_table=torch.zeros(1, 4, dtype=torch.int32,
                                                           device="cuda"))
    with pytest.raises(ValueError, match="cache_seqlens is required"):
        te.flash_attn_with_kvcache(q, k, k, block_table=torch.zeros(1, 1, dtype=torch.int32,
                                                                     device="cuda"))
    with pytest.raises(TypeError, match="one dtype"):
        te.flash_attn_with_kvcache(q, k.half(), k.half())
    with pytest.raises(ValueError, match="num_splits"):
        te.flash_attn_with_kvcache(q, k, k, num_splits=-1)
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, 32\]"):
        te.flash_attn_with_kvcache(q, k, k, cache_seqlens=33)


def test_dot_product_attention_runs_forward_only_decode_on_the_decode_kernel(monkeypatch):
    calls = []
    real = flash._decode_ext  # the binding's decode call, on run()'s path and a bound runner's
    monkeypatch.setattr(flash, "_decode_ext", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("NVTE_FLASH_ATTN", "1")
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.setenv("NVTE_UNFUSED_ATTN", "0")
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 1, 8, 128, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2, 700, 2, 128, generator=gen).to("cuda", torch.bfloat16)
            for _ in range(2))
    dpa = te.DotProductAttention(8, 128, num_gqa_groups=2, qkv_format="bshd",
                                 attn_mask_type="no_mask")
    with torch.no_grad():
        out = dpa(q, k, v)
    assert calls and dpa.last_backend == flash.NAME
    expected = reference(q, k, v, [700, 700], False, (-1, -1)).flatten(-2)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    with torch.no_grad():  # the same call again: the remembered call's bound runner
        again = dpa(q, k, v)
    assert len(calls) == 2 and torch.equal(again, out)
    q.requires_grad_(True)  # a call that needs gradients stays on the forward kernels
    dpa(q, k, v).sum().backward()
    assert len(calls) == 2


def test_overlapped_merge_reads_this_calls_partials(monkeypatch):
    """On sm_90+ the merge kernel is launched overlapped with the decode kernel and waits for
    its partials on the GPU (griddepcontrol). A call after one with other inputs (the
    workspace then holds that call's partials) gives the same bits as with the launches one
    after the other (TRANSFORMER_FA_OVERLAP_LAUNCHES=0), eagerly and replayed in a CUDA graph."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(8, 1, 32, 128, generator=gen).to("cuda", torch.bfloat16),
               torch.randn(8, 8192, 8, 128, generator=gen).to("cuda", torch.bfloat16),
               torch.randn(8, 8192, 8, 128, generator=gen).to("cuda", torch.bfloat16))

    def call(scale):
        return te.flash_attn_with_kvcache(q * scale, k * scale, v, num_splits=16)

    outs = {}
    for overlap in ("0", "1"):
        monkeypatch.setenv("TRANSFORMER_FA_OVERLAP_LAUNCHES", overlap)
        call(-1.0)  # another call's partials in the workspace
        outs[overlap] = call(1.0)
    assert torch.equal(outs["0"], outs["1"])
    torch.testing.assert_close(outs["1"].float(),
                               reference(q, k, v, [8192] * 8, False, (-1, -1)),
                               atol=2e-2, rtol=2e-2)
    scale = torch.ones((), device="cuda", dtype=torch.bfloat16)
    call(scale)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = call(scale)
    scale.fill_(-1.0)
    graph.replay()
    scale.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, outs["1"])
