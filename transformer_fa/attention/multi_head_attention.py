"""MultiheadAttention: QKV projection, optional RoPE, DotProductAttention, output projection.

Argument names, defaults, parameter names and the fused-QKV weight order follow TE's
``MultiheadAttention``. The fused projection of width ``(np + 2*ng) * hn`` (np query heads,
ng key/value groups, hn head dim) is read as

* ``qkv_weight_interleaved=True``:  ``[ng, np/ng + 2, hn]``, per group its query heads, then
  its key, then its value;
* ``qkv_weight_interleaved=False``: ``[np/ng + 2, ng, hn]``, i.e. all query heads, then all keys,
  then all values (the concatenation of the separate query, key and value weights).

Without ``fuse_qkv_params`` the weights are separate ``query_weight``, ``key_weight``,
``value_weight`` parameters and the second reading applies, as in TE.
"""
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from ..module._common import (
    FollowsParamsDtype,
    check_hidden_states,
    check_positive_int,
    check_te_only_kwargs,
    default_init_method,
    pack_outputs,
    resolve_dtype,
)
from ..module.layernorm import L2Normalization, LayerNorm, RMSNorm
from ..module.linear import LayerNormLinear, Linear
from .. import parallel
from . import context_parallel, inference, masks
from .constants import TENSOR_FORMATS as _FORMATS
from .dot_product_attention import DotProductAttention, check_unsupported_forward_args
from .params import BIAS_TYPES
from .rope import apply_rotary_pos_emb

# qk_norm_type -> the norm of the query / key heads (head size, eps, params dtype, device)
_QK_NORMS = {
    "L2Normalization": lambda size, eps, dtype, device: L2Normalization(eps),
    "RMSNorm": lambda size, eps, dtype, device: RMSNorm(size, eps, params_dtype=dtype,
                                                        device=device),
    "LayerNorm": lambda size, eps, dtype, device: LayerNorm(size, eps, params_dtype=dtype,
                                                            device=device),
}


class _SplitViews(torch.autograd.Function):
    """torch.split into views. Its backward takes the pieces' gradients as the input's
    gradient without a copy where they are laid out as the pieces are in the input (views of
    one buffer, as the attention backends write dq, dk, dv for a packed input); else it
    concatenates them, as torch.split's backward does."""

    @staticmethod
    def forward(ctx, mixed, sizes, dim):
        pieces = torch.split(mixed, sizes, dim)
        ctx.sizes, ctx.dim = sizes, dim % mixed.dim()
        ctx.shape, ctx.stride = mixed.shape, mixed.stride()
        ctx.layout = [(p.stride(), p.storage_offset() - mixed.storage_offset()) for p in pieces]
        return pieces

    @staticmethod
    def backward(ctx, *grads):
        first = grads[0]
        if all(g is not None for g in grads):
            start = first.storage_offset() - ctx.layout[0][1]
            storage = first.untyped_storage().data_ptr()
            if start >= 0 and all(
                    g.dtype == first.dtype and g.untyped_storage().data_ptr() == storage
                    and g.stride() == stride and g.storage_offset() - start == offset
                    for g, (stride, offset) in zip(grads, ctx.layout)):
                return first.as_strided(ctx.shape, ctx.stride, start), None, None
        like = next(g for g in grads if g is not None)
        d = ctx.dim
        grads = [g if g is not None else like.new_zeros((*ctx.shape[:d], n, *ctx.shape[d + 1:]))
                 for g, n in zip(grads, ctx.sizes)]
        return torch.cat(grads, ctx.dim), None, None


def split_views(mixed: torch.Tensor, sizes: Sequence[int], dim: int) -> Tuple[torch.Tensor, ...]:
    """torch.split(mixed, sizes, dim), whose backward needs no concatenation where the
    gradients come back in one buffer (``_SplitViews``)."""
    if torch.compiler.is_compiling() or not mixed.requires_grad:
        return torch.split(mixed, list(sizes), dim)
    return _SplitViews.apply(mixed, list(sizes), dim)


def split_grouped_heads(
    mixed: torch.Tensor, parts: Sequence[int], num_groups: int, head_dim: int, interleaved: bool
) -> Tuple[torch.Tensor, ...]:
    """Split a fused ``[..., sum(parts) * num_groups * head_dim]`` projection into ``[..., h, d]``.

    ``parts`` counts heads per group for each output: ``(np/ng, 1, 1)`` for q, k, v, or ``(1, 1)``
    for k, v. ``interleaved`` reads the last dim as ``[groups, parts, d]``, else as
    ``[parts, groups, d]``.
    The results are views of ``mixed`` where the layout allows it (no copy).
    """
    lead = mixed.shape[:-1]
    if interleaved:
        grouped = mixed.view(*lead, num_groups, sum(parts), head_dim)
        pieces = split_views(grouped, parts, -2)
    else:
        grouped = mixed.view(*lead, sum(parts), num_groups, head_dim)
        pieces = split_views(grouped, parts, -3)
    # Explicit head counts: a -1 would be ambiguous for an empty (s = 0) input.
    return tuple(p.reshape(*lead, n * num_groups, head_dim) for p, n in zip(pieces, parts))


def check_bool_masks(attention_mask, name: str, attn_mask_type: str) -> None:
    """TE requires boolean masks (True = masked out); one tensor or a (q, kv) pair. Only
    where the mask type reads the mask: TE ignores it for the others (e.g. causal)."""
    if attention_mask is None or not ("padding" in attn_mask_type
                                      or attn_mask_type == "arbitrary"):
        return
    masks = attention_mask if isinstance(attention_mask, (tuple, list)) else (attention_mask,)
    for mask in masks:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise TypeError(f"{name} must be a bool tensor (True = masked out), got {got}")


class MultiheadAttention(FollowsParamsDtype, torch.nn.Module):
    """Multi-head attention with TE's ``MultiheadAttention`` arguments.

    Self attention (``attention_type="self"``) projects q, k, v from ``hidden_states``; cross
    attention projects q from ``hidden_states`` and k, v from ``encoder_output``. GQA/MQA via
    ``num_gqa_groups``. ``input_layernorm`` normalizes the input first (``normalization``
    LayerNorm or RMSNorm). Returns the projected output, then the output bias if
    ``return_bias``, then the layernorm output if ``input_layernorm and return_layernorm_output``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: Optional[int] = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method: Optional[Callable] = None,
        output_layer_init_method: Optional[Callable] = None,
        layer_number: Optional[int] = None,
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        num_gqa_groups: Optional[int] = None,
        params_dtype: Optional[torch.dtype] = None,
        return_bias: bool = False,
        return_layernorm_output: bool = False,
        input_layernorm: bool = False,
        attention_type: str = "self",
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        rotary_pos_interleaved: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        device: Union[torch.device, str] = "cuda",
        qkv_format: str = "sbhd",
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        softmax_type: str = "vanilla",
        **te_kwargs,
    ) -> None:
        super().__init__()
        tp = parallel.pop_layer_kwargs(te_kwargs)
        check_te_only_kwargs(te_kwargs, type(self).__name__)
        check_positive_int(hidden_size, "hidden_size")
        check_positive_int(num_attention_heads, "num_attention_heads")
        if kv_channels is None:
            if hidden_size % num_attention_heads:
                raise ValueError(
                    f"hidden_size={hidden_size} must be divisible by num_attention_heads="
                    f"{num_attention_heads} (or pass kv_channels)"
                )
            kv_channels = hidden_size // num_attention_heads
        check_positive_int(kv_channels, "kv_channels")
        num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        check_positive_int(num_gqa_groups, "num_gqa_groups")
        if num_attention_heads % num_gqa_groups:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} must be divisible by "
                f"num_gqa_groups={num_gqa_groups}"
            )
        if attention_type not in ("self", "cross"):
            raise ValueError(f"attention_type must be 'self' or 'cross', got {attention_type!r}")
        if qkv_format not in _FORMATS:
            raise ValueError(f"qkv_format must be one of {_FORMATS}, got {qkv_format!r}")
        if layer_number is not None and layer_number <= 0:
            raise ValueError(f"layer_number must be a positive int, got {layer_number}")
        if qk_norm_type is not None and qk_norm_type not in _QK_NORMS:
            raise ValueError(
                f"qk_norm_type must be None or one of {tuple(_QK_NORMS)}, got {qk_norm_type!r}"
            )
        attn_mask_type = masks.normalize_mask_type(attn_mask_type)
        # Tensor parallelism splits the heads (and the groups) over the ranks.
        owner = type(self).__name__
        self.tp_size, self.tp_rank = parallel.resolve_tp(
            owner, tp["tp_group"], tp["tp_size"], None, tp["sequence_parallel"])
        tp_size = self.tp_size if tp["set_parallel_mode"] else 1
        self.num_attention_heads_per_partition = parallel.divide(
            num_attention_heads, tp_size, "num_attention_heads", owner)
        self.num_gqa_groups_per_partition = parallel.divide(
            num_gqa_groups, tp_size, "num_gqa_groups", owner)
        if tp_size > 1 and qk_norm_type not in (None, "L2Normalization"):
            raise ValueError("MultiheadAttention: qk_norm_type with tensor parallelism is not "
                             "supported (its weights would see a part of the heads per rank; "
                             "L2Normalization, which has none, is)")
        self.sequence_parallel = tp["sequence_parallel"] and self.tp_size > 1

        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups
        self.hidden_size_per_attention_head = kv_channels
        self.hidden_size_q = kv_channels * num_attention_heads
        self.hidden_size_kv = kv_channels * num_gqa_groups
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.bottom_right_diagonal = bottom_right_diagonal
        self.layer_number = 1 if layer_number is None else layer_number
        self.input_layernorm = input_layernorm
        self.return_layernorm_output = return_layernorm_output
        self.return_bias = return_bias
        self.attention_type = attention_type
        self.qkv_format = qkv_format
        self.params_dtype = resolve_dtype(params_dtype)
        # Separate q/k/v parameters concatenate in q, k, v order: the non-interleaved reading.
        self.qkv_weight_interleaved = qkv_weight_interleaved and fuse_qkv_params
        self.rotary_pos_interleaved = rotary_pos_interleaved
        self.qk_norm_before_rope = qk_norm_before_rope

        init_method = init_method if init_method is not None else default_init_method()
        if output_layer_init_method is None:
            output_layer_init_method = default_init_method()
        column, row = parallel.linear_kwargs(tp)
        common = dict(
            init_method=init_method, bias=bias, params_dtype=self.params_dtype, device=device,
            **column
        )
        norm_args = dict(
            eps=layernorm_epsilon,
            normalization=normalization,
            zero_centered_gamma=zero_centered_gamma,
            return_layernorm_output=return_layernorm_output,
        )

        def in_proj(out_features, split, with_norm):
            kwargs = dict(common)
            if fuse_qkv_params:
                if not qkv_weight_interleaved:  # q, k, v blocks: each shards separately
                    kwargs["_tp_shard_parts"] = tuple(
                        split.values() if isinstance(split, dict)
                        else [out_features // len(split)] * len(split))
                split = None
            if with_norm:
                return LayerNormLinear(
                    hidden_size, out_features, parameters_split=split, **norm_args, **kwargs
                )
            return Linear(hidden_size, out_features, parameters_split=split, **kwargs)

        if attention_type == "self":
            width = self.hidden_size_q + 2 * self.hidden_size_kv
            split = {"query": self.hidden_size_q, "key": self.hidden_size_kv,
                     "value": self.hidden_size_kv}
            if input_layernorm:
                self.layernorm_qkv = in_proj(width, split, True)
            else:
                self.qkv = in_proj(width, split, False)
        else:
            if input_layernorm:
                self.layernorm_query = in_proj(self.hidden_size_q, ("query",), True)
            else:
                self.query_layer = Linear(hidden_size, self.hidden_size_q, **common)
            self.key_value = in_proj(2 * self.hidden_size_kv, ("key", "value"), False)

        self.q_norm = self.k_norm = None
        if qk_norm_type is not None:
            make_norm = _QK_NORMS[qk_norm_type]
            self.q_norm, self.k_norm = (make_norm(kv_channels, qk_norm_eps, self.params_dtype,
                                                  device) for _ in range(2))

        self.core_attention = DotProductAttention(
            self.num_attention_heads_per_partition,
            kv_channels,
            num_gqa_groups=self.num_gqa_groups_per_partition,
            attention_dropout=attention_dropout,
            qkv_format=qkv_format,
            attn_mask_type=attn_mask_type,
            window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal,
            attention_type=attention_type,
            layer_number=self.layer_number,
            get_rng_state_tracker=te_kwargs.get("get_rng_state_tracker"),
            softmax_type=softmax_type,
        )
        self.cp_size, self.cp_rank = 1, 0  # context parallelism: set_context_parallel_group
        if self.core_attention.softmax_offset is not None:
            self.core_attention.to(device)  # DotProductAttention makes it on the GPU, as TE
        self.proj = Linear(
            self.hidden_size_q,
            hidden_size,
            init_method=output_layer_init_method,
            bias=bias,
            return_bias=return_bias,
            params_dtype=self.params_dtype,
            device=device,
            **row,
        )

    def _project_qkv(self, hidden_states, encoder_output, pass_input: bool):
        """(q, k, v, layernorm output or None, hidden_states); q [..., np, hn], k and v
        [..., ng, hn]; with ``pass_input`` and an input norm, hidden_states as that norm
        handed it back out (forward's ``_pass_input``)."""
        # this rank's heads and groups
        hn, ng = self.hidden_size_per_attention_head, self.num_gqa_groups_per_partition
        heads = self.num_attention_heads_per_partition
        ln_out = None

        def run(proj, x):
            nonlocal ln_out, hidden_states
            if pass_input and isinstance(proj, LayerNormLinear):
                out, hidden_states = proj(x, _pass_input=True)
            else:
                out = proj(x)
            if isinstance(out, tuple):  # (output, layernorm output)
                out, ln_out = out
            return out

        if self.attention_type == "self":
            if encoder_output is not None:
                raise ValueError("encoder_output is only used with attention_type='cross'")
            proj = self.layernorm_qkv if self.input_layernorm else self.qkv
            mixed = run(proj, hidden_states)
            parts = (heads // ng, 1, 1)
            q, k, v = split_grouped_heads(mixed, parts, ng, hn, self.qkv_weight_interleaved)
            return q, k, v, ln_out, hidden_states

        if encoder_output is None:
            raise ValueError("encoder_output is required with attention_type='cross'")
        k, v = split_grouped_heads(
            self.key_value(encoder_output), (1, 1), ng, hn, self.qkv_weight_interleaved
        )
        proj = self.layernorm_query if self.input_layernorm else self.query_layer
        q = run(proj, hidden_states)
        q = q.view(*q.shape[:-1], heads, hn)
        return q, k, v, ln_out, hidden_states

    def set_tensor_parallel_group(self, tp_group) -> None:
        """TE's: the tensor-parallel group of the projections."""
        parallel.set_group_on_submodules(self, tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type: str = "p2p") -> None:
        """TE's: context parallelism for the core attention (and the RoPE positions)."""
        context_parallel.check_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.cp_size, self.cp_rank = context_parallel.size_and_rank(cp_group)
        context_parallel.set_group_on_submodules(self, cp_group, cp_global_ranks, cp_stream,
                                                 cp_comm_type)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        encoder_output: Optional[torch.Tensor] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        is_first_microbatch: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        inference_params=None,
        rotary_pos_emb: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[torch.Tensor] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        cu_seqlens_q: Optional[torch.Tensor] = None,
        cu_seqlens_kv: Optional[torch.Tensor] = None,
        cu_seqlens_q_padded: Optional[torch.Tensor] = None,
        cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        fast_zero_fill: bool = True,
        pad_between_seqs: Optional[bool] = None,
        *,
        _pass_input: bool = False,
    ):
        """hidden_states: ``[s, b, hidden]`` (sbhd), ``[b, s, hidden]`` (bshd) or ``[t, hidden]``.

        ``is_first_microbatch`` and ``fast_zero_fill`` are accepted for TE compatibility and
        have no effect. ``cu_seqlens_*_padded`` place thd sequences with gaps between them
        (TE's). ``_pass_input`` (not TE's; TransformerLayer's residual): return
        ``(outputs, hidden_states)`` with hidden_states handed back out of the input norm
        (LayerNormLinear's), so that the residual's gradient is added inside the norm's
        backward.
        """
        check_unsupported_forward_args(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                       cu_seqlens_kv_padded, False)
        if inference_params is not None:
            inference.allocate_on_first_use(inference_params, self.layer_number,
                                            self.attention_type)
        check_hidden_states(hidden_states, self.hidden_size, self.params_dtype, "hidden_states")
        if core_attention_bias_type not in BIAS_TYPES:
            raise ValueError(
                f"core_attention_bias_type must be one of {BIAS_TYPES}, "
                f"got {core_attention_bias_type!r}"
            )
        attn_mask_type = masks.normalize_mask_type(
            self.attn_mask_type if attn_mask_type is None else attn_mask_type)
        check_bool_masks(attention_mask, "attention_mask", attn_mask_type)
        if self.attention_type == "self":
            # Self attention: the keys are the queries' tokens.
            cu_seqlens_kv = cu_seqlens_q if cu_seqlens_kv is None else cu_seqlens_kv
            max_seqlen_kv = max_seqlen_q if max_seqlen_kv is None else max_seqlen_kv
            if cu_seqlens_kv_padded is None:
                cu_seqlens_kv_padded = cu_seqlens_q_padded

        q, k, v, ln_out, hidden_states = self._project_qkv(hidden_states, encoder_output,
                                                           _pass_input)

        if self.q_norm is not None and self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary_pos_emb is not None:
            q_emb, k_emb = (
                rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            )
            if inference_params is not None:  # each sequence continues at its cached length
                q, k = inference.rope_for_step(inference_params, q, k, (q_emb, k_emb),
                                               self.qkv_format, self.rotary_pos_interleaved)
            else:
                # thd with gaps: positions count from each sequence's padded start
                cu_rope_q = cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded
                cu_rope_kv = (cu_seqlens_kv if cu_seqlens_kv_padded is None
                              else cu_seqlens_kv_padded)
                q = apply_rotary_pos_emb(
                    q, q_emb, self.qkv_format, interleaved=self.rotary_pos_interleaved,
                    cu_seqlens=cu_rope_q, cp_size=self.cp_size, cp_rank=self.cp_rank,
                    fused=True,  # as TE's
                )
                k = apply_rotary_pos_emb(
                    k, k_emb, self.qkv_format, interleaved=self.rotary_pos_interleaved,
                    cu_seqlens=cu_rope_kv, cp_size=self.cp_size, cp_rank=self.cp_rank,
                    fused=True,
                )
        if self.q_norm is not None and not self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)

        # window_size and bottom_right_diagonal stay None unless given: core_attention
        # holds this module's defaults (and warns about a window once, not every call).
        context = self.core_attention(
            q,
            k,
            v,
            attention_mask=attention_mask,
            qkv_format=self.qkv_format,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded,
            pad_between_seqs=pad_between_seqs,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv,
            attn_mask_type=attn_mask_type,
            window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal,
            checkpoint_core_attention=checkpoint_core_attention,
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes,
            inference_params=inference_params,
        )

        out = self.proj(context)
        out, out_bias = out if self.return_bias else (out, None)
        outputs = pack_outputs(
            out,
            out_bias,
            ln_out,
            self.return_bias,
            self.input_layernorm and self.return_layernorm_output,
        )
        return (outputs, hidden_states) if _pass_input else outputs
