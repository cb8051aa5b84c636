"""KV cache inference (InferenceParams): the cache across steps equals recomputing each whole
sequence without it; the cache managers' bookkeeping; bad input is a clear error that leaves
the cache unchanged."""
import dataclasses
import math
from collections import OrderedDict

import pytest
import torch

import transformer_fa as tfa
from transformer_fa.attention import context_parallel, inference, layout
from transformer_fa.attention.dot_product_attention import _sequence_lengths
from transformer_fa.attention.backends import unfused
from kv_cache_cases import (GQA, HEAD_DIM, HEADS, HIDDEN, MAX_SEQLEN, SCHEDULE, make_params,
                            make_stack, reference_outputs, rope_table, run_schedule,
                            sequence_inputs)

FORMATS = ("bshd", "sbhd", "thd")


def check_schedule(qkv_format, is_paged, rope, cache_args=None, params=None, **layer_args):
    """cache_args: the cached stack's only (the reference runs each sequence alone, causal).
    params: the InferenceParams to use (default: make_params')."""
    reference = make_stack("bshd", **layer_args)
    stack = make_stack(qkv_format, **layer_args, **(cache_args or {}))
    inputs = sequence_inputs(SCHEDULE)
    expected = reference_outputs(reference, inputs, rope)
    params = make_params(qkv_format, is_paged) if params is None else params
    for step, outs, positions in run_schedule(stack, params, inputs, qkv_format, rope):
        for seq, out in outs.items():
            start, end = positions[seq]
            torch.testing.assert_close(out, expected[seq][start:end], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"step {dict(step)}, seq {seq}: {m}")
    return stack


@pytest.mark.parametrize("is_paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("qkv_format", FORMATS)
def test_cache_equals_recomputing_whole_sequences(qkv_format, is_paged):
    """GQA, RoPE, sequences joining, leaving and reordering, prefill and multi-token steps."""
    stack = check_schedule(qkv_format, is_paged, rope_table())
    assert stack[0].self_attention.core_attention.last_backend == "UnfusedDotProductAttention"


def spy_on_unfused(monkeypatch, check, reads_kv_pages=None):
    """Wraps the unfused backend's run: ``check(inputs, params)`` sees every call over the
    cache (those with cu_seqlens_kv). ``reads_kv_pages`` (None: the module has none) becomes
    the module's; page pools reaching run are gathered here through the page table."""
    if reads_kv_pages is None:
        monkeypatch.delattr(unfused, "reads_kv_pages", raising=False)
    else:
        monkeypatch.setattr(unfused, "reads_kv_pages", reads_kv_pages, raising=False)
    run = unfused.run

    def spy(inputs, params):
        if inputs.cu_seqlens_kv is not None:
            check(inputs, params)
        if inputs.page_table is not None:
            table = inputs.page_table.long()
            k, v = (pool[table].flatten(1, 2) for pool in (inputs.k, inputs.v))
            inputs = dataclasses.replace(inputs, k=k, v=v, page_table=None)
            params = dataclasses.replace(params, kv_page_size=0)
        return run(inputs, params)
    monkeypatch.setattr(unfused, "run", spy)


def pages_of_the_batch(params):
    """Each sequence's pages, in batch order, and the pages of the longest."""
    manager = params.cache_manager
    pages = [manager.get_page_list(seq) for seq in params.sequences]
    return pages, math.ceil(max(params.sequences.values()) / manager.page_size)


@pytest.mark.parametrize("qkv_format", FORMATS)
def test_a_backend_that_reads_kv_pages_gets_the_pools_and_page_table(monkeypatch, qkv_format):
    params = make_params(qkv_format, True, page_size=4)
    manager, calls, asked = params.cache_manager, [], []

    def check(inputs, attn):
        b = params.batch_size
        pages, longest = pages_of_the_batch(params)
        assert attn.kv_page_size == 4 and attn.kv_format == "bshd"
        assert any(inputs.k is k and inputs.v is v for k, v in manager.cache.values())
        table = inputs.page_table
        assert table.dtype == torch.int32 and tuple(table.shape) == (b, longest)
        assert all(table[i, :len(p)].tolist() == p for i, p in enumerate(pages))
        assert attn.max_seqlen_kv == longest * 4 and attn.batch_size == b
        assert inputs.cu_seqlens_kv.tolist() == params.cu_seqlens_kv[:b + 1].tolist()
        calls.append(attn)

    spy_on_unfused(monkeypatch, check, reads_kv_pages=lambda attn: asked.append(attn) or True)
    check_schedule(qkv_format, True, rope_table(), params=params)
    assert len(calls) == len(SCHEDULE) * len(manager.cache)
    assert asked and all(attn.kv_page_size == 4 for attn in asked)


@pytest.mark.parametrize("reads_kv_pages", [None, lambda attn: False], ids=["absent", "false"])
def test_a_backend_that_does_not_read_kv_pages_gets_them_gathered(monkeypatch, reads_kv_pages):
    params = make_params("thd", True, page_size=4)
    manager, calls = params.cache_manager, []

    def check(inputs, attn):
        pages, longest = pages_of_the_batch(params)
        assert inputs.page_table is None and attn.kv_page_size == 0
        for t in (inputs.k, inputs.v):
            assert t.is_contiguous()
            assert tuple(t.shape) == (params.batch_size, longest * 4, GQA, HEAD_DIM)
        assert attn.max_seqlen_kv == longest * 4

        def sequences_in(pool):  # each sequence's pages of a pool, in order
            return [torch.cat([pool[page] for page in seq_pages]) for seq_pages in pages]
        # Row i starts with sequence i's pages (of one of the layers' caches).
        assert any(all(torch.equal(inputs.k[i, :len(seq)], seq)
                       for i, seq in enumerate(sequences_in(k_pool)))
                   for k_pool, _ in manager.cache.values())
        calls.append(attn)

    spy_on_unfused(monkeypatch, check, reads_kv_pages)
    check_schedule("thd", True, rope_table(), params=params)
    assert len(calls) == len(SCHEDULE) * len(manager.cache)


def test_page_pools_are_read_through_their_page_table_and_checked():
    pools = torch.zeros(6, 4, GQA, HEAD_DIM)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    assert layout.kv_seq_batch(pools, "bshd", table) == (8, 2)
    with pytest.raises(ValueError, match="page pools are bshd"):
        layout.kv_seq_batch(pools, "sbhd", table)
    with pytest.raises(TypeError, match="page_table must be an int32 tensor"):
        layout.kv_seq_batch(pools, "bshd", table.long())
    with pytest.raises(ValueError, match="stride 1 in its last dim"):
        layout.kv_seq_batch(pools, "bshd", table.t())
    q = torch.zeros(3, 5, HEADS, HEAD_DIM)  # bshd: 3 sequences, the table has 2 rows
    with pytest.raises(ValueError, match="query_layer batch 3 differs from page_table's rows"):
        layout.validate_qkv(q, pools, pools, "bshd", "bshd", HEADS, GQA, HEAD_DIM, HEAD_DIM, table)
    layout.validate_qkv(q[:2], pools, pools, "bshd", "bshd", HEADS, GQA, HEAD_DIM, HEAD_DIM,
                        table)
    q, cu_q = torch.zeros(3, HEADS, HEAD_DIM), torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    cu_kv = torch.tensor([0, 5, 8, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="page_table has 2 rows but the call has 3 sequences"):
        _sequence_lengths(q, pools, "thd", "bshd", "padding", None, cu_q, cu_kv, 1, 8, table)
    assert _sequence_lengths(q, pools, "thd", "bshd", "padding", None, cu_q[:3], cu_kv[:3], 1,
                             8, table)[3:] == (1, 8)


def test_inference_with_context_parallelism_is_refused_before_the_cache_changes(monkeypatch):
    monkeypatch.setattr(context_parallel, "size_and_rank", lambda group: (2, 0))
    dpa = make_dpa()
    params = make_params("bshd", True)
    params.allocate_memory(1)
    params.pre_step(OrderedDict({0: 3}))
    before = snapshot(params)
    with pytest.raises(ValueError, match="inference_params is not supported with context "
                                         "parallelism"):
        dpa(*qkv(1, 3), inference_params=params)
    assert_unchanged(before, params)


def test_cache_without_rope_and_with_a_sliding_window():
    check_schedule("bshd", False, None, window_size=(3, 0))


def test_padding_causal_mask_type_as_te_uses_it():
    check_schedule("thd", True, rope_table(), cache_args=dict(self_attn_mask_type="padding_causal"))


def tiny_lm(vocab=11, seed=0):
    torch.manual_seed(seed)
    embed = torch.nn.Embedding(vocab, HIDDEN)
    head = torch.nn.Linear(HIDDEN, vocab)
    return embed, make_stack("bshd", seed=seed), head


def test_greedy_generation_with_cache_equals_recomputing_the_prefix():
    """Two prompts of different lengths, greedy decoding: the tokens and logits with the
    cache equal those of running the whole prefix without a cache at every step."""
    embed, stack, head = tiny_lm()
    rope = rope_table()
    prompts = {0: [1, 5, 2, 7], 1: [3, 9]}
    new_tokens = 6

    def logits_of(tokens, **kwargs):
        with torch.no_grad():
            return head(torch.cat([run_stack_on(stack, embed(t), rope, **kwargs)
                                   for t in tokens]))

    # Without a cache: the whole prefix every step, each sequence alone.
    plain = {seq: list(p) for seq, p in prompts.items()}
    plain_logits = {seq: [] for seq in prompts}
    for _ in range(new_tokens):
        for seq, toks in plain.items():
            with torch.no_grad():
                h = run_stack_on(stack, embed(torch.tensor([toks])), rope)
                logits = head(h[0, -1])
            plain_logits[seq].append(logits)
            toks.append(int(logits.argmax()))

    # With the cache: prefill both prompts in one padded bshd batch, then one token a step.
    params = make_params("bshd", is_paged=False)
    cached = {seq: list(p) for seq, p in prompts.items()}
    step = OrderedDict((seq, len(p)) for seq, p in prompts.items())
    for i in range(new_tokens):
        params.pre_step(step)
        longest = max(step.values())
        batch = torch.zeros(len(step), longest, dtype=torch.long)
        for row, (seq, n) in enumerate(step.items()):
            batch[row, :n] = torch.tensor(cached[seq][-n:])
        with torch.no_grad():
            h = run_stack_on(stack, embed(batch), rope, inference_params=params)
        for row, (seq, n) in enumerate(step.items()):
            logits = head(h[row, n - 1])
            torch.testing.assert_close(logits, plain_logits[seq][i], atol=1e-5, rtol=1e-5)
            cached[seq].append(int(logits.argmax()))
        step = OrderedDict((seq, 1) for seq in prompts)
    assert cached == plain


def run_stack_on(stack, x, rope, **kwargs):
    for layer in stack:
        x = layer(x, rotary_pos_emb=rope, **kwargs)
    return x


def test_thd_accepts_the_steps_cu_seqlens_and_rejects_others():
    stack = make_stack("thd")
    params = make_params("thd", False)
    params.pre_step(OrderedDict({0: 3, 1: 2}))
    x = torch.randn(5, HIDDEN)
    good = torch.tensor([0, 3, 5], dtype=torch.int32)
    with torch.no_grad():
        stack[0](x, cu_seqlens_q=good, cu_seqlens_kv=good, inference_params=params)
        params.pre_step(OrderedDict({0: 1, 1: 1}))
        with pytest.raises(ValueError, match="cu_seqlens_q .* differs from the step's"):
            stack[0](x[:2], cu_seqlens_q=torch.tensor([0, 2, 2], dtype=torch.int32),
                     inference_params=params)


# --------------------------------------------------------------------------------------------
# DotProductAttention with a cache: in place, bottom-right causal
# --------------------------------------------------------------------------------------------
def make_dpa(layer_number=1, **kwargs):
    return tfa.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GQA, qkv_format="bshd",
                                   layer_number=layer_number, **kwargs)


def qkv(b, s, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, HEADS, HEAD_DIM, generator=gen),
            torch.randn(b, s, GQA, HEAD_DIM, generator=gen),
            torch.randn(b, s, GQA, HEAD_DIM, generator=gen))


def test_dpa_appends_in_place_and_attends_bottom_right():
    dpa = make_dpa()
    q, k, v = qkv(1, 7)
    params = make_params("bshd", False)
    params.allocate_memory(1)
    k_cache, v_cache = params.cache_manager.cache[1]
    pointers = (k_cache.data_ptr(), v_cache.data_ptr())
    params.pre_step(OrderedDict({0: 4}))
    first = dpa(q[:, :4], k[:, :4], v[:, :4], inference_params=params)
    params.pre_step(OrderedDict({0: 3}))  # a multi-token step: causal inside it too
    second = dpa(q[:, 4:], k[:, 4:], v[:, 4:], inference_params=params)
    torch.testing.assert_close(torch.cat([first, second], 1), dpa(q, k, v), atol=1e-6, rtol=0)
    assert (k_cache.data_ptr(), v_cache.data_ptr()) == pointers
    torch.testing.assert_close(k_cache[0, :7], k[0])
    torch.testing.assert_close(v_cache[0, :7], v[0])
    assert not k_cache[0, 7:].any()


def test_step_returns_te_values():
    params = make_params("sbhd", False)
    params.allocate_memory(3)
    params.pre_step(OrderedDict({"a": 2, "b": 1}))
    _, k, v = qkv(2, 2)
    k_cache, v_cache, cu_q, cu_kv, max_kv, fmt = params.step(3, k.transpose(0, 1),
                                                            v.transpose(0, 1), "sbhd")
    assert fmt == "sbhd_2bshd" and max_kv == MAX_SEQLEN
    assert cu_q.tolist() == [0, 2, 3] and cu_kv.tolist() == [0, 2, 3]
    assert k_cache.shape == (2, MAX_SEQLEN, GQA, HEAD_DIM)
    assert k_cache.data_ptr() == params.cache_manager.cache[3][0].data_ptr()  # a view
    torch.testing.assert_close(k_cache[1, :1], k[1, :1])
    torch.testing.assert_close(v_cache[0, :2], v[0])


# --------------------------------------------------------------------------------------------
# InferenceParams and the managers' bookkeeping
# --------------------------------------------------------------------------------------------
def test_pre_step_tracks_lengths_in_step_order():
    params = make_params("bshd", False)
    params.pre_step(OrderedDict({7: 5, 2: 3}))
    assert params.sequences == OrderedDict({7: 5, 2: 3})
    assert params.sequences_pre_step == OrderedDict({7: 0, 2: 0})
    params.pre_step(OrderedDict({2: 2, 9: 4}))  # 7 leaves, 2 continues by 2, 9 joins
    assert params.batch_size == 2 and params.max_seqlen_q == 4
    assert list(params.sequences.items()) == [(2, 5), (9, 4)]
    assert params.sequences_pre_step == OrderedDict({2: 3, 9: 0})
    assert params.get_seqlens_pre_step().tolist() == [3, 0, 0]
    assert params.cu_seqlens_q.tolist() == [0, 2, 6, 6]
    assert params.cu_seqlens_kv.tolist() == [0, 5, 9, 9]


def test_paged_pages_follow_the_sequences():
    params = make_params("bshd", True, page_size=4, total_num_pages=6, max_batch_size=2)
    manager = params.cache_manager
    params.pre_step(OrderedDict({0: 5, 1: 4}))  # 2 pages and 1 page
    assert manager.get_page_list(0) == [0, 1] and manager.get_page_list(1) == [2]
    assert manager.free_pages == [3, 4, 5]
    params.pre_step(OrderedDict({0: 1, 1: 1}))  # 0 fits in its page, 1 needs a second
    assert manager.get_page_count(0) == 2 and manager.get_page_list(1) == [2, 3]
    assert params.cache_manager.page_table[:2, :2].tolist() == [[0, 1], [2, 3]]
    params.pre_step(OrderedDict({1: 1, 2: 9}))  # 0 leaves: its pages go back to the pool
    assert manager.get_sequence_lengths() == [6, 9]
    assert manager.get_page_list(2) == [4, 5, 0]
    assert sorted(manager.free_pages) == [1]
    assert manager.page_table[:2, :3].tolist() == [[2, 3, 0], [4, 5, 0]]
    manager.deallocate_sequence(1)
    assert sorted(manager.free_pages) == [1, 2, 3]
    with pytest.raises(KeyError, match="holds no pages"):
        manager.deallocate_sequence(1)
    params.reset()
    assert params.sequences == OrderedDict() and params.batch_size == 0
    assert manager.free_pages == list(range(6)) and not manager.page_table.any()
    assert manager.sequences == OrderedDict()


def test_reset_keeps_the_memory_and_starts_over():
    params = make_params("bshd", False)
    params.allocate_memory(1)
    cache = params.cache_manager.cache[1][0]
    params.pre_step(OrderedDict({0: 3}))
    params.reset()
    assert params.cache_manager.cache[1][0] is cache
    params.pre_step(OrderedDict({0: 2}))
    assert params.sequences == OrderedDict({0: 2})  # a new sequence, not 3 + 2


def test_convert_paged_to_nonpaged_equals_the_contiguous_cache():
    layers = {}
    for paged in (False, True):
        params = make_params("bshd", paged, page_size=4)
        stack = make_stack("bshd")
        inputs = sequence_inputs(SCHEDULE)
        for _ in run_schedule(stack, params, inputs, "bshd", rope_table()):
            pass
        layers[paged] = params
    contiguous, paged = layers[False], layers[True]
    k_paged, v_paged = paged.convert_paged_to_nonpaged(2)
    assert k_paged.shape == (paged.batch_size, MAX_SEQLEN, GQA, HEAD_DIM)
    for i, n in enumerate(paged.sequences.values()):
        torch.testing.assert_close(k_paged[i, :n], contiguous.cache_manager.cache[2][0][i, :n])
        torch.testing.assert_close(v_paged[i, :n], contiguous.cache_manager.cache[2][1][i, :n])
    with pytest.raises(ValueError, match="needs a paged cache"):
        contiguous.convert_paged_to_nonpaged(2)


def test_custom_cache_manager_is_built_with_te_arguments():
    class Recording(inference.NonPagedKVCacheManager):
        pass

    params = tfa.InferenceParams(2, 8, 1, 4, torch.float32, custom_cache_manager=Recording,
                                 device="cpu")
    assert type(params.cache_manager) is Recording
    assert params.cache_manager.max_seqlen == 8 and params.cache_manager.num_heads == 1
    with pytest.raises(TypeError, match="custom_cache_manager must be a KVCacheManager"):
        tfa.InferenceParams(2, 8, 1, 4, torch.float32, custom_cache_manager=dict)


def test_exports_follow_te():
    assert tfa.InferenceParams is tfa.attention.InferenceParams is inference.InferenceParams
    assert inference.__all__ == ["InferenceParams", "KVCacheManager", "NonPagedKVCacheManager",
                                 "PagedKVCacheManager"]


# --------------------------------------------------------------------------------------------
# Bad input: a clear error before anything changes
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(num_heads_kv=None), ValueError, "num_heads_kv, head_dim_k and dtype are required"),
    (dict(qkv_format="bhsd"), ValueError, "qkv_format must be one of"),
    (dict(qkv_format="thd", max_ctx_len=None), ValueError, "max_ctx_len is required"),
    (dict(max_ctx_len=99), ValueError, "max_ctx_len must be an int in 1..max_sequence_length"),
    (dict(is_paged=True, page_size=5, total_num_pages=4), ValueError, "multiple of page_size"),
    (dict(is_paged=True, page_size=4), ValueError, "needs page_size and total_num_pages"),
    (dict(max_batch_size=0), ValueError, "max_batch_size must be a positive int"),
    (dict(dtype=torch.int32), TypeError, "dtype must be a floating point"),
])
def test_bad_construction(kwargs, error, match):
    args = dict(max_batch_size=2, max_sequence_length=8, num_heads_kv=1, head_dim_k=4,
                dtype=torch.float32, device="cpu")
    args.update(kwargs)
    with pytest.raises(error, match=match):
        tfa.InferenceParams(**args)


def snapshot(params):
    manager = params.cache_manager
    return (dict(params.sequences), params.cu_seqlens_kv.clone(),
            [t.clone() for pair in manager.cache.values() for t in pair],
            list(getattr(manager, "free_pages", [])))


def assert_unchanged(before, params):
    after = snapshot(params)
    assert before[0] == after[0] and torch.equal(before[1], after[1]) and before[3] == after[3]
    assert all(torch.equal(a, b) for a, b in zip(before[2], after[2]))


@pytest.mark.parametrize("step,error,match", [
    ({0: 30}, ValueError, "would hold 34 tokens after this step, more than max_sequence_length"),
    ({0: 1, 1: 1, 2: 1, 3: 1}, ValueError, "4 sequences, more than max_batch_size=3"),
    ({0: 0}, ValueError, r"step_dict\[0\] must be a positive int"),
    ({0: True}, ValueError, r"step_dict\[0\] must be a positive int"),
    ([(0, 1)], TypeError, "step_dict must be an OrderedDict"),
])
@pytest.mark.parametrize("is_paged", [False, True], ids=["contiguous", "paged"])
def test_bad_pre_step_leaves_the_cache_unchanged(step, error, match, is_paged):
    params = make_params("bshd", is_paged)
    params.allocate_memory(1)
    params.pre_step(OrderedDict({0: 4}))
    before = snapshot(params)
    with pytest.raises(error, match=match):
        params.pre_step(OrderedDict(step) if isinstance(step, dict) else step)
    assert_unchanged(before, params)


def test_running_out_of_pages_leaves_the_cache_unchanged():
    params = make_params("bshd", True, page_size=4, total_num_pages=3, max_batch_size=2)
    params.pre_step(OrderedDict({0: 8}))
    before = snapshot(params)
    with pytest.raises(ValueError, match="needs 3 new pages but only 1 of total_num_pages=3"):
        params.pre_step(OrderedDict({0: 1, 1: 5}))
    assert_unchanged(before, params)
    params.pre_step(OrderedDict({1: 5}))  # 0 leaving frees its pages
    assert params.cache_manager.get_page_count(1) == 2


@pytest.mark.parametrize("change,error,match", [
    (lambda q, k, v: (q, k.double(), v.double()), TypeError, "dtype"),
    (lambda q, k, v: (q, k[:, :, :1], v[:, :, :1]), ValueError, "heads"),
    (lambda q, k, v: (q[:1], k[:1], v[:1]), ValueError, "batch 2"),
    (lambda q, k, v: (q[:, :2], k[:, :2], v[:, :2]), ValueError, "at least 3 tokens"),
    (lambda q, k, v: (q, k, v[..., :2]), ValueError, "head dim"),
])
def test_bad_new_tokens_leave_the_cache_unchanged(change, error, match):
    dpa = make_dpa()
    params = make_params("bshd", False)
    params.allocate_memory(1)
    params.pre_step(OrderedDict({0: 3, 1: 1}))
    dpa(*qkv(2, 3), inference_params=params)
    params.pre_step(OrderedDict({0: 3, 1: 1}))
    before = snapshot(params)
    with pytest.raises(error, match=match):
        dpa(*change(*qkv(2, 3, seed=1)), inference_params=params)
    assert_unchanged(before, params)


def test_bad_module_use_is_named():
    params = make_params("bshd", False)
    params.pre_step(OrderedDict({0: 2}))
    q, k, v = qkv(1, 2)
    with pytest.raises(ValueError, match="layer_number=1 has no KV cache: call allocate_memory"):
        make_dpa()(q, k, v, inference_params=params)
    params.allocate_memory(1)
    with pytest.raises(ValueError, match="needs the module's layer_number"):
        tfa.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GQA, qkv_format="bshd")(
            q, k, v, inference_params=params)
    make_dpa()(q, k, v, inference_params=params)
    with pytest.raises(ValueError, match="layer_number=1 is used by two attention modules"):
        make_dpa()(q, k, v, inference_params=params)
    other = make_dpa(layer_number=2)
    params.allocate_memory(2)
    with pytest.raises(ValueError, match="'arbitrary' is not supported with inference_params"):
        other(q, k, v, attn_mask_type="arbitrary", inference_params=params)
    with pytest.raises(ValueError, match="post_scale_bias.*not supported with inference_params"):
        other(q, k, v, core_attention_bias_type="post_scale_bias",
              core_attention_bias=torch.zeros(1, 1, 2, 2), inference_params=params)
    with pytest.raises(ValueError, match="self attention only"):
        tfa.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GQA, qkv_format="bshd",
                                layer_number=3, attention_type="cross")(
            q, k, v, inference_params=params)
    with pytest.raises(ValueError, match="qkv_format must be one of"):
        params.step(2, k, v, "bhsd")


def test_rope_table_too_short_is_named():
    stack = make_stack("bshd")
    params = make_params("bshd", False)
    params.pre_step(OrderedDict({0: 6}))
    short = tfa.RotaryPositionEmbedding(HEAD_DIM)(4)
    with pytest.raises(ValueError, match="rotary_pos_emb covers 4 positions but a sequence "
                                         "reaches 6"):
        stack[0](torch.randn(1, 6, HIDDEN), rotary_pos_emb=short, inference_params=params)


def test_generate_example_matches_recomputation():
    """examples/generate.py: the cached generation equals recomputing every prefix."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "examples" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    seqs, err = example.main(["--paged", "--qkv-format", "thd", "--train-steps", "2",
                              "--new-tokens", "3"])
    assert len(seqs) == 3 and all(len(s) >= 5 for s in seqs.values()) and err < 1e-4
