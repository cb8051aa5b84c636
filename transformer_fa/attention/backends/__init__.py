"""Attention backends.

Each module (fused: a package) here is one backend and has the same three names:

- ``NAME``: the backend's exact name ("FlashAttention", "FusedAttention",
  "UnfusedDotProductAttention"), used by the env switches and the logs.
- ``not_supported_reasons(params: AttentionParams) -> list[str]``: why this backend cannot
  serve the call, each reason a phrase that reads after "Disabling <NAME> " (for example
  "as it does not support head_dim_qk = 72"). Empty means supported. It claims only what
  the backend's tests cover. Never raises.
- ``run(inputs: AttentionInputs, params: AttentionParams) -> torch.Tensor``: the attention
  output with heads merged, differentiable w.r.t. q, k, v (and a bias that requires grad):
  ``[sq, b, h*dv]`` for sbhd q, ``[b, sq, h*dv]`` for bshd, ``[t, h*dv]`` for thd, dtype of q.
  Query rows that a padding mask removes, and rows with every key masked, are zero.

Optional:

- ``reads_kv_pages(params) -> bool``: True if ``run`` reads a paged KV cache's page pools
  through the page table for this call (``params.kv_page_size > 0``: ``inputs.k`` / ``inputs.v``
  are ``[total_pages, page_size, h_kv, d]``, ``inputs.page_table`` ``[b, pages_per_seq]``).
  Without it, or when it says False, DotProductAttention gathers the pages into contiguous
  ``[b, max_seqlen_kv, h_kv, d]`` K and V first and ``run`` gets ``kv_page_size`` 0 and no
  page table. Never raises.
"""
from . import flash, fused, unfused

# Preference order when several can run (selection.py may reorder per GPU architecture).
ALL_BACKENDS = (flash, fused, unfused)
