"""AttentionParams: one frozen description of a DotProductAttention call.

Built once per forward from the validated inputs. Backends decide what they support from
it alone (``not_supported_reasons(params)``), and the selector caches its decision by it,
so every field is hashable and nothing in it refers to tensor data.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Tuple

import torch

MASK_TYPES = (
    "no_mask",
    "padding",
    "causal",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)
BIAS_TYPES = ("no_bias", "pre_scale_bias", "post_scale_bias", "alibi")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")  # TE's softmax_type values


def diagonal_is_bottom_right(attn_mask_type: str, bottom_right_diagonal: bool = True) -> bool:
    """TE's diagonal alignment: causal and padding_causal are top-left and the *_bottom_right
    types bottom-right whatever is asked; the others follow ``bottom_right_diagonal``."""
    if attn_mask_type in ("causal", "padding_causal"):
        return False
    return "bottom_right" in attn_mask_type or bool(bottom_right_diagonal)


@dataclasses.dataclass(frozen=True)
class AttentionParams:
    qkv_format: str  # as given: "sbhd", "bshd", "thd", "sbhd_2bshd", ...
    q_format: str  # "sbhd" | "bshd" | "thd"
    kv_format: str  # "sbhd" | "bshd" | "thd"
    qkv_layout: str  # TE layout string, e.g. "sb3hd", "bshd_bs2hd", "thd_thd_thd"
    batch_size: int
    num_heads: int  # query heads
    num_gqa_groups: int  # key/value heads
    max_seqlen_q: int
    max_seqlen_kv: int
    head_dim_qk: int
    head_dim_v: int
    dtype: torch.dtype
    device_type: str  # "cuda" | "cpu" | ...
    compute_capability: Optional[Tuple[int, int]]  # None off CUDA
    attn_mask_type: str  # one of MASK_TYPES
    window_size: Tuple[int, int]  # (-1, -1) = unlimited; causal masks have right == 0
    core_attention_bias_type: str  # one of BIAS_TYPES
    core_attention_bias_shape: Optional[str]  # "1hss" | "b1ss" | "bhss" | "11ss" | None
    core_attention_bias_requires_grad: bool
    alibi_slopes_shape: Optional[Tuple[int, ...]]  # (h,) or (b, h); None if no ALiBi
    attention_dropout: float  # the probability in effect for this call (0 in eval mode)
    softmax_scale: float
    deterministic: bool  # NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or torch's deterministic mode
    requires_grad: bool  # any of q, k, v needs a gradient
    is_compiling: bool = False  # inside torch.compile tracing
    # TE's softmax_type: "vanilla"; "off-by-one" adds 1 to the denominator (a zero-logit sink);
    # "learnable" adds exp(softmax_offset[h]) (per-head learnable sink, as in gpt-oss).
    softmax_type: str = "vanilla"
    # TE's return_max_logit: run returns (output, max_logit), max_logit [h] in the output's
    # dtype: per head, the largest scaled, biased, unmasked logit over the batch.
    return_max_logit: bool = False
    softcap: float = 0.0  # logits -> softcap * tanh(logits / softcap) when > 0 (FA2/Gemma 2)
    # TE's bottom_right_diagonal for non-causal masks (windows, ALiBi): False = top-left.
    bottom_right_diagonal: bool = True
    # 0: k and v are ordinary tensors. > 0: k and v are the page pools ``[total_pages,
    # kv_page_size, h_kv, d]`` of a paged KV cache (kv_format "bshd"), read through
    # ``AttentionInputs.page_table``; max_seqlen_kv is the table's pages per row * kv_page_size.
    # Only a backend whose ``reads_kv_pages(params)`` says so gets them; every other backend
    # gets the pages gathered into ``[b, max_seqlen_kv, h_kv, d]`` and this field at 0.
    kv_page_size: int = 0

    @property
    def is_padding(self) -> bool:
        return "padding" in self.attn_mask_type

    @property
    def is_causal(self) -> bool:
        return "causal" in self.attn_mask_type

    @property
    def is_bottom_right(self) -> bool:
        """Diagonal (causal and sliding window, ALiBi) aligned to the bottom-right corner."""
        return diagonal_is_bottom_right(self.attn_mask_type, self.bottom_right_diagonal)

    @property
    def is_varlen(self) -> bool:
        """Sequences carry their own lengths (thd, or a padding mask)."""
        return self.is_padding or "thd" in (self.q_format, self.kv_format)

    @property
    def has_window(self) -> bool:
        return self.window_size != (-1, -1) and not (
            self.is_causal and self.window_size == (-1, 0)
        )

    def as_log_dict(self) -> dict:
        """Fields as plain values, for the `Running with config=...` log line."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = str(value) if isinstance(value, torch.dtype) else value
        return out


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(AttentionParams))
_in_field_order = operator.itemgetter(*FIELD_NAMES)


def params_fields(**values) -> tuple:
    """AttentionParams' field values in order, without building one:
    ``AttentionParams(*params_fields(**kw)) == AttentionParams(**kw)``."""
    if torch.compiler.is_compiling():  # the tracer cannot call an itemgetter
        return tuple(values[name] for name in FIELD_NAMES)
    return _in_field_order(values)


@dataclasses.dataclass
class AttentionInputs:
    """The tensors of one call, validated, handed to the selected backend's ``run``.

    q, k, v keep the strides of the layout named in ``params.qkv_layout`` (proven by
    ``layout.detect_qkv_layout``; anything else was made contiguous). Their formats are
    ``params.q_format`` and ``params.kv_format``.
    cu_seqlens_q / cu_seqlens_kv: int32 ``[b + 1]`` on q's device; set for thd tensors and for
    every padding mask type (built from ``attention_mask`` for sbhd/bshd), else None.
    attention_mask: bool, True = masked out, broadcastable to ``[b, h, sq, skv]``; only for
    ``arbitrary``.
    core_attention_bias: ``[1|b, 1|h, sq, skv]`` for pre/post_scale_bias, else None.
    alibi_slopes: float32 ``[h]`` or ``[b, h]`` when the bias type is ``alibi``, else None.
    softmax_offset: ``[h]`` for ``params.softmax_type`` "off-by-one" (zeros) and "learnable"
    (the module's parameter, with its gradient), else None. A backend must add
    ``exp(softmax_offset[h])`` to every softmax denominator of head h.
    page_table: only when ``params.kv_page_size > 0`` (k and v are then page pools
    ``[total_pages, page_size, h_kv, d]``): int32 ``[b, pages_per_seq]`` on q's device, row i
    listing sequence i's pages in order (``pages_per_seq * page_size == params.max_seqlen_kv``;
    stride 1 in its last dim, rows may be strided: read ``page_table.stride(0)``). Sequence i's
    keys are its first ``cu_seqlens_kv[i + 1] - cu_seqlens_kv[i]`` cached tokens; entries past
    them are unused. Else None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_kv: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None
    core_attention_bias: Optional[torch.Tensor] = None
    alibi_slopes: Optional[torch.Tensor] = None
    softmax_offset: Optional[torch.Tensor] = None
    page_table: Optional[torch.Tensor] = None
