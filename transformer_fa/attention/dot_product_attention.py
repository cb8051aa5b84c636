"""DotProductAttention: validates a call, describes it once, and runs the selected backend."""
from __future__ import annotations

import dataclasses
import logging
import math
from functools import lru_cache
from typing import Callable, Optional, Tuple, Union

import torch
from torch.utils.checkpoint import checkpoint

from .. import fp8, parallel
from ..utils import host_reads_allowed, lengths_checked_on_host
from ..module._common import check_te_only_kwargs
from . import context_parallel, inference, layout, masks, padding, selection
from .params import BIAS_TYPES, SOFTMAX_TYPES, AttentionInputs, params_fields

logger = logging.getLogger("DotProductAttention")


@lru_cache(maxsize=None)
def _compute_capability(device: torch.device) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _per_rank(name: str, heads, tp_size: int) -> int:
    _positive_int(name, heads)
    return parallel.divide(heads, tp_size, name, "DotProductAttention")


class DotProductAttention(torch.nn.Module):
    """Scaled dot product attention over q, k, v in any TE layout (TE's DotProductAttention).

    Args follow TE: ``kv_channels`` is the head dim, or ``(k_channels, v_channels)``;
    ``num_gqa_groups`` the number of K/V heads (default: ``num_attention_heads``);
    ``attention_dropout`` applies in training mode only; ``softmax_scale`` defaults to
    ``1/sqrt(k_channels)``. After each forward, ``last_backend`` names the backend that ran.
    ``bottom_right_diagonal`` aligns the window and ALiBi of non-causal masks (TE's).
    ``tp_size`` / ``tp_group`` (TE's): the head counts given are the global ones and this
    rank attends ``num_attention_heads / tp_size`` of them (its q, k, v hold only those;
    ``num_attention_heads`` and ``num_gqa_groups`` become the per-rank counts); ``cp_group``,
    ``cp_global_ranks``, ``cp_stream``, ``cp_comm_type`` (TE's) turn on context parallelism
    (see ``set_context_parallel_group`` and ``attention/context_parallel.py``);
    ``get_rng_state_tracker`` (TE's) forks its RNG state around dropout.

    ``softmax_type`` (TE): "vanilla"; "off-by-one" adds 1 to every softmax denominator;
    "learnable" adds ``exp(softmax_offset[h])``, with ``softmax_offset`` a learnable
    ``nn.Parameter`` of shape ``[num_attention_heads]`` initialized to zeros (attention sinks).
    ``return_max_logit`` (TE): the forward returns ``(output, max_logit)``, ``max_logit``
    ``[num_attention_heads]`` in the output's dtype: the largest scaled, biased, unmasked
    logit of each head over the batch (for QK-clip). ``softcap`` (FlashAttention's, not TE's):
    when > 0 the scaled logits become ``softcap * tanh(logits / softcap)`` before the
    post-scale bias / ALiBi and the masks; the forward's ``softcap`` overrides it per call.
    """

    def __init__(self, num_attention_heads: int, kv_channels: Union[int, Tuple[int, int]],
                 num_gqa_groups: Optional[int] = None, attention_dropout: float = 0.0,
                 qkv_format: str = "sbhd", attn_mask_type: str = "causal",
                 window_size: Optional[Tuple[int, int]] = None,
                 bottom_right_diagonal: Optional[bool] = None, sequence_parallel: bool = False,
                 tp_size: int = 1, get_rng_state_tracker: Optional[Callable] = None,
                 tp_group=None, layer_number: Optional[int] = None, attention_type: str = "self",
                 cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type: str = "p2p",
                 softmax_scale: Optional[float] = None, softmax_type: str = "vanilla",
                 return_max_logit: Optional[bool] = False, name: Optional[str] = None,
                 softcap: float = 0.0):
        super().__init__()
        check_te_only_kwargs(dict(sequence_parallel=sequence_parallel), type(self).__name__)
        # TE's tensor parallelism: the head counts given are the global ones; this rank
        # attends its num_attention_heads / tp_size heads (num_gqa_groups likewise). The size
        # is tp_group's when one is given, else tp_size as given (TE's rule).
        if tp_group is None:
            self.tp_size = _positive_int("tp_size", tp_size)
        else:
            self.tp_size, _ = parallel.resolve_tp(type(self).__name__, tp_group, tp_size)
        self.tp_group = tp_group
        self.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.bottom_right_diagonal = bottom_right_diagonal
        self.name = name
        num_attention_heads = _per_rank("num_attention_heads", num_attention_heads, self.tp_size)
        if num_gqa_groups is not None:
            num_gqa_groups = _per_rank("num_gqa_groups", num_gqa_groups, self.tp_size)
        self.num_attention_heads = num_attention_heads  # this rank's heads
        if isinstance(kv_channels, (tuple, list)):
            if len(kv_channels) != 2:
                raise ValueError(f"kv_channels must be an int or (k_channels, v_channels), "
                                 f"got {kv_channels!r}")
            self.head_dim_qk = _positive_int("kv_channels[0]", kv_channels[0])
            self.head_dim_v = _positive_int("kv_channels[1]", kv_channels[1])
        else:
            self.head_dim_qk = self.head_dim_v = _positive_int("kv_channels", kv_channels)
        self.num_gqa_groups = _positive_int(
            "num_gqa_groups", num_attention_heads if num_gqa_groups is None else num_gqa_groups)
        if self.num_attention_heads % self.num_gqa_groups:
            raise ValueError(f"num_attention_heads={num_attention_heads} must be divisible by "
                             f"num_gqa_groups={self.num_gqa_groups}")
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"attention_dropout must be in [0, 1), got {attention_dropout}")
        layout.split_qkv_format(qkv_format)
        attn_mask_type = masks.normalize_mask_type(attn_mask_type)
        self._window_memo = None
        self._window_for(attn_mask_type, window_size)  # validates (and warns) once
        if attention_type not in ("self", "cross"):
            raise ValueError(f"attention_type must be 'self' or 'cross', got {attention_type!r}")
        if softmax_scale is not None and not softmax_scale > 0:
            raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
        self.attention_dropout = attention_dropout
        self.qkv_format = qkv_format
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.attention_type = attention_type
        self.layer_number = layer_number
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(self.head_dim_qk))
        if softmax_type not in SOFTMAX_TYPES:
            raise ValueError(f"softmax_type must be one of {SOFTMAX_TYPES}, got {softmax_type!r}")
        if return_max_logit is not None and not isinstance(return_max_logit, bool):
            raise TypeError(f"return_max_logit must be a bool, got {return_max_logit!r}")
        self.softmax_type = softmax_type
        self.return_max_logit = bool(return_max_logit)
        self.softcap = _check_softcap(softcap)
        self._init_softmax_offset()
        self.last_backend: Optional[str] = None
        # fast path: call key -> (backend, params, the backend's bound runner or None)
        self._dense_calls: dict = {}

    def forward(self, query_layer: Optional[torch.Tensor] = None,
                key_layer: Optional[torch.Tensor] = None,
                value_layer: Optional[torch.Tensor] = None, attention_mask=None,
                qkv_format: Optional[str] = None,
                cu_seqlens_q: Optional[torch.Tensor] = None,
                cu_seqlens_kv: Optional[torch.Tensor] = None,
                cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
                max_seqlen_q: Optional[int] = None,
                max_seqlen_kv: Optional[int] = None, attn_mask_type: Optional[str] = None,
                window_size: Optional[Tuple[int, int]] = None,
                bottom_right_diagonal: Optional[bool] = None,
                checkpoint_core_attention: bool = False,
                core_attention_bias_type: str = "no_bias",
                core_attention_bias: Optional[torch.Tensor] = None,
                alibi_slopes: Optional[torch.Tensor] = None, fast_zero_fill: bool = True,
                inference_params=None, pad_between_seqs: Optional[bool] = None,
                fp8_output: bool = False, bf16_backward: Optional[bool] = False,
                num_splits: Optional[int] = 1, score_mod: Optional[Callable] = None,
                score_mod_bprop: Optional[Callable] = None, score_mod_tensors=None,
                score_mod_bprop_tensors=None, qkv_layer: Optional[torch.Tensor] = None,
                kv_layer: Optional[torch.Tensor] = None, qkv_interleave_dim: int = -3,
                softcap: Optional[float] = None):
        """TE's forward. ``fast_zero_fill`` has no effect (outputs are always zero-filled
        where no query runs); ``cu_seqlens_*_padded`` place thd sequences with gaps between
        them (``pad_between_seqs`` only describes those offsets, as TE infers it);
        ``bf16_backward`` (FP8 attention's) and ``num_splits`` (a FlashAttention-3 tuning
        knob) do not change what is computed and are accepted as TE ignores them on other
        backends. ``qkv_layer`` / ``kv_layer`` take packed buffers (TE's): q, k, v become
        views of them along ``qkv_interleave_dim``.
        Returns the output, or ``(output, max_logit)`` with ``return_max_logit``."""
        check_unsupported_forward_args(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                       cu_seqlens_kv_padded, fp8_output)
        _check_tuning_args(num_splits, score_mod, score_mod_bprop, score_mod_tensors,
                           score_mod_bprop_tensors)
        if qkv_layer is not None or kv_layer is not None:
            query_layer, key_layer, value_layer = unpack_qkv(
                qkv_layer, kv_layer, query_layer, key_layer, value_layer, qkv_interleave_dim)
        # The arguments of a re-entry (checkpointing, padded thd) that keep their meaning.
        again = dict(attention_mask=attention_mask, qkv_format=qkv_format,
                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                     max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
                     attn_mask_type=attn_mask_type, window_size=window_size,
                     bottom_right_diagonal=bottom_right_diagonal,
                     core_attention_bias_type=core_attention_bias_type,
                     core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes,
                     softcap=softcap)
        if inference_params is not None:
            # KV cache: append k, v in place, then attend over the cache (a varlen call; a
            # paged cache's pools go on with their page table).
            if context_parallel.size_and_rank(self.cp_group)[0] > 1:
                raise ValueError("inference_params is not supported with context parallelism "
                                 "(cp_group of more than one rank)")
            q, k_cache, v_cache, cache_args = inference.attention_over_cache(
                inference_params, self, query_layer, key_layer, value_layer,
                self.qkv_format if qkv_format is None else qkv_format,
                self.attn_mask_type if attn_mask_type is None else attn_mask_type,
                dict(again, cu_seqlens_q_padded=cu_seqlens_q_padded,
                     cu_seqlens_kv_padded=cu_seqlens_kv_padded))
            with lengths_checked_on_host():  # the cache's lengths: built by pre_step()
                result = self._attend(q, k_cache, v_cache, **cache_args, checked=True,
                                      step_memo=inference_params.step_memo)
            return inference.thd_rows_of(result, query_layer, q)
        if checkpoint_core_attention and torch.is_grad_enabled():
            # TE's activation checkpointing: recompute attention in the backward.
            return checkpoint(self.forward, query_layer, key_layer, value_layer,
                              cu_seqlens_q_padded=cu_seqlens_q_padded,
                              cu_seqlens_kv_padded=cu_seqlens_kv_padded, use_reentrant=False,
                              **again)
        if query_layer is None or key_layer is None or value_layer is None:
            raise ValueError("query_layer, key_layer and value_layer are required (or "
                             "qkv_layer, or query_layer with kv_layer)")
        if context_parallel.size_and_rank(self.cp_group)[0] > 1:
            out = context_parallel.attention(
                self, query_layer, key_layer, value_layer,
                self.qkv_format if qkv_format is None else qkv_format,
                self.attn_mask_type if attn_mask_type is None else attn_mask_type,
                self.window_size if window_size is None else window_size,
                refused=_cp_refused(core_attention_bias_type, core_attention_bias,
                                    alibi_slopes, self.softcap if softcap is None else softcap),
                cu_seqlens=(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                            cu_seqlens_kv_padded))
            self.last_backend = context_parallel.last_block_backend  # CP: block by block
            return out
        if cu_seqlens_q_padded is not None or cu_seqlens_kv_padded is not None:
            rows_q, rows_kv = _padded_sides(
                self.qkv_format if qkv_format is None else qkv_format, query_layer, key_layer,
                cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
            if rows_q is not None or rows_kv is not None:
                return self._forward_with_gaps(query_layer, key_layer, value_layer, rows_q,
                                               rows_kv, again)
        return self._attend(query_layer, key_layer, value_layer, **again)

    def _attend(self, q, k, v, attention_mask, qkv_format, cu_seqlens_q, cu_seqlens_kv,
                max_seqlen_q, max_seqlen_kv, attn_mask_type, window_size, bottom_right_diagonal,
                core_attention_bias_type, core_attention_bias, alibi_slopes, softcap,
                page_table=None, checked=False, step_memo=None):
        """The rest of forward for one plain call: validate, describe, select and run.
        ``page_table`` (the KV cache's, not a forward argument): k and v are the page pools
        ``[total_pages, page_size, h_kv, d]`` of a paged cache (bshd) read through it (see
        ``AttentionInputs.page_table``); the call then carries cu_seqlens_kv. ``checked``:
        q, k and v were validated already (the KV cache's call: attention_over_cache checked
        q and the new k, v, and the cache's own checks tie them to its k, v). ``step_memo``
        (the KV cache's call: ``InferenceParams.step_memo``, emptied by every pre_step):
        keeps the decision for the next layer of the step with an equal call; its lengths
        are not read on the host, so the decision depends on their metadata only."""
        softcap = self.softcap if softcap is None else _check_softcap(softcap)
        if self.softmax_offset is not None and self.softmax_offset.device != q.device:
            raise ValueError(f"softmax_offset (softmax_type={self.softmax_type!r}) is on "
                             f"{self.softmax_offset.device} but the inputs are on {q.device}; "
                             f"move the module with .to({str(q.device)!r})")
        if attn_mask_type is not None:
            attn_mask_type = masks.normalize_mask_type(attn_mask_type)
        if bottom_right_diagonal is None:
            bottom_right_diagonal = self.bottom_right_diagonal
        dense_key = cache_key = None
        if (step_memo is not None and attention_mask is None and core_attention_bias is None
                and core_attention_bias_type == "no_bias" and alibi_slopes is None
                and not torch.compiler.is_compiling()):
            call_key = self._dense_call_key(
                q, k, v, self.qkv_format if qkv_format is None else qkv_format,
                self.attn_mask_type if attn_mask_type is None else attn_mask_type,
                self.window_size if window_size is None else window_size, softcap,
                bottom_right_diagonal)
            if call_key is not None:
                cache_key = ("attention call", call_key, max_seqlen_q, max_seqlen_kv,
                             *map(_metadata, (cu_seqlens_q, cu_seqlens_kv, page_table)))
                hit = step_memo.get(cache_key)
                if hit is not None:
                    backend, params = hit
                    if self.last_backend != backend.NAME:
                        self.last_backend = backend.NAME
                    return self._run(backend, self._cache_call_inputs(
                        q, k, v, cu_seqlens_q, cu_seqlens_kv, page_table), params)
        if (attention_mask is None and cu_seqlens_q is None and cu_seqlens_kv is None
                and max_seqlen_q is None and max_seqlen_kv is None
                and core_attention_bias_type == "no_bias" and core_attention_bias is None
                and alibi_slopes is None and not torch.compiler.is_compiling()):
            dense_key = self._dense_call_key(
                q, k, v, self.qkv_format if qkv_format is None else qkv_format,
                self.attn_mask_type if attn_mask_type is None else attn_mask_type,
                self.window_size if window_size is None else window_size, softcap,
                bottom_right_diagonal)
            hit = self._dense_calls.get(dense_key) if dense_key is not None else None
            if hit is not None:
                backend, params, runner = hit
                if self.last_backend != backend.NAME:
                    self.last_backend = backend.NAME
                if runner is not None:
                    return runner(q, k, v)
                return self._run(
                    backend, AttentionInputs(q, k, v, softmax_offset=self.softmax_offset), params)

        qkv_format = self.qkv_format if qkv_format is None else qkv_format
        q_format, kv_format = layout.split_qkv_format(qkv_format)
        requested_mask = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        mask_type = _mask_type_for(requested_mask, q_format, kv_format)
        window = self._window_for(requested_mask,
                                  self.window_size if window_size is None else window_size)

        if not checked:
            layout.validate_qkv(q, k, v, q_format, kv_format, self.num_attention_heads,
                                self.num_gqa_groups, self.head_dim_qk, self.head_dim_v,
                                page_table)
        given = (q, k, v)
        qkv_layout, q, k, v = layout.get_qkv_layout(q, k, v, qkv_format)

        lengths = _sequence_lengths(q, k, q_format, kv_format, mask_type, attention_mask,
                                    cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                                    page_table)
        batch, cu_q, cu_kv, sq, skv = lengths
        arbitrary = _arbitrary_mask(mask_type, attention_mask, batch, self.num_attention_heads,
                                    sq, skv, q.device)
        bias, bias_shape = _check_bias(core_attention_bias_type, core_attention_bias, batch,
                                       self.num_attention_heads, sq, skv, q)
        slopes = _check_alibi(core_attention_bias_type, alibi_slopes, batch,
                              self.num_attention_heads, q.device)
        env = selection.read_env()
        fields = params_fields(
            qkv_format=qkv_format, q_format=q_format, kv_format=kv_format,
            qkv_layout=qkv_layout, batch_size=batch, num_heads=self.num_attention_heads,
            num_gqa_groups=self.num_gqa_groups, max_seqlen_q=sq, max_seqlen_kv=skv,
            head_dim_qk=self.head_dim_qk, head_dim_v=self.head_dim_v, dtype=q.dtype,
            device_type=q.device.type,
            compute_capability=_compute_capability(q.device) if q.is_cuda else None,
            attn_mask_type=mask_type, window_size=window,
            core_attention_bias_type=core_attention_bias_type,
            core_attention_bias_shape=bias_shape,
            core_attention_bias_requires_grad=bias is not None and bias.requires_grad,
            alibi_slopes_shape=tuple(slopes.shape) if slopes is not None else None,
            attention_dropout=self.attention_dropout if self.training else 0.0,
            softmax_scale=self.softmax_scale,
            deterministic=selection.deterministic_requested(env),
            requires_grad=torch.is_grad_enabled() and any(
                t.requires_grad for t in (q, k, v)),
            is_compiling=torch.compiler.is_compiling(),
            softmax_type=self.softmax_type, return_max_logit=self.return_max_logit,
            softcap=softcap, bottom_right_diagonal=bottom_right_diagonal is not False,
            kv_page_size=0 if page_table is None else k.shape[1],
        )
        backend, params = selection.select(fields, env)
        # nn.Module.__setattr__ is slow: set on change. Under compile, reading the old value
        # would guard on it (and recompile on the next call): write it.
        if params.is_compiling or self.last_backend != backend.NAME:
            self.last_backend = backend.NAME
        inputs = AttentionInputs(q, k, v, cu_q, cu_kv, arbitrary, bias, slopes,
                                 self.softmax_offset, page_table)
        if dense_key is not None and q is given[0] and k is given[1] and v is given[2]:
            # Proven without a copy: the same key will mean the same layout and decision.
            if len(self._dense_calls) >= 64:
                self._dense_calls.clear()
            # A backend may bind the decision (its `bind`): the next equal call skips `run`'s
            # per-call planning.
            bind = getattr(backend, "bind", None)
            self._dense_calls[dense_key] = (backend, params,
                                            bind(inputs, params) if bind is not None else None)
        if cache_key is not None and _same_tensors(inputs, self._cache_call_inputs(
                *given, cu_seqlens_q, cu_seqlens_kv, page_table)):  # what a hit passes on
            step_memo[cache_key] = (backend, params)
        return self._run(backend, inputs, params)

    def _cache_call_inputs(self, q, k, v, cu_seqlens_q, cu_seqlens_kv, page_table):
        return AttentionInputs(q, k, v, cu_seqlens_q, cu_seqlens_kv,
                               softmax_offset=self.softmax_offset, page_table=page_table)

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream,
                                   cp_comm_type: str = "p2p") -> None:
        """TE's: attend with context parallelism over ``cp_group`` (a ProcessGroup; None
        turns it off). ``cp_global_ranks`` are the group's global ranks (checked against it),
        ``cp_stream`` a CUDA stream (accepted; the ring's transfers overlap the compute
        without it), ``cp_comm_type`` "p2p", "all_gather" or "a2a" ("a2a+p2p" is refused)."""
        ranks = context_parallel.check_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        self.cp_group, self.cp_global_ranks = cp_group, ranks
        self.cp_stream, self.cp_comm_type = cp_stream, cp_comm_type

    def _forward_with_gaps(self, q, k, v, rows_q, rows_kv, call_args):
        """Padded thd: gather the real tokens, attend over them packed, and put the output
        back in the padded rows (zeros between sequences, as TE's fast_zero_fill)."""
        if torch.compiler.is_compiling():
            raise ValueError("thd with padding between sequences (cu_seqlens_*_padded) is not "
                             "supported under torch.compile")
        padded_rows = q.shape[0]
        if rows_q is not None:
            q = q.index_select(0, rows_q)
        if rows_kv is not None:
            k, v = k.index_select(0, rows_kv), v.index_select(0, rows_kv)
        result = self.forward(q, k, v, **call_args)
        if rows_q is None:
            return result
        out, *max_logit = result if isinstance(result, tuple) else (result,)
        full = out.new_zeros((padded_rows, *out.shape[1:])).index_copy(0, rows_q, out)
        return (full, *max_logit) if max_logit else full

    def _window_for(self, mask_type, window_size):
        """masks.check_set_window_size, remembered for the last (mask type, window): a
        window warns once, not on every call (thd's padding variants share the rule)."""
        key = (mask_type, repr(window_size))
        if self._window_memo is None or self._window_memo[0] != key:
            self._window_memo = (key, masks.check_set_window_size(mask_type, window_size))
        return self._window_memo[1]

    def _run(self, backend, inputs, params):
        if params.kv_page_size:
            # A paged KV cache: the pools go on to a backend that reads pages, gathered
            # pages to any other.
            inputs, params = inference.kv_pages_for(backend, inputs, params)
        if self.get_rng_state_tracker is not None and params.attention_dropout > 0.0:
            # TE draws attention dropout from the tracker's RNG state when one is given.
            with self.get_rng_state_tracker().fork():
                return backend.run(inputs, params)
        return backend.run(inputs, params)

    def _init_softmax_offset(self) -> None:
        """TE's softmax_offset: None (vanilla), zeros (off-by-one: a non-persistent buffer, so
        it follows .to() but is not in the state dict, as in TE) or a zero-initialized
        Parameter ``[h]`` (learnable). Made where TE makes it: on the GPU when there is one."""
        if self.softmax_type == "vanilla":
            self.softmax_offset = None
            return
        device = "cuda" if torch.cuda.is_available() else "cpu"
        zeros = torch.zeros(self.num_attention_heads, dtype=torch.float32, device=device)
        if self.softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", zeros, persistent=False)
        else:
            self.softmax_offset = torch.nn.Parameter(zeros)

    def _dense_call_key(self, q, k, v, qkv_format, attn_mask_type, window_size, softcap,
                        bottom_right_diagonal):
        """Everything a call without masks, lengths or biases is decided by, or None.

        Tensor metadata (shape, strides, offset, dtype, device, requires_grad), which tensors
        share a storage (for packed layouts), the call's arguments, the module's settings, the
        grad and deterministic modes and the NVTE_* variables. Equal keys give equal
        validation, layout, params and backend, so a hit skips straight to the backend.
        (Written out without generators: it is built on every call.)
        """
        if type(q) is not torch.Tensor or type(k) is not torch.Tensor or (
                type(v) is not torch.Tensor):
            return None
        if window_size is not None and type(window_size) is not tuple:
            return None
        k_storage = _storage_address(k)
        return (_tensor_metadata(q), _tensor_metadata(k), _tensor_metadata(v),
                _storage_address(q) == k_storage, k_storage == _storage_address(v),
                qkv_format, attn_mask_type, window_size, softcap, bottom_right_diagonal,
                self.softmax_type, self.return_max_logit, self.training,
                self.attention_dropout, self.softmax_scale, self.num_attention_heads,
                self.num_gqa_groups, self.head_dim_qk, self.head_dim_v, torch.is_grad_enabled(),
                torch.are_deterministic_algorithms_enabled(), selection.read_env())


def _tensor_metadata(t: torch.Tensor) -> tuple:
    """What validation, layout detection and the decision read of a tensor in a dense call,
    besides its storage (``_storage_address``)."""
    return t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad


def _storage_address(t: torch.Tensor) -> int:
    """Where t's storage starts (packed layouts: which tensors share one)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


def _same_tensors(a: AttentionInputs, b: AttentionInputs) -> bool:
    return all(getattr(a, f.name) is getattr(b, f.name) for f in dataclasses.fields(a))


def _metadata(t: Optional[torch.Tensor]):
    """What a check or a decision may read of a tensor whose values it does not read."""
    if t is None:
        return None
    return type(t), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device


def check_unsupported_forward_args(cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                   cu_seqlens_kv_padded, fp8_output) -> None:
    """TE forward arguments of features transformer_fa does not have: their neutral values
    pass, anything else is a clear error."""
    if fp8_output:
        raise ValueError("fp8_output=True needs FP8 attention, which is not supported yet")
    # TE runs the attention itself in FP8 under a recipe with fp8_dpa / fp8_mha, and refuses
    # when no backend can; ours has no FP8 attention, so it refuses rather than run bf16.
    # (The autocast state read directly: every call passes here, tests/test_dpa_host.py
    # counts its Python calls.)
    recipe = fp8._STATE.recipe if fp8._STATE.enabled else None
    for field in ("fp8_dpa", "fp8_mha"):
        if getattr(recipe, field, False):
            raise ValueError(f"{type(recipe).__name__}({field}=True) asks for FP8 attention, "
                             f"which is not supported yet: use {field}=False (the GEMMs still "
                             f"run in FP8, the attention in the inputs' dtype)")
    for padded, plain, name in ((cu_seqlens_q_padded, cu_seqlens_q, "cu_seqlens_q_padded"),
                                (cu_seqlens_kv_padded, cu_seqlens_kv, "cu_seqlens_kv_padded")):
        if padded is not None and plain is None:
            raise ValueError(f"{name} needs the unpadded {name[:-7]} beside it")


def _cp_refused(bias_type, bias, alibi_slopes, softcap) -> dict:
    """The forward arguments context parallelism refuses, None where not given / neutral
    (cu_seqlens go to it apart: thd reads them, the other formats refuse them)."""
    return dict(core_attention_bias_type=None if bias_type == "no_bias" else bias_type,
                core_attention_bias=bias, alibi_slopes=alibi_slopes, softcap=softcap or None)


def _padded_sides(qkv_format, q, k, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                  cu_seqlens_kv_padded):
    """Row indices of the real tokens for each thd side whose sequences have gaps between
    them (TE's padded thd), or None for a side without; (None, None) when neither has."""
    q_format, kv_format = layout.split_qkv_format(qkv_format)
    sides = []
    for fmt, t, cu, padded, name in (
            (q_format, q, cu_seqlens_q, cu_seqlens_q_padded, "cu_seqlens_q_padded"),
            (kv_format, k, cu_seqlens_kv, cu_seqlens_kv_padded, "cu_seqlens_kv_padded")):
        if fmt != "thd" or padded is None or padded is cu or torch.equal(padded, cu):
            sides.append(None)
        else:
            sides.append(padding.padded_thd_index(cu, padded, name, t.shape[0]))
    return tuple(sides)


def _check_tuning_args(num_splits, score_mod, score_mod_bprop, score_mod_tensors,
                       score_mod_bprop_tensors) -> None:
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if (score_mod is None and score_mod_bprop is None and score_mod_tensors is None
            and score_mod_bprop_tensors is None):
        return  # every call: no tuple of names to build
    for name, value in (("score_mod", score_mod), ("score_mod_bprop", score_mod_bprop),
                        ("score_mod_tensors", score_mod_tensors),
                        ("score_mod_bprop_tensors", score_mod_bprop_tensors)):
        if value is not None:
            raise ValueError(f"{name}: cuDNN score modification callbacks are not supported; "
                             f"pass None")


def unpack_qkv(qkv_layer, kv_layer, query_layer, key_layer, value_layer, interleave_dim: int):
    """TE's packed inputs: q, k, v as views of ``qkv_layer`` (3 at ``interleave_dim``), or k, v
    as views of ``kv_layer`` (2 there) beside ``query_layer``. The views are TE layouts
    (``bs3hd``, ``sbh3d``, ``bshd_bs2hd``, ...), which layout detection then proves."""
    if interleave_dim not in (-3, -2):
        raise ValueError(f"qkv_interleave_dim must be -3 (e.g. bs3hd) or -2 (e.g. bsh3d), got "
                         f"{interleave_dim!r}")
    if qkv_layer is not None:
        if any(t is not None for t in (query_layer, key_layer, value_layer, kv_layer)):
            raise ValueError("qkv_layer excludes query_layer, key_layer, value_layer and kv_layer")
        packed, parts, name = qkv_layer, 3, "qkv_layer"
    else:
        if key_layer is not None or value_layer is not None or query_layer is None:
            raise ValueError("kv_layer goes with query_layer and excludes key_layer and "
                             "value_layer")
        packed, parts, name = kv_layer, 2, "kv_layer"
    if not isinstance(packed, torch.Tensor) or packed.dim() < 4:
        raise ValueError(f"{name} must be a tensor [..., {parts}, h, d] or [..., h, {parts}, d]")
    if packed.shape[interleave_dim] != parts:
        raise ValueError(f"{name} must have size {parts} at dim {interleave_dim} "
                         f"(qkv_interleave_dim), got shape {list(packed.shape)}")
    views = tuple(packed.select(interleave_dim, i) for i in range(parts))
    return views if parts == 3 else (query_layer,) + views


def _check_softcap(softcap) -> float:
    if (not isinstance(softcap, (int, float)) or isinstance(softcap, bool)
            or not 0.0 <= softcap < math.inf):
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    return float(softcap)


def _mask_type_for(mask_type: str, q_format: str, kv_format: str) -> str:
    mask_type = masks.normalize_mask_type(mask_type)
    if "thd" in (q_format, kv_format) and "padding" not in mask_type:
        # Packed sequences always carry their lengths: thd is a padding variant (as in TE).
        if mask_type == "arbitrary":
            raise ValueError("attn_mask_type='arbitrary' is not supported with the thd format")
        return "padding" if mask_type == "no_mask" else "padding_" + mask_type
    return mask_type


def _sequence_lengths(q, k, q_format, kv_format, mask_type, attention_mask, cu_seqlens_q,
                      cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, page_table=None):
    """(batch, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv) for the call.

    cu_seqlens are returned for thd tensors and padding masks only. For sbhd/bshd the max
    sequence lengths are the tensors' own (padded) sizes; for page pools (``page_table``)
    the table's pages per row times the page size.
    """
    padded = "padding" in mask_type
    thd = "thd" in (q_format, kv_format)
    if attention_mask is not None and (thd or not padded and mask_type != "arbitrary"):
        # As TE: the mask is read only by padding types (sbhd/bshd) and 'arbitrary'.
        logger.debug("Ignoring attention_mask: attn_mask_type=%s with %s does not use it",
                     mask_type, "thd" if thd else q_format)
        attention_mask = None
    sq, bq = layout.seq_batch_of(q, q_format)
    skv, bkv = layout.kv_seq_batch(k, kv_format, page_table)
    if padded and attention_mask is not None and "thd" not in (q_format, kv_format):
        if isinstance(attention_mask, (tuple, list)):
            if len(attention_mask) != 2:
                raise ValueError("attention_mask must be one mask or a (q_mask, kv_mask) pair")
            mask_q, mask_kv = attention_mask
        else:
            if sq != skv:
                raise ValueError("a single padding attention_mask needs sq == skv; pass "
                                 "(q_mask, kv_mask) for cross attention")
            mask_q = mask_kv = attention_mask
        cu_seqlens_q = padding.cu_from_seqlens(
            padding.seqlens_from_padding_mask(mask_q, "attention_mask (q)", bq, sq))
        cu_seqlens_kv = padding.cu_from_seqlens(
            padding.seqlens_from_padding_mask(mask_kv, "attention_mask (kv)", bkv, skv))
    if not padded:
        return bq, None, None, sq, skv
    if not thd and (cu_seqlens_q is None or cu_seqlens_kv is None):
        raise ValueError(f"attn_mask_type={mask_type!r} with the {q_format} format needs "
                         f"attention_mask (bool [b, 1, 1, s], True = padding) or cu_seqlens_q "
                         f"and cu_seqlens_kv")

    batch = padding.check_cu_seqlens(
        cu_seqlens_q, "cu_seqlens_q", bq, q.shape[0] if q_format == "thd" else None, q.device)
    padding.check_cu_seqlens(
        cu_seqlens_kv, "cu_seqlens_kv", batch, k.shape[0] if kv_format == "thd" else None, q.device)
    if page_table is not None and bkv != batch:
        raise ValueError(f"page_table has {bkv} rows but the call has {batch} sequences")
    sq = _max_len("max_seqlen_q", cu_seqlens_q, sq, max_seqlen_q)
    skv = _max_len("max_seqlen_kv", cu_seqlens_kv, skv, max_seqlen_kv)
    return batch, cu_seqlens_q, cu_seqlens_kv, sq, skv


def _max_len(name: str, cu_seqlens, padded_len: Optional[int], given: Optional[int]) -> int:
    """The padded length of a side: the tensor's own for sbhd/bshd, else max_seqlen."""
    if not host_reads_allowed():  # torch.compile or a CUDA graph capture: no device reads
        if padded_len is not None:
            return padded_len
        if given is None:
            raise ValueError(f"{name} must be given for the thd format under torch.compile "
                             f"and in CUDA graph captures")
        return given
    actual = padding.max_seqlen(cu_seqlens)
    if padded_len is not None:
        if actual > padded_len:
            raise ValueError(f"cu_seqlens for {name} has a sequence of {actual} tokens, longer "
                             f"than the tensor's sequence dim {padded_len}")
        return padded_len
    if given is None:
        return actual
    if given < actual:
        raise ValueError(f"{name}={given} is less than the longest sequence ({actual})")
    return given


def _arbitrary_mask(mask_type, attention_mask, batch, heads, sq, skv, device):
    if mask_type != "arbitrary":
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        raise TypeError("attn_mask_type='arbitrary' needs attention_mask: a bool tensor "
                        "[b|1, h|1, sq, skv], True = masked out")
    expected = (batch, heads, sq, skv)
    if attention_mask.dim() != 4 or any(
            got not in (1, want) for got, want in zip(attention_mask.shape, expected)):
        raise ValueError(f"attention_mask must broadcast to [b, h, sq, skv] = {list(expected)}, "
                         f"got {list(attention_mask.shape)}")
    if attention_mask.device != device:
        raise ValueError(f"attention_mask is on {attention_mask.device}, expected {device}")
    return attention_mask


def _check_bias(bias_type, bias, batch, heads, sq, skv, q):
    if bias_type not in BIAS_TYPES:
        raise ValueError(f"core_attention_bias_type must be one of {BIAS_TYPES}, got {bias_type!r}")
    if bias_type not in ("pre_scale_bias", "post_scale_bias"):
        if bias is not None:
            raise ValueError(f"core_attention_bias was given but core_attention_bias_type="
                             f"{bias_type!r}; use 'post_scale_bias' or 'pre_scale_bias'")
        return None, None
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
        raise TypeError(f"core_attention_bias_type={bias_type!r} needs core_attention_bias: a "
                        f"floating point tensor [1|b, 1|h, sq, skv]")
    if bias.dim() == 4 and tuple(bias.shape) == (1, 1, 1, skv):
        # TE's "111s": one row for every query. A stride-0 view of it is an ordinary 11ss
        # bias, which every backend reads correctly (or copies).
        bias = bias.expand(1, 1, sq, skv)
    if (bias.dim() != 4 or bias.shape[2:] != (sq, skv) or bias.shape[0] not in (1, batch)
            or bias.shape[1] not in (1, heads)):
        raise ValueError(f"core_attention_bias must have shape [1|b, 1|h, sq, skv] or "
                         f"[1, 1, 1, skv] with b={batch}, h={heads}, sq={sq}, skv={skv}, got "
                         f"{list(bias.shape)}")
    if bias.device != q.device:
        raise ValueError(f"core_attention_bias is on {bias.device}, expected {q.device}")
    shape = ("b" if bias.shape[0] == batch and batch > 1 else "1") + (
        "h" if bias.shape[1] == heads and heads > 1 else "1") + "ss"
    return bias, shape


def _check_alibi(bias_type, slopes, batch, heads, device):
    if bias_type != "alibi":
        if slopes is not None:
            raise ValueError("alibi_slopes was given but core_attention_bias_type is not 'alibi'")
        return None
    if slopes is None:
        return masks.default_alibi_slopes(heads).to(device)
    if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32:
        raise TypeError("alibi_slopes must be a float32 tensor [h] or [b, h]")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape [h] or [b, h] with b={batch}, h={heads}, "
                         f"got {list(slopes.shape)}")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes is on {slopes.device}, expected {device}")
    return slopes
