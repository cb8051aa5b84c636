"""TransformerLayer: attention block and MLP with TE's arguments and residual structure.

Pre-norm by default: ``x + dropout(attn(norm(x)))`` then ``x + dropout(mlp(norm(x)))``.
``apply_residual_connection_post_layernorm`` takes each residual from the norm's output instead
of its input; ``output_layernorm`` moves the attention norm to the layer's output (BERT style;
the MLP keeps its input norm, as in TE); ``layer_type="decoder"`` adds cross attention over
``encoder_output`` after self attention; ``parallel_attention_mlp`` (Falcon) feeds attention
and MLP the same input and adds both to the residual.
"""
from contextlib import nullcontext
from typing import Callable, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from . import parallel
from .attention import context_parallel, masks
from .attention.constants import TENSOR_FORMATS as _FORMATS
from .attention.multi_head_attention import MultiheadAttention, check_bool_masks
from .module._common import (
    FollowsParamsDtype,
    check_device,
    check_hidden_states,
    check_te_only_kwargs,
    default_init_method,
    resolve_dtype,
)
from .module.layernorm import LayerNorm, RMSNorm, check_normalization
from .module.linear import LayerNormMLP

__all__ = ["TransformerLayer"]

_LAYER_TYPES = ("encoder", "decoder")


def _check_probability(value: float, name: str) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")


class DropPath(torch.nn.Module):
    """Stochastic depth: zero a whole sample's residual branch with probability drop_prob."""

    def __init__(self, drop_prob: float = 0.0, batch_dim: int = 0) -> None:
        super().__init__()
        self.drop_prob = drop_prob
        self.batch_dim = batch_dim

    def forward(self, hidden_state: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return hidden_state
        keep_prob = 1.0 - self.drop_prob
        shape = [1] * hidden_state.dim()
        shape[self.batch_dim] = hidden_state.shape[self.batch_dim]
        keep = torch.rand(shape, dtype=hidden_state.dtype, device=hidden_state.device) < keep_prob
        return hidden_state * keep / keep_prob


class TransformerLayer(FollowsParamsDtype, torch.nn.Module):
    """One transformer block, TE's ``TransformerLayer``.

    hidden_states: ``[s, b, hidden]`` for ``attn_input_format="sbhd"``, ``[b, s, hidden]`` for
    ``"bshd"``, ``[t, hidden]`` for ``"thd"`` (with ``cu_seqlens_q``/``cu_seqlens_kv``).
    Parameters live in ``self_attention`` (a MultiheadAttention with ``layernorm_qkv`` or
    ``qkv``, ``core_attention`` and ``proj``), ``inter_attention`` for decoders,
    ``layernorm_mlp`` and, with ``output_layernorm``, ``layernorm``.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: Optional[int] = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method: Optional[Callable] = None,
        output_layer_init_method: Optional[Callable] = None,
        layer_number: Optional[int] = None,
        kv_channels: Optional[int] = None,
        self_attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        enc_dec_attn_mask_type: str = "no_mask",
        enc_dec_bottom_right_diagonal: Optional[bool] = None,
        enc_dec_window_size: Optional[Tuple[int, int]] = None,
        params_dtype: Optional[torch.dtype] = None,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        parallel_attention_mlp: bool = False,
        layer_type: str = "encoder",
        drop_path_rate: float = 0.0,
        fuse_qkv_params: bool = False,
        rotary_pos_interleaved: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        bias: bool = True,
        activation: str = "gelu",
        activation_params: Optional[dict] = None,
        normalization: str = "LayerNorm",
        device: Union[torch.device, str] = "cuda",
        attn_input_format: str = "sbhd",
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        softmax_type: str = "vanilla",
        **te_kwargs,
    ) -> None:
        super().__init__()
        # TE's tensor-parallel arguments go to the attention and the MLP; its userbuffer and
        # JIT-warmup arguments (seq_length, micro_batch_size, ub_*, name,
        # fuse_wgrad_accumulation) are accepted at their single-device values.
        tp = parallel.pop_layer_kwargs(te_kwargs)
        check_te_only_kwargs(te_kwargs, type(self).__name__)
        check_device(device)
        if layer_type not in _LAYER_TYPES:
            raise ValueError(f"layer_type must be one of {_LAYER_TYPES}, got {layer_type!r}")
        if attn_input_format not in _FORMATS:
            raise ValueError(
                f"attn_input_format must be one of {_FORMATS}, got {attn_input_format!r}"
            )
        self_attn_mask_type = masks.normalize_mask_type(self_attn_mask_type, "self_attn_mask_type")
        enc_dec_attn_mask_type = masks.normalize_mask_type(
            enc_dec_attn_mask_type, "enc_dec_attn_mask_type")
        _check_probability(hidden_dropout, "hidden_dropout")
        _check_probability(drop_path_rate, "drop_path_rate")
        check_normalization(normalization)
        if parallel_attention_mlp and (
            layer_type != "encoder" or apply_residual_connection_post_layernorm or output_layernorm
        ):
            raise ValueError(
                "parallel_attention_mlp needs layer_type='encoder' and neither "
                "apply_residual_connection_post_layernorm nor output_layernorm"
            )

        params_dtype = resolve_dtype(params_dtype)
        init_method = init_method if init_method is not None else default_init_method()
        if output_layer_init_method is None:
            output_layer_init_method = default_init_method()
        self.self_attn_mask_type = self_attn_mask_type
        self.window_size = window_size
        self.bottom_right_diagonal = bottom_right_diagonal
        self.enc_dec_attn_mask_type = enc_dec_attn_mask_type
        self.enc_dec_window_size = enc_dec_window_size
        self.enc_dec_bottom_right_diagonal = enc_dec_bottom_right_diagonal
        self.hidden_size = hidden_size
        self.params_dtype = params_dtype
        self.layer_number = layer_number
        self.layer_type = layer_type
        self.output_layernorm = output_layernorm
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.parallel_attention_mlp = parallel_attention_mlp
        self.attn_input_format = attn_input_format
        self.hidden_dropout = hidden_dropout
        tp_size, _ = parallel.resolve_tp(type(self).__name__, tp["tp_group"], tp["tp_size"],
                                         None, tp["sequence_parallel"])
        # With sequence parallelism each rank drops out its own tokens: the dropout draws
        # from TE's tracker (the default generator stays in step over the group).
        self.get_rng_state_tracker = te_kwargs.get("get_rng_state_tracker")
        self.sequence_parallel = tp["sequence_parallel"] and tp_size > 1

        attention_args = (
            hidden_size,
            num_attention_heads,
            kv_channels,
            attention_dropout,
            layernorm_epsilon,
            init_method,
            output_layer_init_method,
        )
        attention_kwargs = dict(
            layer_number=layer_number,
            num_gqa_groups=num_gqa_groups,
            params_dtype=params_dtype,
            return_layernorm_output=apply_residual_connection_post_layernorm,
            fuse_qkv_params=fuse_qkv_params,
            zero_centered_gamma=zero_centered_gamma,
            qkv_weight_interleaved=qkv_weight_interleaved,
            qkv_format=attn_input_format,
            bias=bias,
            normalization=normalization,
            device=device,
            rotary_pos_interleaved=rotary_pos_interleaved,
            qk_norm_type=qk_norm_type,
            qk_norm_eps=qk_norm_eps,
            qk_norm_before_rope=qk_norm_before_rope,
            softmax_type=softmax_type,
            get_rng_state_tracker=te_kwargs.get("get_rng_state_tracker"),
            **tp,
        )
        self.self_attention = MultiheadAttention(
            *attention_args,
            **attention_kwargs,
            attn_mask_type=self_attn_mask_type,
            window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal,
            input_layernorm=not output_layernorm,
            attention_type="self",
        )
        self.kv_channels = self.self_attention.hidden_size_per_attention_head
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(
                *attention_args,
                **attention_kwargs,
                attn_mask_type=enc_dec_attn_mask_type,
                window_size=enc_dec_window_size,
                bottom_right_diagonal=enc_dec_bottom_right_diagonal,
                input_layernorm=True,
                attention_type="cross",
            )
        self.layernorm_mlp = LayerNormMLP(
            hidden_size,
            ffn_hidden_size,
            eps=layernorm_epsilon,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            bias=bias,
            params_dtype=params_dtype,
            return_layernorm_output=apply_residual_connection_post_layernorm,
            zero_centered_gamma=zero_centered_gamma,
            activation=activation,
            activation_params=activation_params,
            normalization=normalization,
            device=device,
            **tp,
        )
        # Stochastic depth drops whole samples along the batch dim (thd has none: per token).
        batch_dim = 1 if attn_input_format == "sbhd" else 0
        self.drop_path = DropPath(drop_path_rate, batch_dim) if drop_path_rate > 0.0 else None
        if output_layernorm:
            norm_cls = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm_cls(
                hidden_size,
                eps=layernorm_epsilon,
                params_dtype=params_dtype,
                zero_centered_gamma=zero_centered_gamma,
                device=device,
                sequence_parallel=self.sequence_parallel,
            )

    def _bias_dropout_add(self, out, bias, residual, drop_path=None):
        """residual + drop_path(dropout(out + bias)), TE's bias-dropout-add. The projections
        add their own biases in the GEMM's epilogue (cuBLAS), so ``bias`` is only the parallel
        layout's attention output; TE returns the biases to fuse them into one kernel with
        the dropout, which the GEMM epilogue makes unnecessary."""
        if bias is not None:
            out = out + bias
        if self.training and self.hidden_dropout > 0.0:  # else the identity: no call at all
            forked = self.sequence_parallel and self.get_rng_state_tracker is not None
            with self.get_rng_state_tracker().fork() if forked else nullcontext():
                out = F.dropout(out, p=self.hidden_dropout, training=True)
        if drop_path is not None:
            out = drop_path(out)
        return residual + out

    def set_tensor_parallel_group(self, tp_group) -> None:
        """TE's: the tensor-parallel group of every projection in the layer."""
        parallel.set_group_on_submodules(self, tp_group)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type: str = "p2p") -> None:
        """TE's: context parallelism for the attention of this layer."""
        context_parallel.set_group_on_submodules(self, cp_group, cp_global_ranks, cp_stream,
                                                 cp_comm_type)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        self_attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        encoder_output: Optional[torch.Tensor] = None,
        enc_dec_attn_mask: Optional[Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None,
        enc_dec_attn_mask_type: Optional[str] = None,
        enc_dec_window_size: Optional[Tuple[int, int]] = None,
        enc_dec_bottom_right_diagonal: Optional[bool] = None,
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
    ) -> torch.Tensor:
        """Run the layer; masks are bool with True = masked out (see MultiheadAttention).

        As TE: self attention runs over the queries' lengths (``cu_seqlens_q``,
        ``max_seqlen_q``); a decoder's cross attention gets ``cu_seqlens_q``/``cu_seqlens_kv``
        and ``max_seqlen_q``/``max_seqlen_kv``; ``attention_mask`` is read only by padding and
        arbitrary mask types. ``fast_zero_fill`` has no effect.
        """
        self_attn_mask_type = masks.normalize_mask_type(
            self.self_attn_mask_type if self_attn_mask_type is None else self_attn_mask_type,
            "self_attn_mask_type")
        if enc_dec_attn_mask_type is None:
            enc_dec_attn_mask_type = self.enc_dec_attn_mask_type
        enc_dec_attn_mask_type = masks.normalize_mask_type(enc_dec_attn_mask_type,
                                                           "enc_dec_attn_mask_type")
        check_bool_masks(attention_mask, "attention_mask", self_attn_mask_type)
        check_bool_masks(enc_dec_attn_mask, "enc_dec_attn_mask", enc_dec_attn_mask_type)
        if self.layer_type == "decoder" and encoder_output is None:
            raise ValueError("encoder_output is required with layer_type='decoder'")
        if self.layer_type == "decoder" and inference_params is not None:
            raise ValueError("inference_params: the KV cache serves self attention only; "
                             "layer_type='decoder' (cross attention) is not supported with it")

        check_hidden_states(hidden_states, self.hidden_size, self.params_dtype, "hidden_states")
        hidden_states = hidden_states.contiguous()
        device_type = hidden_states.device.type
        if torch.is_autocast_enabled(device_type):
            # As TE: under autocast the layer runs in the autocast dtype.
            hidden_states = hidden_states.to(torch.get_autocast_dtype(device_type))

        # hidden_states comes back out of the attention's input norm (MultiheadAttention's
        # _pass_input): its residual's gradient is then added inside that norm's backward
        self_attention_outputs, hidden_states = self.self_attention(
            hidden_states,
            attention_mask=attention_mask,
            attn_mask_type=self_attn_mask_type,
            window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal,
            inference_params=inference_params,
            checkpoint_core_attention=checkpoint_core_attention,
            rotary_pos_emb=rotary_pos_emb,
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_q,
            cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_q_padded,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_q,
            pad_between_seqs=pad_between_seqs,
            _pass_input=True,
        )
        # The residual add before the MLP fused into its norm: the sum and the normalized sum
        # in one pass, and in the backward the residual's gradient added inside the norm's
        # (an encoder layer without hidden dropout or stochastic depth at this point)
        add_in_mlp_norm = (not self.parallel_attention_mlp and self.layer_type == "encoder"
                           and not self.apply_residual_connection_post_layernorm
                           and self.drop_path is None
                           and not (self.training and self.hidden_dropout > 0.0))
        if self.parallel_attention_mlp:
            attention_out = self_attention_outputs
        elif add_in_mlp_norm:
            pass
        elif self.apply_residual_connection_post_layernorm and not self.output_layernorm:
            attention_out, residual = self_attention_outputs
            hidden_states = self._bias_dropout_add(attention_out, None, residual, self.drop_path)
        else:
            hidden_states = self._bias_dropout_add(self_attention_outputs, None, hidden_states,
                                                   self.drop_path)

        if self.layer_type == "decoder":
            inter_outputs = self.inter_attention(
                hidden_states,
                attention_mask=enc_dec_attn_mask,
                encoder_output=encoder_output,
                attn_mask_type=enc_dec_attn_mask_type,
                window_size=enc_dec_window_size,
                bottom_right_diagonal=enc_dec_bottom_right_diagonal,
                inference_params=inference_params,
                checkpoint_core_attention=checkpoint_core_attention,
                rotary_pos_emb=rotary_pos_emb,
                core_attention_bias_type=core_attention_bias_type,
                core_attention_bias=core_attention_bias,
                alibi_slopes=alibi_slopes,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_kv=cu_seqlens_kv,
                cu_seqlens_q_padded=cu_seqlens_q_padded,
                cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_kv=max_seqlen_kv,
                pad_between_seqs=pad_between_seqs,
            )
            if self.apply_residual_connection_post_layernorm:
                inter_out, residual = inter_outputs
            else:
                inter_out, residual = inter_outputs, hidden_states
            hidden_states = self._bias_dropout_add(inter_out, None, residual)

        if add_in_mlp_norm:
            mlp_outputs, hidden_states = self.layernorm_mlp.add_residual_then_forward(
                self_attention_outputs, hidden_states)
        else:
            mlp_outputs = self.layernorm_mlp(hidden_states)
        if self.parallel_attention_mlp:
            # attention output rides in the "bias" slot: x + dropout(attn + mlp)
            output = self._bias_dropout_add(
                mlp_outputs, attention_out, hidden_states, self.drop_path
            )
        elif self.apply_residual_connection_post_layernorm:
            mlp_out, residual = mlp_outputs
            output = self._bias_dropout_add(mlp_out, None, residual, self.drop_path)
        else:
            output = self._bias_dropout_add(mlp_outputs, None, hidden_states, self.drop_path)

        if self.output_layernorm:
            output = self.layernorm(output)
        return output
