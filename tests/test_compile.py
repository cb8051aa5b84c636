"""torch.compile: one compiled module serves a family of shapes, matches eager, forward and
backward, with no graph break (fullgraph=True).

Shapes change in batch and sequence length (never to 1: torch.compile specializes sizes 0 and
1). Dynamo's ``unique_graphs`` counter counts the graphs compiled: with ``dynamic=True`` the
whole family compiles once; without it, the first shape compiles static and the second
recompiles with dynamic sizes that the third reuses (automatic dynamic shapes).

The backend "eager" runs the captured graph with ordinary autograd (fast to compile: most tests
use it); "aot_eager" also traces the backward graph, as inductor does (slower: one layer case
and the RoPE bounds tests use it).
"""
import pytest
import torch
from torch._dynamo.utils import counters

import transformer_fa as tfa
from transformer_fa.attention import selection
from transformer_fa.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

HIDDEN, FFN, HEADS, GROUPS = 16, 24, 4, 2
HEAD_DIM = HIDDEN // HEADS
# (batch, sequence length). No size equals a fixed one (heads, groups, head dim) at the first
# trace: dynamo gives equal sizes one symbol ("duck shaping"), so the check of the group count
# would pin the batch size too and cost a recompile.
SHAPES = [(5, 7), (6, 9), (7, 3)]
ATOL = RTOL = 1e-5
# dynamic=True: one compile; None (automatic dynamic): static first, then one dynamic recompile.
EXPECTED_COMPILES = {True: 1, None: 2}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compiled(module, dynamic, backend="eager"):
    return torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)


def graphs_compiled():
    return counters["stats"]["unique_graphs"]


def packed_lengths(batch, seqlen):
    """cu_seqlens of ragged sequences of seqlen, seqlen - 1, ... tokens (at least 1)."""
    lengths = (seqlen - torch.arange(batch)).clamp(min=1)
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def layer_inputs(fmt, batch, seqlen, generator):
    """(hidden_states, forward kwargs) for a TransformerLayer in fmt."""
    if fmt == "thd":
        cu = packed_lengths(batch, seqlen)
        x = torch.randn(int(cu[-1]), HIDDEN, generator=generator)
        return x, dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seqlen,
                       max_seqlen_kv=seqlen)
    shape = (batch, seqlen, HIDDEN) if fmt == "bshd" else (seqlen, batch, HIDDEN)
    return torch.randn(*shape, generator=generator), {}


def outputs_and_grads(module, inputs, kwargs, params):
    """The output and the gradients of a fixed random loss w.r.t. inputs and params."""
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = module(*inputs, **kwargs)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    grads = torch.autograd.grad((out * weight).sum(), inputs + params)
    return out, grads


def assert_matches_eager(module, fn, inputs, kwargs):
    params = list(module.parameters())
    out, grads = outputs_and_grads(fn, inputs, kwargs, params)
    out_ref, grads_ref = outputs_and_grads(module, inputs, kwargs, params)
    torch.testing.assert_close(out, out_ref, atol=ATOL, rtol=RTOL)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, atol=ATOL, rtol=RTOL)


# Every format with and without RoPE under dynamic=True; automatic dynamic shapes with RoPE;
# one case through aot_eager (compile time on 2 CPU cores is what limits this list).
LAYER_CASES = [
    pytest.param(fmt, rope, True, "eager", id=f"{fmt}-{'rope' if rope else 'no_rope'}-dynamic")
    for fmt in ("bshd", "sbhd", "thd") for rope in (False, True)
] + [
    pytest.param(fmt, True, None, "eager", id=f"{fmt}-rope-automatic_dynamic")
    for fmt in ("bshd", "sbhd", "thd")
] + [pytest.param("thd", True, True, "aot_eager", id="thd-rope-dynamic-aot_eager")]


@pytest.mark.parametrize("fmt, rope, dynamic, backend", LAYER_CASES)
def test_transformer_layer_compiles_once_for_a_family_of_shapes(fmt, rope, dynamic, backend):
    torch.manual_seed(0)
    layer = tfa.TransformerLayer(
        HIDDEN, FFN, HEADS, num_gqa_groups=GROUPS, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", activation="swiglu", attn_input_format=fmt, device="cpu")
    freqs = RotaryPositionEmbedding(HEAD_DIM)(max(s for _, s in SHAPES)).cpu()
    fn = compiled(layer, dynamic, backend)
    generator = torch.Generator().manual_seed(0)
    for batch, seqlen in SHAPES:
        x, kwargs = layer_inputs(fmt, batch, seqlen, generator)
        if rope:
            kwargs["rotary_pos_emb"] = freqs
        assert_matches_eager(layer, fn, [x], kwargs)
    assert graphs_compiled() == EXPECTED_COMPILES[dynamic]


def attention_inputs(fmt, batch, seqlen, generator):
    """(q, k, v, forward kwargs) for DotProductAttention in fmt (GQA: fewer K/V heads)."""
    if fmt == "thd":
        cu = packed_lengths(batch, seqlen)
        lead = (int(cu[-1]),)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=seqlen,
                      max_seqlen_kv=seqlen)
    else:
        lead = (batch, seqlen) if fmt == "bshd" else (seqlen, batch)
        kwargs = {}
    q = torch.randn(*lead, HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(*lead, GROUPS, HEAD_DIM, generator=generator) for _ in range(2))
    return q, k, v, kwargs


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic_dynamic"])
@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
def test_dot_product_attention_compiles_once_for_a_family_of_shapes(fmt, dynamic):
    dpa = tfa.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GROUPS, qkv_format=fmt,
                                  attn_mask_type="causal")
    fn = compiled(dpa, dynamic)
    generator = torch.Generator().manual_seed(0)
    for batch, seqlen in SHAPES:
        q, k, v, kwargs = attention_inputs(fmt, batch, seqlen, generator)
        assert_matches_eager(dpa, fn, [q, k, v], kwargs)
    assert graphs_compiled() == EXPECTED_COMPILES[dynamic]
    assert dpa.last_backend == "UnfusedDotProductAttention"


def test_padding_mask_compiles_once_for_a_family_of_shapes():
    dpa = tfa.DotProductAttention(HEADS, HEAD_DIM, qkv_format="bshd", attn_mask_type="padding")
    fn = compiled(dpa, True)
    generator = torch.Generator().manual_seed(0)
    for batch, seqlen in SHAPES:
        q, k, v = (torch.randn(batch, seqlen, HEADS, HEAD_DIM, generator=generator)
                   for _ in range(3))
        lengths = torch.randint(1, seqlen + 1, (batch, 1, 1, 1), generator=generator)
        mask = torch.arange(seqlen).view(1, 1, 1, -1) >= lengths  # right-padded
        assert_matches_eager(dpa, fn, [q, k, v], dict(attention_mask=mask))
    assert graphs_compiled() == 1


def test_float_settings_are_guarded_under_dynamic():
    """dynamic=True makes float attributes symbolic; the selection guards on them, so a new
    softmax_scale recompiles and is used, rather than baked in or failing to trace."""
    dpa = tfa.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GROUPS, qkv_format="bshd")
    fn = compiled(dpa, True)
    q, k, v, _ = attention_inputs("bshd", 2, 5, torch.Generator().manual_seed(0))
    torch.testing.assert_close(fn(q, k, v), dpa(q, k, v))
    dpa.softmax_scale = 0.05
    torch.testing.assert_close(fn(q, k, v), dpa(q, k, v))
    assert graphs_compiled() == 2


def test_backend_decided_once_per_trace(monkeypatch):
    """Under dynamic=True the decision is made at trace time for the traced shape only."""
    decisions = []
    decide = selection._decide
    monkeypatch.setattr(selection, "_decide", lambda *a: decisions.append(a[0]) or decide(*a))
    dpa = tfa.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GROUPS, qkv_format="bshd")
    fn = compiled(dpa, True)
    generator = torch.Generator().manual_seed(0)
    for batch, seqlen in SHAPES:
        q, k, v, _ = attention_inputs("bshd", batch, seqlen, generator)
        fn(q, k, v)
    # With a guard-free hint (torch 2.13+) the traced shape; without, the representative size.
    size = selection._REPRESENTATIVE_SIZE
    expected = SHAPES[0] if selection._hint is not None else (size, size)
    assert [(p.batch_size, p.max_seqlen_q) for p in decisions] == [expected]


def test_thd_without_max_seqlen_under_compile_names_the_argument():
    dpa = tfa.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GROUPS, qkv_format="thd")
    q, k, v, kwargs = attention_inputs("thd", 2, 5, torch.Generator().manual_seed(0))
    del kwargs["max_seqlen_q"], kwargs["max_seqlen_kv"]
    fn = compiled(dpa, True)
    with pytest.raises(Exception, match="max_seqlen_q must be given for the thd format"):
        fn(q, k, v, **kwargs)


# The RoPE position range check reads positions on the host: eager raises a ValueError before
# any math; under compile the table lookup's bounds check raises instead (never a wrong result).
def test_rope_thd_positions_past_the_table_raise_in_eager_and_compiled():
    freqs = RotaryPositionEmbedding(HEAD_DIM)(4).cpu()
    t = torch.randn(7, HEADS, HEAD_DIM)
    cu = torch.tensor([0, 2, 7], dtype=torch.int32)  # a sequence of 5 tokens, 4 positions
    with pytest.raises(ValueError, match="a sequence is longer than the 4 positions"):
        apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu)
    fn = torch.compile(apply_rotary_pos_emb, backend="aot_eager", fullgraph=True, dynamic=True)
    with pytest.raises((IndexError, RuntimeError), match="out of bounds|out of range"):
        fn(t, freqs, "thd", cu_seqlens=cu)
    cu_ok = torch.tensor([0, 3, 7], dtype=torch.int32)
    torch.testing.assert_close(fn(t, freqs, "thd", cu_seqlens=cu_ok),
                               apply_rotary_pos_emb(t, freqs, "thd", cu_seqlens=cu_ok))


def test_rope_start_positions_past_the_table_raise_in_eager_and_compiled():
    freqs = RotaryPositionEmbedding(HEAD_DIM)(6).cpu()
    t = torch.randn(2, 4, HEADS, HEAD_DIM)
    start = torch.tensor([0, 3])  # 3 + 4 tokens need 7 positions
    with pytest.raises(ValueError, match="start_positions \\+ sequence length exceed the 6"):
        apply_rotary_pos_emb(t, freqs, "bshd", start_positions=start)
    fn = torch.compile(apply_rotary_pos_emb, backend="aot_eager", fullgraph=True, dynamic=True)
    with pytest.raises((IndexError, RuntimeError), match="out of bounds|out of range"):
        fn(t, freqs, "bshd", start_positions=start)
    start_ok = torch.tensor([0, 2])
    torch.testing.assert_close(fn(t, freqs, "bshd", start_positions=start_ok),
                               apply_rotary_pos_emb(t, freqs, "bshd", start_positions=start_ok))


def test_compile_matches_eager_single_call():
    dpa = tfa.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="causal")
    q, k, v = (torch.randn(2, 6, 2, 8, requires_grad=True) for _ in range(3))
    out = torch.compile(dpa, backend="eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(out, dpa(q, k, v))
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_compile_with_packed_views_copies_and_stays_right():
    dpa = tfa.DotProductAttention(2, 8, attn_mask_type="no_mask")
    qkv_buf = torch.randn(6, 2, 3, 2, 8)
    q, k, v = qkv_buf.unbind(2)
    out = torch.compile(dpa, backend="eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(out, dpa(q, k, v))


def test_dynamic_shapes_without_a_guard_free_hint(monkeypatch):
    """Older torch (no optimization_hint): the decision is made for a representative size, and
    a family of shapes still runs through one graph, matching eager."""
    monkeypatch.setattr(selection, "_hint", None)
    selection.clear_cache()
    dpa = tfa.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GROUPS, qkv_format="bshd")
    torch._dynamo.reset()
    fn = compiled(dpa, True)
    generator = torch.Generator().manual_seed(0)
    for batch, seqlen in SHAPES:
        q, k, v, _ = attention_inputs("bshd", batch, seqlen, generator)
        torch.testing.assert_close(fn(q, k, v), dpa(q, k, v))
