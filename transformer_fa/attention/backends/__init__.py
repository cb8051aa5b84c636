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
"""
from . import flash, fused, unfused

# Preference order when several can run (selection.py may reorder per GPU architecture).
ALL_BACKENDS = (flash, fused, unfused)
