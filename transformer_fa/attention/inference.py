"""KV cache for inference: TE's ``InferenceParams`` and its cache managers.

The flow is TE's::

    params = InferenceParams(max_batch_size, max_sequence_length, num_heads_kv, head_dim_k,
                             dtype, is_paged=..., qkv_format="bshd")
    for each step:
        params.pre_step(OrderedDict(seq_id -> number of new tokens))
        out = model(new_tokens, inference_params=params)   # every layer calls step()

``pre_step`` decides, once per step and on the host, where every new token goes: the batch
order is the step dict's order; a sequence id seen before continues (its new tokens are
appended after its cached ones), a new id starts a sequence, an id left out is finished and
leaves the cache. ``step`` (per layer) writes the new K/V tokens into the cache in place (one
``index_copy_`` of the new tokens; the cache itself is never copied) and returns the cache
with the lengths the attention call needs: ``cu_seqlens_q`` (new tokens per sequence) and
``cu_seqlens_kv`` (cached tokens per sequence, the new ones included). The caches are kept in
``bshd``: non-paged ``[max_batch_size, max_sequence_length, h, d]`` with sequence i in row i;
paged ``[total_num_pages, page_size, h, d]`` with ``page_table`` ``[max_batch_size,
max_pages_per_seq]`` giving each sequence's pages in order.

Where TE is silent this follows FlashAttention's ``flash_attn_with_kvcache``: a step may add
any number of tokens to a continuing sequence (TE adds one), and the new queries attend with
bottom-right causal alignment (a query at position p sees keys 0..p).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections import OrderedDict
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from . import layout, masks, rope
from .params import AttentionInputs, AttentionParams

__all__ = ["InferenceParams", "KVCacheManager", "NonPagedKVCacheManager", "PagedKVCacheManager"]

CACHE_FORMAT = "bshd"  # the caches' format, as TE's
STEP_FORMATS = ("bshd", "sbhd", "thd")


def _default_device() -> torch.device:
    # Where TE allocates (the current GPU), and the CPU where there is none.
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _resolve_device(device) -> torch.device:
    """device with its index ("cuda" -> "cuda:<current>"), so that it compares equal to the
    device of the tensors allocated on it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_positive_int(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _check_step_format(qkv_format: str) -> str:
    if qkv_format not in STEP_FORMATS:
        raise ValueError(f"qkv_format must be one of {STEP_FORMATS}, got {qkv_format!r}")
    return qkv_format


def check_step_dict(step_dict, max_batch_size: int) -> None:
    """A step dict maps sequence ids to the number of new tokens (a positive int)."""
    if not isinstance(step_dict, Mapping):
        raise TypeError(f"step_dict must be an OrderedDict(seq_id -> step_len), got "
                        f"{type(step_dict).__name__}")
    if len(step_dict) > max_batch_size:
        raise ValueError(f"step_dict has {len(step_dict)} sequences, more than "
                         f"max_batch_size={max_batch_size}")
    for seq, step_len in step_dict.items():
        if not isinstance(step_len, int) or isinstance(step_len, bool) or step_len <= 0:
            raise ValueError(f"step_dict[{seq!r}] must be a positive int (the number of new "
                             f"tokens), got {step_len!r}")


class KVCacheManager:
    """Base class of the cache managers (TE's): a custom manager overrides these."""

    def __init__(self):
        self.cache: Dict[int, Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = {}
        self.sequences: "OrderedDict" = OrderedDict()  # seq_id -> cached length after the step

    def reset(self):
        """Forget every sequence (the memory stays allocated)."""
        self.sequences = OrderedDict()

    def allocate_memory(self, layer_number: int):
        """Allocate the cache of a layer."""
        self.cache[layer_number] = (None, None)

    def pre_step(self, step_dict: "OrderedDict"):
        """Update the tracked sequences for the step; returns them (seq_id -> length)."""
        return self.sequences

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor,
             cu_new_seqlens: torch.Tensor, cu_cached_seqlens: torch.Tensor, qkv_format: str):
        """Copy the new tokens into the cache of a layer; returns (k_cache, v_cache)."""
        return self.cache[layer_number]


class _TokenCache(KVCacheManager):
    """What both managers share: the sequences' lengths, the check of a step against the
    cache's limits before anything changes, and the in-place write of the new tokens at
    rows planned by ``pre_step`` (``_rows_for``, the one method the layouts differ in)."""

    def __init__(self, slots: int, slot_len: int, num_heads: int, head_dim_k: int,
                 dtype: torch.dtype, max_batch_size: int, max_seqlen: int,
                 head_dim_v: Optional[int], device):
        super().__init__()
        self.max_batch_size = _check_positive_int(max_batch_size, "max_batch_size")
        self.max_seqlen = _check_positive_int(max_seqlen, "max_sequence_length")
        self.num_heads = _check_positive_int(num_heads, "num_heads_kv")
        self.head_dim_k = _check_positive_int(head_dim_k, "head_dim_k")
        self.head_dim_v = _check_positive_int(
            head_dim_k if head_dim_v is None else head_dim_v, "head_dim_v")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating point torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.device = _default_device() if device is None else _resolve_device(device)
        self._slots, self._slot_len = slots, slot_len
        self._step_lens: List[int] = []
        self._write_rows: Optional[torch.Tensor] = None  # cache row of each new token
        self._token_seq: Optional[torch.Tensor] = None  # batch index of each new token
        self._token_pos: Optional[torch.Tensor] = None  # its index among the step's tokens
        self._uniform_step_len: Optional[int] = None  # the step length shared by all, if any

    def allocate_memory(self, layer_number: int):
        """K ``[slots, slot_len, h, dk]`` and V ``[slots, slot_len, h, dv]``, zeros."""
        def zeros(d):
            return torch.zeros(self._slots, self._slot_len, self.num_heads, d, dtype=self.dtype,
                               device=self.device)
        self.cache[layer_number] = (zeros(self.head_dim_k), zeros(self.head_dim_v))

    def reset(self):
        super().reset()
        self._step_lens = []
        self._write_rows = self._token_seq = self._token_pos = self._uniform_step_len = None

    def _lengths_after(self, step_dict) -> "OrderedDict":
        """The sequences after the step, in the step's order; raises before changing anything
        if one would exceed max_seqlen."""
        check_step_dict(step_dict, self.max_batch_size)
        after = OrderedDict()
        for seq, step_len in step_dict.items():
            after[seq] = self.sequences.get(seq, 0) + step_len
            if after[seq] > self.max_seqlen:
                raise ValueError(f"sequence {seq!r} would hold {after[seq]} tokens after this "
                                 f"step, more than max_sequence_length={self.max_seqlen}")
        return after

    def _plan_writes(self, step_dict, after) -> None:
        """Per new token: its batch index, its index in the step, and its cache row. Built
        on the host in lists and sent to the device as one tensor (one copy per step)."""
        self._step_lens = list(step_dict.values())
        lens = set(self._step_lens)
        self._uniform_step_len = lens.pop() if len(lens) == 1 else None
        rows, seq_index, pos = [], [], []
        for i, (seq, step_len) in enumerate(step_dict.items()):
            rows += self._rows_for(i, seq, range(after[seq] - step_len, after[seq]))
            seq_index += [i] * step_len
            pos += range(step_len)
        plan = to_device(torch.tensor([rows, seq_index, pos], dtype=torch.int64).view(3, -1),
                         self.device)
        self._write_rows, self._token_seq, self._token_pos = plan[0], plan[1], plan[2]

    def _rows_for(self, batch_index: int, seq, positions: range) -> List[int]:
        """The cache rows (of the cache viewed as ``[slots * slot_len, h, d]``) of a
        sequence's tokens at ``positions``."""
        raise NotImplementedError

    def _check_new_tokens(self, layer_number, new_k, new_v, qkv_format) -> None:
        """new_k / new_v against the cache and the step planned by pre_step."""
        _check_step_format(qkv_format)
        if layer_number not in self.cache:
            raise ValueError(f"layer_number={layer_number!r} has no KV cache: call "
                             f"allocate_memory({layer_number!r}) first")
        for name, t, d in (("new_k", new_k, self.head_dim_k), ("new_v", new_v, self.head_dim_v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != self.dtype:
                raise TypeError(f"{name} dtype {t.dtype} differs from the KV cache's {self.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the KV cache is on {self.device}")
            want = 3 if qkv_format == "thd" else 4
            if t.dim() != want or t.shape[-2] != self.num_heads or t.shape[-1] != d:
                raise ValueError(f"{name} must be {qkv_format} with {self.num_heads} heads of "
                                 f"dim {d} (the KV cache's), got shape {tuple(t.shape)}")
        if new_k.shape[:-1] != new_v.shape[:-1]:
            raise ValueError(f"new_k and new_v must agree in all but the head dim, got "
                             f"{tuple(new_k.shape)} and {tuple(new_v.shape)}")
        batch, longest, total = len(self._step_lens), max(self._step_lens, default=0), sum(
            self._step_lens)
        if qkv_format == "thd":
            if new_k.shape[0] < total:
                raise ValueError(f"new_k has {new_k.shape[0]} tokens but pre_step() planned "
                                 f"{total} new tokens")
            return
        seq_dim = 0 if qkv_format == "sbhd" else 1
        got_b, got_s = new_k.shape[1 - seq_dim], new_k.shape[seq_dim]
        if got_b != batch or got_s < longest:
            raise ValueError(f"new_k ({qkv_format}, shape {tuple(new_k.shape)}) must hold "
                             f"batch {batch} (the sequences of pre_step()) and at least "
                             f"{longest} tokens per sequence (the longest step)")

    def _new_tokens(self, t: torch.Tensor, qkv_format: str) -> torch.Tensor:
        """The step's real tokens of t, ``[n, h, d]`` in batch then position order (padding
        left out; any strides). thd tokens sit back to back in step order (cu_seqlens_q are
        the step's): the first n rows. bshd / sbhd steps adding the same number of tokens to
        every sequence (a decode step: one each) need no gather: a view (or a copy for
        several tokens a sequence)."""
        t = t.detach()  # the cache holds values: no gradient flows into cached K/V (as TE)
        if qkv_format == "thd":
            return t[:self._token_seq.shape[0]]
        seq_dim = 0 if qkv_format == "sbhd" else 1
        step_len = self._uniform_step_len
        if step_len == 1:
            return t.select(seq_dim, 0)
        if step_len is not None:
            return t.narrow(seq_dim, 0, step_len).movedim(seq_dim, 1).flatten(0, 1)
        if qkv_format == "bshd":
            return t[self._token_seq, self._token_pos]
        return t[self._token_pos, self._token_seq]

    def _write(self, layer_number, new_k, new_v, qkv_format) -> None:
        for cache, new in zip(self.cache[layer_number], (new_k, new_v)):
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, self._write_rows, self._new_tokens(new, qkv_format))


class NonPagedKVCacheManager(_TokenCache):
    """Contiguous cache: sequence i of the batch in row i of
    ``[max_batch_size, max_seqlen, h, d]``. When sequences leave or the order changes, the
    rows of the continuing sequences move (once per layer, only the rows that move)."""

    def __init__(self, max_batch_size: int, max_seqlen: int, num_heads: int, head_dim_k: int,
                 dtype: torch.dtype, head_dim_v: Optional[int] = None, device=None):
        super().__init__(max_batch_size, max_seqlen, num_heads, head_dim_k, dtype,
                         max_batch_size, max_seqlen, head_dim_v, device)
        self._rows_of_layer: Dict[int, List] = {}  # layer -> seq id held by each row
        self._order: List = []  # the step's sequences, in batch order
        self._continuing: set = set()  # sequences of the step with tokens cached before it

    def allocate_memory(self, layer_number: int):
        super().allocate_memory(layer_number)
        self._rows_of_layer[layer_number] = []

    def reset(self):
        super().reset()
        self._rows_of_layer = {layer: [] for layer in self._rows_of_layer}
        self._continuing = set()
        self._order = []

    def pre_step(self, step_dict: "OrderedDict"):
        after = self._lengths_after(step_dict)
        # sequences that continue keep their cached tokens (moved to their new row in step())
        self._continuing = {seq for seq in step_dict if seq in self.sequences}
        self.sequences = after
        self._order = list(after)  # the sequence held by each row after the step
        self._plan_writes(step_dict, after)
        return self.sequences

    def _rows_for(self, batch_index, seq, positions):
        return [batch_index * self.max_seqlen + p for p in positions]

    def _move_rows(self, layer_number: int) -> None:
        """Bring this layer's rows into the batch order of the current step."""
        held, order = self._rows_of_layer[layer_number], self._order
        if held == order:  # the usual decode step: the same sequences in the same order
            return
        src, dst = [], []
        for row, seq in enumerate(order):
            if seq in self._continuing and seq in held and held.index(seq) != row:
                src.append(held.index(seq))
                dst.append(row)
        if src:
            moves = to_device(torch.tensor([src, dst]), self.device)
            for cache in self.cache[layer_number]:
                cache[moves[1]] = cache[moves[0]]  # gathered first: overlapping moves are safe
        self._rows_of_layer[layer_number] = order

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens,
             qkv_format: str):
        """Write the new tokens into rows ``0..b-1``; returns ``(k_cache[:b], v_cache[:b])``."""
        self._check_new_tokens(layer_number, new_k, new_v, qkv_format)
        self._move_rows(layer_number)
        self._write(layer_number, new_k, new_v, qkv_format)
        b = len(self.sequences)
        k_cache, v_cache = self.cache[layer_number]
        return k_cache[:b], v_cache[:b]


class PagedKVCacheManager(_TokenCache):
    """Paged cache: a pool of ``total_num_pages`` pages of ``page_size`` tokens; each sequence
    holds the pages its tokens need, listed in order in its row of ``page_table``."""

    def __init__(self, total_num_pages: int, page_size: int, num_heads: int, head_dim_k: int,
                 dtype: torch.dtype, max_batch_size: int, max_seqlen: int,
                 head_dim_v: Optional[int] = None, device=None):
        self.total_num_pages = _check_positive_int(total_num_pages, "total_num_pages")
        self.page_size = _check_positive_int(page_size, "page_size")
        super().__init__(total_num_pages, page_size, num_heads, head_dim_k, dtype,
                         max_batch_size, max_seqlen, head_dim_v, device)
        if max_seqlen % page_size:
            raise ValueError(f"max_sequence_length={max_seqlen} must be a multiple of "
                             f"page_size={page_size}")
        self.max_pages_per_seq = max_seqlen // page_size
        self.free_pages: List[int] = list(range(total_num_pages))
        self.allocated_pages: Dict[object, List[int]] = {}
        self.page_table = torch.zeros(max_batch_size, self.max_pages_per_seq, dtype=torch.int32,
                                      device=self.device)

    def reset(self):
        super().reset()
        self.free_pages = list(range(self.total_num_pages))
        self.allocated_pages = {}
        self.page_table.zero_()

    # TE's page bookkeeping --------------------------------------------------------------
    def get_sequence_count(self) -> int:
        return len(self.sequences)

    def get_sequence_lengths(self) -> List[int]:
        return list(self.sequences.values())

    def has_free_page(self) -> bool:
        return len(self.free_pages) > 0

    def get_page_count(self, seq) -> int:
        return len(self.allocated_pages.get(seq, []))

    def get_page_list(self, seq) -> List[int]:
        return list(self.allocated_pages.get(seq, []))

    def pages_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def allocate_page(self, seq) -> None:
        """Give a sequence one more page from the pool."""
        if not self.free_pages:
            raise RuntimeError("KV cache is full: no free page left")
        self.allocated_pages.setdefault(seq, []).append(self.free_pages.pop(0))

    def allocate_sequence(self, seq, context_len: int) -> None:
        """Give a new sequence the pages for its first context_len tokens."""
        for _ in range(self.pages_needed(context_len)):
            self.allocate_page(seq)

    def deallocate_sequence(self, seq) -> None:
        """Return all pages of a sequence to the pool."""
        if seq not in self.allocated_pages:
            raise KeyError(f"sequence {seq!r} holds no pages")
        self.free_pages.extend(self.allocated_pages.pop(seq))

    def get_page_table(self, sequences: List) -> torch.Tensor:
        """Fill the rows of ``page_table`` for sequences (in order); unused entries are 0."""
        rows = [self.get_page_list(seq) for seq in sequences]  # built on the host: one copy
        rows = torch.tensor([r + [0] * (self.max_pages_per_seq - len(r)) for r in rows],
                            dtype=torch.int32).view(len(sequences), self.max_pages_per_seq)
        self.page_table[:len(sequences)].copy_(to_device(rows, self.device))
        return self.page_table

    def pre_step(self, step_dict: "OrderedDict"):
        after = self._lengths_after(step_dict)
        finished = [seq for seq in self.sequences if seq not in step_dict]
        freed = sum(self.get_page_count(seq) for seq in finished)
        wanted = sum(self.pages_needed(n) - self.get_page_count(seq) for seq, n in after.items()
                     if seq not in finished)
        if wanted > len(self.free_pages) + freed:
            raise ValueError(f"the step needs {wanted} new pages but only "
                             f"{len(self.free_pages) + freed} of total_num_pages="
                             f"{self.total_num_pages} are free")
        for seq in finished:
            self.deallocate_sequence(seq)
        for seq, n in after.items():
            for _ in range(self.pages_needed(n) - self.get_page_count(seq)):
                self.allocate_page(seq)
        self.sequences = after
        self.get_page_table(list(after))
        self._plan_writes(step_dict, after)
        return self.sequences

    def _rows_for(self, batch_index, seq, positions):
        pages, size = self.allocated_pages[seq], self.page_size
        return [pages[p // size] * size + p % size for p in positions]

    def step(self, layer_number, new_k, new_v, cu_new_seqlens, cu_cached_seqlens,
             qkv_format: str):
        """Write the new tokens into their pages; returns the paged ``(k_cache, v_cache)``."""
        self._check_new_tokens(layer_number, new_k, new_v, qkv_format)
        self._write(layer_number, new_k, new_v, qkv_format)
        return self.cache[layer_number]



def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. To a GPU through pinned memory without blocking: a
    pageable copy would wait for the GPU to finish its queue (a sync on every step)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def gather_pages(cache: Tuple[torch.Tensor, torch.Tensor], page_table: torch.Tensor,
                 batch_size: int, num_pages: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Paged K and V ``[pages, page_size, h, d]`` as contiguous ``[b, num_pages * page_size,
    h, d]``: the first num_pages pages of the first batch_size rows of page_table (a copy)."""
    table = page_table[:batch_size, :num_pages].to(torch.int64)
    return tuple(c[table].flatten(1, 2) for c in cache)


class InferenceParams:
    """TE's KV cache for inference (see the module docstring for the flow).

    Args are TE's: ``num_heads_kv``, ``head_dim_k`` and ``dtype`` are required (as in TE
    2.2+); ``head_dim_v`` defaults to ``head_dim_k``. ``is_paged=True`` needs ``page_size``
    (dividing ``max_sequence_length``) and ``total_num_pages``: any pool size (TE asks for
    ``max_batch_size * max_sequence_length / page_size``; a smaller pool is an error only when
    a step needs more pages than are free). ``max_ctx_len`` (required for ``qkv_format="thd"``,
    as TE) is the longest context, ``1..max_sequence_length``. ``custom_cache_manager`` is a
    ``KVCacheManager`` subclass, built with TE's arguments. ``device`` (not TE's; TE uses the
    current GPU) is where the caches live: the current GPU if there is one, else the CPU.

    After ``pre_step``: ``batch_size``, ``sequences`` (seq_id -> cached length after the step,
    in the step's order), ``sequences_pre_step`` (before it), ``cu_seqlens_q`` /
    ``cu_seqlens_kv`` ``[max_batch_size + 1]`` (new / cached tokens; entries past the batch
    repeat the total), ``get_seqlens_pre_step()`` ``[max_batch_size]``, ``max_seqlen_q`` (the
    longest step).
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int,
                 num_heads_kv: Optional[int] = None, head_dim_k: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, head_dim_v: Optional[int] = None,
                 is_paged: bool = False, total_num_pages: Optional[int] = None,
                 page_size: Optional[int] = None, max_ctx_len: Optional[int] = None,
                 qkv_format: str = "bshd", custom_cache_manager=None, device=None):
        self.max_batch_size = _check_positive_int(max_batch_size, "max_batch_size")
        self.max_sequence_length = _check_positive_int(max_sequence_length,
                                                       "max_sequence_length")
        if num_heads_kv is None or head_dim_k is None or dtype is None:
            raise ValueError("num_heads_kv, head_dim_k and dtype are required (as in TE 2.2+)")
        self.input_qkv_format = _check_step_format(qkv_format)
        if qkv_format == "thd" and max_ctx_len is None:
            raise ValueError("max_ctx_len is required with qkv_format='thd' (as in TE)")
        if max_ctx_len is not None and not (
                isinstance(max_ctx_len, int) and 1 <= max_ctx_len <= max_sequence_length):
            raise ValueError(f"max_ctx_len must be an int in 1..max_sequence_length="
                             f"{max_sequence_length}, got {max_ctx_len!r}")
        self.max_ctx_len = max_ctx_len
        self.num_heads_kv, self.head_dim_k, self.dtype = num_heads_kv, head_dim_k, dtype
        self.head_dim_v = head_dim_k if head_dim_v is None else head_dim_v
        self.is_paged = bool(is_paged)
        manager = custom_cache_manager
        if manager is None:
            manager = PagedKVCacheManager if self.is_paged else NonPagedKVCacheManager
        if not (isinstance(manager, type) and issubclass(manager, KVCacheManager)):
            raise TypeError(f"custom_cache_manager must be a KVCacheManager subclass, got "
                            f"{manager!r}")
        # TE's arguments; ours take the device too.
        extra = {"device": device} if issubclass(manager, _TokenCache) else {}
        sizes = dict(num_heads=num_heads_kv, head_dim_k=head_dim_k, dtype=dtype,
                     max_batch_size=max_batch_size, max_seqlen=max_sequence_length,
                     head_dim_v=self.head_dim_v, **extra)
        if self.is_paged:
            if page_size is None or total_num_pages is None:
                raise ValueError("is_paged=True needs page_size and total_num_pages")
            self.page_size, self.total_num_pages = page_size, total_num_pages
            self.cache_manager = manager(total_num_pages=total_num_pages, page_size=page_size,
                                         **sizes)
        else:
            self.cache_manager = manager(**sizes)
        self.device = getattr(self.cache_manager, "device", None) or _default_device()
        self.cache_qkv_format = CACHE_FORMAT
        self.output_qkv_format = _output_format(qkv_format)
        # One buffer (one host-to-device copy a step), fixed addresses (as TE's buffers).
        self._lengths = torch.zeros(3 * max_batch_size + 2, dtype=torch.int32,
                                    device=self.device)
        self.cu_seqlens_q, self.cu_seqlens_kv, self.pre_step_seqlens = self._lengths.split(
            [max_batch_size + 1, max_batch_size + 1, max_batch_size])
        # Set by pre_step: (cu_seqlens_q, cu_seqlens_kv, start positions) of the batch, and
        # what the layers of one step share (RoPE's positions and angles).
        self._step_views: Tuple[torch.Tensor, ...] = ()
        self.step_memo: Dict = {}
        self._layer_owners: Dict[int, object] = {}
        self.reset()

    def reset(self):
        """Forget every sequence (the caches stay allocated)."""
        self.sequences = OrderedDict()
        self.sequences_pre_step = OrderedDict()
        self.batch_size = 0
        self.max_seqlen_q = self._step_total = 0
        self.cache_manager.reset()
        self._lengths.zero_()
        self._start_step()
        self._layer_owners = {}

    def __repr__(self) -> str:
        sizes = (f"total_pages={self.total_num_pages}, page_size={self.page_size}"
                 if self.is_paged else f"max_batch_size={self.max_batch_size}, "
                 f"max_seqlen={self.max_sequence_length}")
        return (f"dtype={self.dtype}, is_paged={self.is_paged}, {sizes}, num_heads="
                f"{self.num_heads_kv}, head_dim_k={self.head_dim_k}, head_dim_v={self.head_dim_v}")

    def allocate_memory(self, layer_number: int):
        """Allocate the K and V caches of a layer (non-paged ``[max_batch_size,
        max_sequence_length, h, d]``, paged ``[total_num_pages, page_size, h, d]``)."""
        self.cache_manager.allocate_memory(layer_number)

    def pre_step(self, step_dict: "OrderedDict"):
        """Start a step: ``step_dict`` maps each sequence of the batch, in batch order, to its
        number of new tokens. Ids not seen before start sequences, ids left out finish. Bad
        input (more sequences than max_batch_size, a sequence beyond max_sequence_length, no
        free pages) raises before anything changes."""
        check_step_dict(step_dict, self.max_batch_size)
        self.sequences = self.cache_manager.pre_step(step_dict)
        self.batch_size = len(step_dict)
        step_lens = list(step_dict.values())
        cached = [self.sequences[seq] for seq in step_dict]
        self.sequences_pre_step = OrderedDict(
            (seq, n - s) for seq, n, s in zip(step_dict, cached, step_lens))
        self.max_seqlen_q = max(step_lens, default=0)
        self._step_total = sum(step_lens)
        # Copied into the fixed buffers; entries past the batch repeat the totals.
        pad = [0] * (self.max_batch_size - self.batch_size)
        pre = list(self.sequences_pre_step.values())
        host = torch.tensor([0, *itertools.accumulate(step_lens + pad), 0,
                             *itertools.accumulate(cached + pad), *pre, *pad],
                            dtype=torch.int32)
        self._lengths.copy_(to_device(host, self.device))
        self._start_step()

    def _start_step(self) -> None:
        """The views of the batch's lengths (made once a step, not once a layer) and an
        empty step memo."""
        b = self.batch_size
        self._step_views = (self.cu_seqlens_q[:b + 1], self.cu_seqlens_kv[:b + 1],
                            self.pre_step_seqlens[:b])
        self.step_memo = {}

    def get_seqlens_pre_step(self) -> torch.Tensor:
        """Cached lengths before the step ``[max_batch_size]``: each sequence's first new
        position (RoPE's start positions)."""
        return self.pre_step_seqlens

    def step(self, layer_number: int, new_k: torch.Tensor, new_v: torch.Tensor,
             qkv_format: str):
        """Write the new K/V tokens of a layer into its cache (in place) and return what the
        attention over the cache needs: ``(k_cache, v_cache, cu_seqlens_q, cu_seqlens_kv,
        max_sequence_length, qkv_format)`` with cu_seqlens ``[batch_size + 1]`` and the
        format of (new q, cache), e.g. ``"thd_2bshd"``. The caches are TE's: non-paged
        ``[b, max_sequence_length, h, d]``, paged the whole page pool (see
        ``convert_paged_to_nonpaged``). Bad input raises before the cache changes."""
        self.input_qkv_format = _check_step_format(qkv_format)
        self.output_qkv_format = _output_format(qkv_format)
        k_cache, v_cache = self.cache_manager.step(layer_number, new_k, new_v,
                                                   self.cu_seqlens_q, self.cu_seqlens_kv,
                                                   qkv_format)
        cu_q, cu_kv, _ = self._step_views
        return k_cache, v_cache, cu_q, cu_kv, self.max_sequence_length, self.output_qkv_format

    def convert_paged_to_nonpaged(self, layer_number: int):
        """The paged K and V of a layer as contiguous ``[batch_size, max_sequence_length, h,
        d]`` tensors (a copy), sequence i in row i."""
        if not self.is_paged:
            raise ValueError("convert_paged_to_nonpaged needs a paged cache (is_paged=True)")
        manager = self.cache_manager
        return gather_pages(manager.cache[layer_number], manager.page_table, self.batch_size,
                            manager.max_pages_per_seq)


def _output_format(qkv_format: str) -> str:
    return qkv_format if qkv_format == CACHE_FORMAT else f"{qkv_format}_2{CACHE_FORMAT}"


# --------------------------------------------------------------------------------------------
# The modules' use of the cache
# --------------------------------------------------------------------------------------------
def check_inference_params(inference_params, attention_type: str) -> None:
    if not isinstance(inference_params, InferenceParams):
        raise TypeError(f"inference_params must be a transformer_fa.InferenceParams, got "
                        f"{type(inference_params).__name__}")
    if attention_type != "self":
        raise ValueError("inference_params: the KV cache serves self attention only "
                         f"(attention_type={attention_type!r})")


def allocate_on_first_use(inference_params, layer_number: int, attention_type: str) -> None:
    """MultiheadAttention's part (TE's): a layer's cache is allocated on its first call."""
    check_inference_params(inference_params, attention_type)
    if layer_number not in inference_params.cache_manager.cache:
        inference_params.allocate_memory(layer_number)


def _claim_layer(inference_params: InferenceParams, layer_number, module) -> None:
    """One module per layer_number: two layers sharing one would overwrite each other's
    tokens."""
    if layer_number is None:
        raise ValueError("inference_params needs the module's layer_number (a distinct int per "
                         "layer): pass layer_number= when building it")
    owner = inference_params._layer_owners.get(layer_number, module)
    if owner is not module:
        raise ValueError(f"layer_number={layer_number} is used by two attention modules with "
                         f"one InferenceParams; give every layer its own layer_number")


def cache_mask_type(attn_mask_type: str) -> str:
    """The mask over the cache: its lengths make every type a padding one, and a causal
    mask aligns bottom-right (a new query at position p sees keys 0..p), as TE turns
    'padding_causal' into 'padding_causal_bottom_right'."""
    attn_mask_type = masks.normalize_mask_type(attn_mask_type)
    if attn_mask_type == "arbitrary":
        raise ValueError("attn_mask_type='arbitrary' is not supported with inference_params")
    if "causal" in attn_mask_type:
        return "padding_causal_bottom_right"
    return "padding"


def attention_over_cache(inference_params, module, q, k, v, qkv_format: str,
                         attn_mask_type: str, call_args: dict):
    """Write k, v into the cache of ``module``'s layer and describe the attention of q over
    it as a varlen call: ``(q, k_cache, v_cache, arguments)`` with the step's cu_seqlens, a
    padding mask type and the cache's format; the arguments are ``forward``'s plus
    ``page_table``: for a paged cache k_cache / v_cache are the page pools and page_table
    the batch's rows of the page table (see ``AttentionInputs.page_table``), else None.
    Checks everything first: bad input leaves the cache unchanged."""
    check_inference_params(inference_params, module.attention_type)
    for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        if call_args.pop(name, None) is not None:
            raise ValueError(f"{name} is not supported with inference_params (the cache "
                             f"holds the sequences back to back)")
    _claim_layer(inference_params, module.layer_number, module)
    q_format = _check_step_format(qkv_format)
    if call_args.get("core_attention_bias_type", "no_bias") not in ("no_bias", "alibi"):
        raise ValueError(f"core_attention_bias_type={call_args['core_attention_bias_type']!r} "
                         f"is not supported with inference_params (no_bias or alibi)")
    mask_type = cache_mask_type(attn_mask_type)
    layout.validate_qkv(q, k, v, q_format, q_format, module.num_attention_heads,
                        module.num_gqa_groups, module.head_dim_qk, module.head_dim_v)
    b, total = inference_params.batch_size, inference_params._step_total
    if b == 0:
        raise ValueError("inference_params has no sequence in this step: call pre_step() first")
    if q_format == "thd" and q.shape[0] < total:
        raise ValueError(f"query_layer has {q.shape[0]} tokens but pre_step() planned {total}")
    _check_given_cu_seqlens(call_args.get("cu_seqlens_q"), inference_params.cu_seqlens_q[:b + 1])

    k_cache, v_cache, cu_q, cu_kv, max_kv, kv_format = inference_params.step(
        module.layer_number, k, v, q_format)
    inference_params._layer_owners[module.layer_number] = module
    page_table = None
    if inference_params.is_paged:
        # The call gets the page pools and the batch's rows of the page table, up to the
        # pages of the longest sequence (a view); a backend that cannot read pages gets them
        # gathered (kv_pages_for).
        manager = inference_params.cache_manager
        num_pages = math.ceil(max(inference_params.sequences.values()) / manager.page_size)
        page_table = manager.page_table[:b, :num_pages]
        max_kv = num_pages * manager.page_size
    step_len = inference_params.max_seqlen_q
    if q_format == "thd" and q.shape[0] == total == b * step_len:
        # Every sequence adds step_len tokens and q has no rows past them: the step is the
        # bshd one [b, step_len, h, d] (a view), a bshd model's call, without the padding
        # of q and of the output around a thd call (thd_rows_of brings the output back).
        q, q_format, kv_format = q.unflatten(0, (b, step_len)), CACHE_FORMAT, CACHE_FORMAT
    args = dict(call_args, attention_mask=None, qkv_format=kv_format, cu_seqlens_q=cu_q,
                cu_seqlens_kv=cu_kv,
                max_seqlen_q=step_len if q_format == "thd" else None,
                max_seqlen_kv=max_kv, attn_mask_type=mask_type, bottom_right_diagonal=True,
                page_table=page_table)
    return q, k_cache, v_cache, args


def thd_rows_of(result, query_layer: torch.Tensor, q: torch.Tensor):
    """The attention output (or ``(output, max_logit)``) of a thd step that
    attention_over_cache turned into a bshd one (q of one dim more than query_layer) as
    thd rows ``[t, h * dv]`` again; any other output as it is."""
    if q.dim() == query_layer.dim():
        return result
    if isinstance(result, tuple):
        return (result[0].flatten(0, 1), *result[1:])
    return result.flatten(0, 1)


def kv_pages_for(backend, inputs: AttentionInputs,
                 params: AttentionParams) -> Tuple[AttentionInputs, AttentionParams]:
    """The inputs and params of a paged call (``params.kv_page_size > 0``) as ``backend``
    reads them: unchanged if its ``reads_kv_pages(params)`` says it reads page pools, else
    with the pages gathered into contiguous ``[b, max_seqlen_kv, h, d]`` K and V, no page
    table and ``kv_page_size`` 0."""
    reads_kv_pages = getattr(backend, "reads_kv_pages", None)
    if reads_kv_pages is not None and reads_kv_pages(params):
        return inputs, params
    table = inputs.page_table
    k, v = gather_pages((inputs.k, inputs.v), table, table.shape[0], table.shape[1])
    return (dataclasses.replace(inputs, k=k, v=v, page_table=None),
            dataclasses.replace(params, kv_page_size=0))


def _check_given_cu_seqlens(given, expected: torch.Tensor) -> None:
    """A cu_seqlens_q passed beside inference_params must be the step's (TE reads the
    step's); cu_seqlens_kv is replaced by the cached lengths, as in TE."""
    if given is None:
        return
    n = expected.numel()
    if (not isinstance(given, torch.Tensor) or given.dim() != 1 or given.numel() < n
            or not torch.equal(given[:n].to(expected), expected)):
        raise ValueError(f"cu_seqlens_q {given.tolist() if isinstance(given, torch.Tensor) else given!r} "
                         f"differs from the step's {expected.tolist()} (set by "
                         f"inference_params.pre_step())")


def rope_for_step(inference_params, q: torch.Tensor, k: torch.Tensor,
                  tables: Tuple[torch.Tensor, torch.Tensor], tensor_format: str,
                  interleaved: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated at each sequence's positions in the step (each continues at its
    cached length). The tables must cover every real token; bshd/sbhd padding rows past
    them rotate by angle 0 (their outputs are never read). The positions are computed once
    a step (the first layer's call; later layers and k reuse them: ``step_memo``), and so
    are the angles of a table."""
    longest = max(inference_params.sequences.values(), default=0)
    padded = longest
    seq_dim = None if tensor_format == "thd" else tensor_format.index("s")
    if seq_dim is not None:
        padded = max(max(inference_params.sequences_pre_step.values(), default=0)
                     + q.shape[seq_dim], longest)
    memo = inference_params.step_memo
    key = ("rope positions", tensor_format, q.shape[0] if seq_dim is None else q.shape[seq_dim],
           q.device)
    positions = memo.get(key)
    if positions is None:
        cu_q, _, starts = inference_params._step_views
        positions = memo[key] = rope.step_positions(tensor_format, q, cu_q, starts)
    out = []
    for t, table in zip((q, k), tables):
        rope.check_freqs(t, table)
        if table.shape[0] < longest:
            raise ValueError(f"rotary_pos_emb covers {table.shape[0]} positions but a sequence "
                             f"reaches {longest} tokens in this step")
        extra = padded - table.shape[0]
        if extra > 0:  # padding rows past the table (a prefill of unequal prompts)
            table = torch.cat([table, table.new_zeros(extra, *table.shape[1:])])
        out.append(rope.apply_rotary_pos_emb_at(t, table, positions, tensor_format,
                                                interleaved, fused=True, memo=memo))
    return out[0], out[1]
