"""TE's API surface as TE code uses it (`import transformer_fa as te`): arguments TE passes,
TE's semantics, decoder lengths, and our own errors where torch's would come out."""
import warnings

import pytest
import torch

import module_reference as ref
import transformer_fa as te
from reference import attention_one
from transformer_fa.common.recipe import DelayedScaling, Float8CurrentScaling, Format

H, FFN, HEADS, D = 16, 32, 2, 8


def layer(**kwargs):
    args = dict(hidden_dropout=0.0, attention_dropout=0.0, device="cpu")
    args.update(kwargs)
    return ref.randomize(te.TransformerLayer(H, FFN, HEADS, **args))


def cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


def padding_mask(lengths, s):
    return (torch.arange(s).view(1, -1) >= torch.tensor(lengths).view(-1, 1)).view(-1, 1, 1, s)


# ---------------------------------------------------------------------------- A: arguments
def test_dot_product_attention_takes_te_init_arguments():
    dpa = te.DotProductAttention(HEADS, D, attention_dropout=0.0, qkv_format="bshd",
                                 attn_mask_type="causal", window_size=None,
                                 bottom_right_diagonal=None, sequence_parallel=False, tp_size=1,
                                 get_rng_state_tracker=None, tp_group=None, layer_number=1,
                                 attention_type="self", cp_group=None, cp_global_ranks=None,
                                 cp_stream=None, cp_comm_type="p2p", softmax_scale=None,
                                 name="attn")
    q = torch.randn(2, 5, HEADS, D)
    assert dpa(q, q, q).shape == (2, 5, HEADS * D)
    # TE's tensor parallelism: global head counts, this rank attends its share (of 2)
    assert te.DotProductAttention(HEADS, D, tp_size=2).num_attention_heads == HEADS // 2
    with pytest.raises(TypeError, match="cp_group must be a torch.distributed ProcessGroup"):
        te.DotProductAttention(HEADS, D, cp_group=object())


def test_dot_product_attention_forward_te_arguments():
    dpa = te.DotProductAttention(HEADS, D, qkv_format="thd", attn_mask_type="padding")
    q = torch.randn(7, HEADS, D)
    c = cu([3, 4])
    out = dpa(q, q, q, cu_seqlens_q=c, cu_seqlens_kv=c)
    same = dpa(q, q, q, cu_seqlens_q=c, cu_seqlens_kv=c, cu_seqlens_q_padded=c.clone(),
               cu_seqlens_kv_padded=c, fast_zero_fill=False, pad_between_seqs=False,
               fp8_output=False, inference_params=None)
    torch.testing.assert_close(same, out)
    with pytest.raises(ValueError, match="cu_seqlens_q_padded ends at 8 but the tensor has only 7"):
        dpa(q, q, q, cu_seqlens_q=c, cu_seqlens_kv=c, cu_seqlens_q_padded=cu([4, 4]))
    with pytest.raises(ValueError, match="slot at least as long as its length"):
        dpa(q, q, q, cu_seqlens_q=c, cu_seqlens_kv=c, cu_seqlens_q_padded=cu([2, 4]))
    # Without padded offsets there are no gaps: pad_between_seqs=True changes nothing (TE).
    torch.testing.assert_close(
        dpa(q, q, q, cu_seqlens_q=c, cu_seqlens_kv=c, pad_between_seqs=True), out)
    with pytest.raises(ValueError, match="fp8_output=True.*FP8"):
        dpa(q, q, q, cu_seqlens_q=c, cu_seqlens_kv=c, fp8_output=True)
    with pytest.raises(TypeError, match="inference_params must be a transformer_fa.InferenceParams"):
        dpa(q, q, q, cu_seqlens_q=c, cu_seqlens_kv=c, inference_params=object())


def test_checkpoint_core_attention_recomputes_attention_in_backward():
    torch.manual_seed(0)
    dpa = te.DotProductAttention(HEADS, D, qkv_format="bshd")
    q, k, v = (torch.randn(2, 5, HEADS, D, requires_grad=True) for _ in range(3))
    out = dpa(q, k, v, checkpoint_core_attention=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(dpa(q, k, v).square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_checkpoint_core_attention_saves_no_attention_activations():
    dpa = te.DotProductAttention(HEADS, D, qkv_format="bshd")
    q = torch.randn(1, 16, HEADS, D, requires_grad=True)

    def saved_bytes(**kwargs):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: sizes.append(t.numel()) or t, lambda t: t):
            dpa(q, q, q, **kwargs)
        return sum(sizes)

    assert saved_bytes(checkpoint_core_attention=True) < saved_bytes()


def test_transformer_layer_takes_te_arguments():
    common = dict(bottom_right_diagonal=None, enc_dec_bottom_right_diagonal=None, tp_group=None,
                  tp_size=1, get_rng_state_tracker=None, fuse_wgrad_accumulation=False,
                  seq_length=6, micro_batch_size=2, sequence_parallel=False,
                  set_parallel_mode=False, ub_tp_comm_overlap=False, ub_overlap_ag=True,
                  ub_overlap_rs=True, ub_overlap_rs_dgrad=False, ub_bulk_dgrad=True,
                  ub_bulk_wgrad=True, activation_params=None, name="layer",
                  rotary_pos_interleaved=False, qk_norm_type=None, qk_norm_eps=1e-6,
                  qk_norm_before_rope=False, softmax_type="vanilla")
    x = torch.randn(6, 2, H)
    assert layer(**common)(x).shape == x.shape


def test_transformer_layer_passes_attention_options_through():
    torch.manual_seed(0)
    base = layer(self_attn_mask_type="no_mask")
    for option in (dict(qk_norm_type="RMSNorm"), dict(rotary_pos_interleaved=True)):
        other = layer(self_attn_mask_type="no_mask", **option)
        other.load_state_dict(base.state_dict(), strict=False)
        mha = other.self_attention
        if "qk_norm_type" in option:
            assert mha.q_norm is not None and mha.k_norm is not None
        else:
            assert mha.rotary_pos_interleaved
            x = torch.randn(6, 2, H)
            emb = te.RotaryPositionEmbedding(H // HEADS).to("cpu")(6)  # TE's default: CUDA
            assert not torch.allclose(other(x, rotary_pos_emb=emb), base(x, rotary_pos_emb=emb))


def test_softmax_type_vanilla_is_accepted_and_others_reach_dot_product_attention():
    assert layer(softmax_type="vanilla")(torch.randn(3, 1, H)).shape == (3, 1, H)
    mha = te.MultiheadAttention(H, HEADS, softmax_type="off-by-one", device="cpu")
    assert mha.core_attention.softmax_type == "off-by-one"
    tl = te.TransformerLayer(H, 2 * H, HEADS, softmax_type="learnable", device="cpu")
    assert tl.self_attention.core_attention.softmax_offset.requires_grad


def test_clamped_swiglu_activation_params():
    torch.manual_seed(0)
    params = {"limit": 0.5, "alpha": 2.0, "glu_linear_offset": 0.25}
    mlp = ref.randomize(te.LayerNormMLP(H, FFN, activation="clamped_swiglu",
                                        activation_params=params, device="cpu"), scale=1.0)
    x = torch.randn(4, H)
    a, b = torch.nn.functional.linear(ref._norm_of(mlp, x), mlp.fc1_weight,
                                      mlp.fc1_bias).chunk(2, -1)
    a = torch.minimum(a, torch.tensor(0.5))
    hidden = a / (1 + torch.exp(-2.0 * a)) * (b.clamp(-0.5, 0.5) + 0.25)
    torch.testing.assert_close(mlp(x), hidden @ mlp.fc2_weight.T + mlp.fc2_bias)
    default = te.LayerNormMLP(H, FFN, activation="clamped_swiglu", device="cpu")
    default.load_state_dict(mlp.state_dict())
    assert not torch.allclose(default(x), mlp(x))  # TE's defaults: limit 7, alpha 1.702
    with pytest.raises(ValueError, match="activation_params.*'gelu'"):
        te.LayerNormMLP(H, FFN, activation="gelu", activation_params={"limit": 1.0},
                        device="cpu")
    with pytest.raises(ValueError, match="beta"):
        te.LayerNormMLP(H, FFN, activation="clamped_swiglu", activation_params={"beta": 1.0},
                        device="cpu")
    assert layer(activation="clamped_swiglu", activation_params=params).layernorm_mlp \
        .activation_params == params


@pytest.mark.parametrize("alias", ["padding,causal", "causal,padding"])
def test_mask_type_aliases(alias):
    torch.manual_seed(0)
    q = torch.randn(2, 5, HEADS, D)
    mask = padding_mask([3, 5], 5)
    want = te.DotProductAttention(HEADS, D, qkv_format="bshd",
                                  attn_mask_type="padding_causal")(q, q, q, mask)
    dpa = te.DotProductAttention(HEADS, D, qkv_format="bshd", attn_mask_type=alias)
    assert dpa.attn_mask_type == "padding_causal"
    torch.testing.assert_close(dpa(q, q, q, mask), want)
    torch.testing.assert_close(
        te.DotProductAttention(HEADS, D, qkv_format="bshd")(q, q, q, mask,
                                                            attn_mask_type=alias), want)
    base = layer(self_attn_mask_type="padding_causal", attn_input_format="bshd")
    x = torch.randn(2, 5, H)
    for other in (layer(self_attn_mask_type=alias, attn_input_format="bshd"),
                  te.MultiheadAttention(H, HEADS, attn_mask_type=alias, qkv_format="bshd",
                                        device="cpu")):
        assert getattr(other, "self_attn_mask_type", getattr(other, "attn_mask_type", None)) \
            == "padding_causal"
    torch.testing.assert_close(base(x, mask, self_attn_mask_type=alias), base(x, mask))


def test_module_level_fp8_names():
    if torch.cuda.is_available():
        pytest.skip("checks the answers without CUDA")
    assert te.is_fp8_available() is False
    available, reason = te.is_fp8_available(return_reason=True)
    assert not available and "compute capability 8.9" in reason
    x = torch.randn(3, 1, H)
    lyr = layer()
    with pytest.deprecated_call():  # the older names still work, as TE's do
        with te.fp8_autocast(enabled=False, calibrating=False, fp8_recipe=None, fp8_group=None):
            with te.autocast(enabled=False, recipe=None, amax_reduction_group=None):
                with te.fp8_model_init(enabled=False):
                    assert lyr(x).shape == x.shape
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                            amax_compute_algo="max")
    assert recipe.margin == 0 and Float8CurrentScaling().fp8_format is Format.HYBRID
    for manager in (lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe),
                    lambda: te.autocast(recipe=recipe)):
        with pytest.raises(ValueError, match="FP8 needs a CUDA GPU"), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (test_older_fp8_names_warn...)
            with manager():
                pass
    with pytest.raises(ValueError, match="E5M2"):
        DelayedScaling(fp8_format=Format.E5M2)


def test_checkpoint_function_has_te_signature_and_recomputes():
    lin = te.Linear(H, H, device="cpu")
    x = torch.randn(4, H, requires_grad=True)
    calls = []

    def block(t, scale=1.0):
        calls.append(1)
        return (lin(t) * scale).sin()

    out = te.checkpoint(block, x, scale=2.0, distribute_saved_activations=False,
                        get_rng_state_tracker=None, tp_group=None, use_reentrant=False)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert len(calls) == 2  # forward, then the recomputation in the backward
    (want,) = torch.autograd.grad(block(x, scale=2.0).sum(), x)
    torch.testing.assert_close(grad, want)
    with pytest.raises(ValueError, match="distribute_saved_activations"):
        te.checkpoint(lin, x, distribute_saved_activations=True)


def test_checkpoint_with_rng_tracker_recomputes_the_same_dropout():
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 123)
    x = torch.randn(64, device=TRACKED, requires_grad=True)

    def drop(t):
        with tracker.fork():
            return torch.nn.functional.dropout(t, 0.5)

    out = te.checkpoint(drop, x, get_rng_state_tracker=lambda: tracker, use_reentrant=False)
    out.sum().backward()
    torch.testing.assert_close(x.grad, (out != 0).float() * 2)  # the forward's mask


# The tracker tracks the CUDA generator where there is one (TE's), else the CPU one.
TRACKED = "cuda" if torch.cuda.is_available() else "cpu"


def tracked_rng_state():
    return torch.cuda.get_rng_state() if TRACKED == "cuda" else torch.get_rng_state()


def test_rng_states_tracker():
    tracker = te.CudaRNGStatesTracker()
    tracker.add("a", 7)
    before = tracked_rng_state()
    with tracker.fork("a"):
        first = torch.rand(4, device=TRACKED)
    with tracker.fork("a"):
        second = torch.rand(4, device=TRACKED)
    assert torch.equal(tracked_rng_state(), before)  # the default generator is untouched
    assert not torch.equal(first, second)  # the tracked state advanced
    other = te.CudaRNGStatesTracker()
    other.set_states({"a": tracker.get_states()["a"]})
    with other.fork("a"), tracker.fork("a"):
        pass
    fresh = te.CudaRNGStatesTracker()
    fresh.add("a", 7)
    with fresh.fork("a"):
        torch.testing.assert_close(torch.rand(4, device=TRACKED), first)
    with pytest.raises(RuntimeError, match="seed 7 already exists"):
        fresh.add("b", 7)
    with pytest.raises(KeyError, match="not added"):
        with fresh.fork("missing"):
            pass
    fresh.reset()
    assert fresh.get_states() == {}


def test_dropout_draws_from_the_rng_tracker():
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 99)
    dpa = te.DotProductAttention(HEADS, D, attention_dropout=0.5, qkv_format="bshd",
                                 get_rng_state_tracker=lambda: tracker)
    q = torch.randn(1, 6, HEADS, D, device=TRACKED)
    before = tracked_rng_state()
    dpa(q, q, q)
    assert torch.equal(tracked_rng_state(), before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_make_graphed_callables():
    lin = te.Linear(H, H, device="cpu")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        te.make_graphed_callables(lin, (torch.randn(2, H),))
    with pytest.raises(RuntimeError, match="needs CUDA"):
        te.make_graphed_callables(lin, (torch.randn(2, H),), fp8_enabled=True)
    with pytest.raises(TypeError, match="_order.*scheduling"):
        te.make_graphed_callables(lin, (torch.randn(2, H),), _order=[1])
    with pytest.raises(TypeError, match="fp8_recipe"):
        te.make_graphed_callables(lin, (torch.randn(2, H),), fp8_enabled=True, fp8_recipe="x")
    with pytest.raises(TypeError, match="graphs modules"):
        te.make_graphed_callables(lambda x: lin(x), (torch.randn(2, H),), fp8_enabled=True)
    for unsupported in (dict(fp8_calibrating=True), dict(calibrating=True),
                        dict(fp8_group=object()), dict(fp8_weight_caching=True),
                        dict(cache_quantized_params=True)):
        with pytest.raises(ValueError, match="not supported"):
            te.make_graphed_callables(lin, (torch.randn(2, H),), fp8_enabled=True,
                                      **unsupported)


# ---------------------------------------------------------------------------- B: decoder lengths
@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_decoder_lengths_follow_te(fmt):
    """Self attention over the queries' lengths, cross attention over q and kv lengths."""
    torch.manual_seed(0)
    lq, lkv, sq, skv = [3, 5], [6, 2], 5, 6
    dec = layer(layer_type="decoder", self_attn_mask_type="padding_causal",
                enc_dec_attn_mask_type="padding", attn_input_format=fmt)
    x_pad, enc_pad = torch.randn(2, sq, H), torch.randn(2, skv, H)
    want = torch.zeros(2, sq, H)
    for i in range(2):  # each sequence alone, without padding
        one = dec(x_pad[i:i + 1, :lq[i]], encoder_output=enc_pad[i:i + 1, :lkv[i]],
                  self_attn_mask_type="causal", enc_dec_attn_mask_type="no_mask") \
            if fmt == "bshd" else None
        if one is None:
            one = dec(x_pad[i, :lq[i]], encoder_output=enc_pad[i, :lkv[i]],
                      cu_seqlens_q=cu([lq[i]]), cu_seqlens_kv=cu([lkv[i]]))[None]
        want[i, :lq[i]] = one[0]
    if fmt == "bshd":
        got = dec(x_pad, attention_mask=padding_mask(lq, sq), encoder_output=enc_pad,
                  enc_dec_attn_mask=(padding_mask(lq, sq), padding_mask(lkv, skv)))
        for i in range(2):
            torch.testing.assert_close(got[i, :lq[i]], want[i, :lq[i]])
    else:
        x = torch.cat([x_pad[i, :lq[i]] for i in range(2)])
        enc = torch.cat([enc_pad[i, :lkv[i]] for i in range(2)])
        got = dec(x, encoder_output=enc, cu_seqlens_q=cu(lq), cu_seqlens_kv=cu(lkv),
                  max_seqlen_q=sq, max_seqlen_kv=skv)
        torch.testing.assert_close(got, torch.cat([want[i, :lq[i]] for i in range(2)]))


# ---------------------------------------------------------------------------- C: TE semantics
def test_attention_mask_is_ignored_by_mask_types_that_do_not_read_it():
    torch.manual_seed(0)
    q = torch.randn(2, 5, HEADS, D)
    mask = padding_mask([2, 3], 5)
    for mask_type in ("causal", "no_mask", "causal_bottom_right"):
        dpa = te.DotProductAttention(HEADS, D, qkv_format="bshd", attn_mask_type=mask_type)
        torch.testing.assert_close(dpa(q, q, q, mask), dpa(q, q, q))
    lyr = layer(attn_input_format="bshd")
    x = torch.randn(2, 5, H)
    float_mask = torch.zeros(2, 1, 5, 5)  # e.g. Hugging Face's additive causal mask
    torch.testing.assert_close(lyr(x, attention_mask=float_mask), lyr(x))


def test_thd_ignores_attention_mask_beside_cu_seqlens():
    q = torch.randn(7, HEADS, D)
    c = cu([3, 4])
    dpa = te.DotProductAttention(HEADS, D, qkv_format="thd", attn_mask_type="padding_causal")
    torch.testing.assert_close(dpa(q, q, q, padding_mask([1, 1], 4), cu_seqlens_q=c,
                                   cu_seqlens_kv=c), dpa(q, q, q, cu_seqlens_q=c, cu_seqlens_kv=c))


def test_bias_111s_broadcasts_over_rows():
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 1, HEADS, D), torch.randn(6, 1, HEADS, D), torch.randn(6, 1, HEADS, D)
    bias = torch.randn(1, 1, 1, 6, requires_grad=True)
    dpa = te.DotProductAttention(HEADS, D, attn_mask_type="no_mask")
    out = dpa(q, k, v, core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    want = attention_one(q[:, 0], k[:, 0], v[:, 0], bias=bias.detach().expand(1, 1, 4, 6)[0])
    torch.testing.assert_close(out[:, 0].double(), want.reshape(4, -1), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert bias.grad.shape == (1, 1, 1, 6)


def test_layernorm_linear_parameter_order_is_te():
    names = [n for n, _ in te.LayerNormLinear(4, 6, device="cpu").named_parameters()]
    assert names == ["layer_norm_weight", "layer_norm_bias", "weight", "bias"]
    split = te.LayerNormLinear(4, 6, parameters_split=("query", "key"), device="cpu")
    assert [n for n, _ in split.named_parameters()] == [
        "layer_norm_weight", "layer_norm_bias", "query_weight", "key_weight", "query_bias",
        "key_bias"]


def test_layernorm_mlp_checkpoint_recomputes_and_matches():
    torch.manual_seed(0)
    plain = ref.randomize(te.LayerNormMLP(H, FFN, device="cpu"))
    ckpt = te.LayerNormMLP(H, FFN, device="cpu", checkpoint=True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(8, H, requires_grad=True)
    grads = [torch.autograd.grad(m(x).square().sum(), (x, m.fc1_weight)) for m in (plain, ckpt)]
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want)

    def saved(m):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: sizes.append(t.numel()) or t, lambda t: t):
            m(x)
        return sum(sizes)

    assert saved(ckpt) < saved(plain)


def test_bottom_right_diagonal_moves_a_non_causal_window():
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, HEADS, D), torch.randn(6, 1, HEADS, D), torch.randn(6, 1, HEADS, D)
    window = (1, 1)
    dpa = te.DotProductAttention(HEADS, D, attn_mask_type="no_mask", window_size=window)
    bottom = dpa(q, k, v)
    top = dpa(q, k, v, bottom_right_diagonal=False)
    assert not torch.allclose(top, bottom)
    keep = torch.tensor([[abs(i - j) <= 1 for j in range(6)] for i in range(3)])
    want = attention_one(q[:, 0], k[:, 0], v[:, 0], arbitrary=~keep[None])
    torch.testing.assert_close(top[:, 0].double(), want.reshape(3, -1), atol=1e-5, rtol=1e-5)
    want_bottom = attention_one(q[:, 0], k[:, 0], v[:, 0], window=window)
    torch.testing.assert_close(bottom[:, 0].double(), want_bottom.reshape(3, -1), atol=1e-5,
                               rtol=1e-5)
    # Module default; causal types ignore it (their alignment is in their name).
    top_dpa = te.DotProductAttention(HEADS, D, attn_mask_type="no_mask", window_size=window,
                                     bottom_right_diagonal=False)
    torch.testing.assert_close(top_dpa(q, k, v), top)
    causal = te.DotProductAttention(HEADS, D, attn_mask_type="causal_bottom_right")
    torch.testing.assert_close(causal(q, k, v, bottom_right_diagonal=False), causal(q, k, v))


def test_bottom_right_diagonal_moves_alibi_and_reaches_from_transformer_layer():
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, HEADS, D), torch.randn(5, 1, HEADS, D)
    dpa = te.DotProductAttention(HEADS, D, attn_mask_type="no_mask")
    slopes = torch.tensor([0.5, 0.25])
    top = dpa(q, k, k, core_attention_bias_type="alibi", alibi_slopes=slopes,
              bottom_right_diagonal=False)
    dist = torch.tensor([[abs(i - j) for j in range(5)] for i in range(2)], dtype=torch.float)
    want = attention_one(q[:, 0], k[:, 0], k[:, 0], bias=-slopes.view(2, 1, 1) * dist)
    torch.testing.assert_close(top[:, 0].double(), want.reshape(2, -1), atol=1e-5, rtol=1e-5)
    dec = layer(layer_type="decoder", enc_dec_window_size=(0, 0), attn_input_format="bshd")
    x, enc = torch.randn(1, 3, H), torch.randn(1, 5, H)
    top_left = dec(x, encoder_output=enc, enc_dec_bottom_right_diagonal=False)
    assert not torch.allclose(top_left, dec(x, encoder_output=enc))
    by_default = layer(layer_type="decoder", enc_dec_window_size=(0, 0), attn_input_format="bshd",
                       enc_dec_bottom_right_diagonal=False)
    by_default.load_state_dict(dec.state_dict())
    torch.testing.assert_close(by_default(x, encoder_output=enc), top_left)


def test_bottom_right_diagonal_false_with_thd_windows_is_top_left_per_sequence():
    """thd with a window and bottom_right_diagonal=False: each sequence's window is aligned
    top-left by its own lengths (the unfused backend; the kernel backends decline it)."""
    torch.manual_seed(0)
    lens_q, lens_kv = [2, 3], [4, 5]
    q = torch.randn(sum(lens_q), HEADS, D)
    k, v = torch.randn(sum(lens_kv), HEADS, D), torch.randn(sum(lens_kv), HEADS, D)
    dpa = te.DotProductAttention(HEADS, D, qkv_format="thd", attn_mask_type="padding",
                                 window_size=(1, 1))
    out = dpa(q, k, v, cu_seqlens_q=cu(lens_q), cu_seqlens_kv=cu(lens_kv),
              bottom_right_diagonal=False)
    starts_q, starts_kv = [0, 2], [0, 4]
    for sq_i, skv_i, oq, okv in zip(lens_q, lens_kv, starts_q, starts_kv):
        keep = torch.tensor([[abs(i - j) <= 1 for j in range(skv_i)] for i in range(sq_i)])
        want = attention_one(q[oq:oq + sq_i], k[okv:okv + skv_i], v[okv:okv + skv_i],
                             arbitrary=~keep[None])
        torch.testing.assert_close(out[oq:oq + sq_i].double(), want.reshape(sq_i, -1),
                                   atol=1e-5, rtol=1e-5)


def test_kernel_backends_decline_a_top_left_non_causal_diagonal():
    import dataclasses
    from transformer_fa.attention.backends.support import reference_only_reasons
    from transformer_fa.attention.params import AttentionParams
    base = AttentionParams(
        qkv_format="bshd", q_format="bshd", kv_format="bshd", qkv_layout="bshd_bshd_bshd",
        batch_size=1, num_heads=2, num_gqa_groups=2, max_seqlen_q=4, max_seqlen_kv=8,
        head_dim_qk=64, head_dim_v=64, dtype=torch.bfloat16, device_type="cuda",
        compute_capability=(9, 0), attn_mask_type="no_mask", window_size=(2, 2),
        core_attention_bias_type="no_bias", core_attention_bias_shape=None,
        core_attention_bias_requires_grad=False, alibi_slopes_shape=None,
        attention_dropout=0.0, softmax_scale=0.125, deterministic=False, requires_grad=False)
    assert reference_only_reasons(base) == []
    top_left = dataclasses.replace(base, bottom_right_diagonal=False)
    assert reference_only_reasons(top_left) == [
        "as it does not support bottom_right_diagonal = False with a sliding window or ALiBi"]
    # Alignment means nothing without a window or ALiBi, and causal types carry their own.
    assert reference_only_reasons(dataclasses.replace(top_left, window_size=(-1, -1))) == []
    assert reference_only_reasons(dataclasses.replace(
        top_left, attn_mask_type="causal_bottom_right", window_size=(2, 0))) == []


# ---------------------------------------------------------------------------- D: our errors
def test_input_dtype_must_match_params_dtype_outside_autocast():
    lyr = layer()
    with pytest.raises(TypeError, match="hidden_states dtype torch.float64.*params_dtype "
                                        "torch.float32"):
        lyr(torch.randn(3, 1, H, dtype=torch.float64))
    with pytest.raises(TypeError, match="inp dtype torch.bfloat16"):
        te.Linear(H, H, device="cpu")(torch.randn(2, H, dtype=torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lyr(torch.randn(3, 1, H)).dtype == torch.bfloat16


def test_hidden_size_mismatch_is_named():
    with pytest.raises(ValueError, match="hidden_states has last dim 12.*hidden_size=16"):
        layer()(torch.randn(3, 1, 12))
    with pytest.raises(ValueError, match="last dim 12.*hidden_size=16"):
        te.MultiheadAttention(H, HEADS, device="cpu")(torch.randn(3, 1, 12))


@pytest.mark.parametrize("fmt,shape", [("sbhd", (0, 2, H)), ("bshd", (2, 0, H))])
def test_empty_sequence_gives_an_empty_output(fmt, shape):
    x = torch.randn(*shape, requires_grad=True)
    out = layer(attn_input_format=fmt)(x)
    assert out.shape == shape
    out.sum().backward()
    assert x.grad.shape == shape


def test_meta_device():
    lyr = te.TransformerLayer(H, FFN, HEADS, device="meta")
    assert all(p.is_meta for p in lyr.parameters())
    with pytest.raises(ValueError, match="meta tensor"):
        lyr(torch.randn(3, 1, H, device="meta"))


def test_padding_mask_type_without_mask_names_attention_mask():
    dpa = te.DotProductAttention(HEADS, D, qkv_format="bshd", attn_mask_type="padding")
    q = torch.randn(2, 5, HEADS, D)
    with pytest.raises(ValueError, match="'padding' with the bshd format needs attention_mask"):
        dpa(q, q, q)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
@pytest.mark.parametrize("make", [
    lambda: te.TransformerLayer(H, FFN, HEADS),
    lambda: te.MultiheadAttention(H, HEADS),
    lambda: te.Linear(H, H),
    lambda: te.LayerNormLinear(H, H),
    lambda: te.LayerNormMLP(H, FFN),
    lambda: te.LayerNorm(H),
    lambda: te.RMSNorm(normalized_shape=H),
])
def test_cuda_device_without_cuda_is_named(make):
    with pytest.raises(ValueError, match="device='cuda'.*CUDA is not available.*device='cpu'"):
        make()


def test_causal_window_warns_once():
    q = torch.randn(4, 1, HEADS, D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dpa = te.DotProductAttention(HEADS, D, attn_mask_type="causal", window_size=(2, 2))
        dpa(q, q, q)
        dpa(q, q, q)
        lyr = layer(window_size=(2, 2))
        lyr(torch.randn(4, 1, H))
        lyr(torch.randn(4, 1, H))
    assert len([w for w in caught if "window_size" in str(w.message)]) == 2  # one per module


def test_causal_style_window_on_a_non_causal_mask_is_te_s_no_window():
    q, k = torch.randn(3, 1, HEADS, D), torch.randn(5, 1, HEADS, D)
    with pytest.warns(UserWarning, match="window_size=\\(-1, 0\\)"):
        dpa = te.DotProductAttention(HEADS, D, attn_mask_type="no_mask", window_size=(-1, 0))
    torch.testing.assert_close(dpa(q, k, k), te.DotProductAttention(
        HEADS, D, attn_mask_type="no_mask")(q, k, k))


def test_newest_te_forward_tuning_arguments():
    """TE 2.x forward knobs: num_splits (FlashAttention-3 only, ignored elsewhere as in TE) and
    bf16_backward (FP8 attention's) change nothing; score_mod callbacks are refused."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(6, 2, 4, 8) for _ in range(3))
    dpa = te.DotProductAttention(4, 8)
    plain = dpa(q, k, v)
    torch.testing.assert_close(dpa(q, k, v, num_splits=4, bf16_backward=False), plain)
    with pytest.raises(ValueError, match="num_splits"):
        dpa(q, k, v, num_splits=0)
    with pytest.raises(ValueError, match="score_mod"):
        dpa(q, k, v, score_mod=lambda graph, score, tensors: score)


@pytest.mark.parametrize("fmt,dim", [("sbhd", -3), ("bshd", -2), ("thd", -3)])
def test_packed_qkv_layer_and_kv_layer(fmt, dim):
    """TE's qkv_layer / kv_layer: q, k, v are views of the packed buffer, detected as its
    layout without a copy, and give what separate tensors give."""
    torch.manual_seed(0)
    lead = {"sbhd": (6, 2), "bshd": (2, 6), "thd": (12,)}[fmt]
    packed_shape = (*lead, 3, 4, 8) if dim == -3 else (*lead, 4, 3, 8)
    qkv = torch.randn(packed_shape, requires_grad=True)
    kw = {}
    if fmt == "thd":
        kw = dict(cu_seqlens_q=torch.tensor([0, 5, 12], dtype=torch.int32),
                  cu_seqlens_kv=torch.tensor([0, 5, 12], dtype=torch.int32))
    dpa = te.DotProductAttention(4, 8, qkv_format=fmt, attn_mask_type="causal")
    out = dpa(qkv_layer=qkv, qkv_interleave_dim=dim, **kw)
    q, k, v = (qkv.select(dim, i).detach().clone() for i in range(3))
    torch.testing.assert_close(out, dpa(q, k, v, **kw))
    layout, *_ = te.attention.get_qkv_layout(*(qkv.select(dim, i) for i in range(3)), fmt)
    assert "3" in layout, layout
    out.sum().backward()
    assert qkv.grad is not None and qkv.grad.abs().sum() > 0
    # kv_layer beside a separate query
    kv = qkv.detach().narrow(dim, 1, 2)
    torch.testing.assert_close(dpa(q, kv_layer=kv, qkv_interleave_dim=dim, **kw), out)


def test_packed_inputs_bad_combinations():
    dpa = te.DotProductAttention(4, 8)
    qkv = torch.randn(6, 2, 3, 4, 8)
    with pytest.raises(ValueError, match="qkv_interleave_dim"):
        dpa(qkv_layer=qkv, qkv_interleave_dim=-1)
    with pytest.raises(ValueError, match="size 3 at dim -2"):
        dpa(qkv_layer=qkv, qkv_interleave_dim=-2)
    with pytest.raises(ValueError, match="excludes"):
        dpa(qkv[:, :, 0], qkv_layer=qkv)
    with pytest.raises(ValueError, match="required"):
        dpa(qkv[:, :, 0])


@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_thd_with_padding_between_sequences(mask):
    """TE's padded thd: sequence i's tokens start at cu_seqlens_*_padded[i]; the result is the
    packed result put back in those rows, zeros between sequences, gradients likewise."""
    torch.manual_seed(0)
    lens, slots = [3, 5, 0, 2], [4, 5, 3, 4]
    rows = torch.cat([torch.arange(s0, s0 + n) for s0, n in
                      zip(torch.tensor([0] + slots).cumsum(0).tolist(), lens)])
    total = sum(slots)
    qkv = [torch.randn(total, HEADS, D, requires_grad=True) for _ in range(3)]
    dpa = te.DotProductAttention(HEADS, D, qkv_format="thd", attn_mask_type=mask)
    c, cp = cu(lens), cu(slots)
    out = dpa(*qkv, cu_seqlens_q=c, cu_seqlens_kv=c, cu_seqlens_q_padded=cp,
              cu_seqlens_kv_padded=cp, pad_between_seqs=True)
    packed = [t.detach()[rows].requires_grad_() for t in qkv]
    ref = dpa(*packed, cu_seqlens_q=c, cu_seqlens_kv=c)
    assert out.shape == (total, HEADS * D)
    torch.testing.assert_close(out[rows], ref)
    gaps = torch.ones(total, dtype=torch.bool)
    gaps[rows] = False
    assert out[gaps].abs().max() == 0
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad[rows])
    for t, p in zip(qkv, packed):
        torch.testing.assert_close(t.grad[rows], p.grad)
        assert t.grad[gaps].abs().max() == 0


def test_transformer_layer_thd_with_padding_between_sequences_and_rope():
    """A thd layer with gaps between sequences (and RoPE counted from each padded start)
    gives, on the real tokens, what the packed layer gives."""
    torch.manual_seed(0)
    lens, slots = [3, 5, 2], [4, 7, 2]
    rows = torch.cat([torch.arange(s0, s0 + n) for s0, n in
                      zip(torch.tensor([0] + slots).cumsum(0).tolist(), lens)])
    layer = te.TransformerLayer(H, 2 * H, HEADS, attn_input_format="thd", hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="padding_causal",
                                device="cpu")
    freqs = te.RotaryPositionEmbedding(H // HEADS)(16).cpu()
    x = torch.randn(sum(slots), H)
    out = layer(x, cu_seqlens_q=cu(lens), cu_seqlens_q_padded=cu(slots), max_seqlen_q=5,
                rotary_pos_emb=freqs, pad_between_seqs=True)
    ref = layer(x[rows], cu_seqlens_q=cu(lens), max_seqlen_q=5, rotary_pos_emb=freqs)
    torch.testing.assert_close(out[rows], ref)


def test_gemm_modules_refuse_fp8_tensors_between_modules():
    # TE's forward flags for FP8 outputs / gradients: False runs, True is refused by name (the
    # modules hand 16/32-bit tensors on), and a misspelt keyword is a TypeError, as in TE
    x = torch.randn(3, H)
    for module in (te.Linear(H, H, device="cpu"), te.LayerNormLinear(H, H, device="cpu")):
        name = type(module).__name__
        assert module(x, is_first_microbatch=None, fp8_output=False, fp8_grad=False).shape == (3, H)
        for flag in ("fp8_output", "fp8_grad"):
            with pytest.raises(ValueError, match=rf"{name}.forward: {flag}=True .*not supported"):
                module(x, **{flag: True})
        with pytest.raises(TypeError, match="fp8_outptu"):
            module(x, fp8_outptu=True)
    with pytest.raises(TypeError, match="fp8_output"):
        te.LayerNormMLP(H, FFN, device="cpu")(x, fp8_output=False)  # not TE's either


@pytest.mark.parametrize("make", [
    lambda **kw: te.Linear(H, H, device="cpu", **kw),
    lambda **kw: te.LayerNormMLP(H, FFN, device="cpu", **kw),
    lambda **kw: layer(**kw),
])
def test_delay_wgrad_compute_is_refused_where_it_would_matter(make):
    # TE's backward leaves the weight gradients to backward_dw(), which these modules lack
    make(delay_wgrad_compute=False)
    with pytest.raises(ValueError, match="delay_wgrad_compute=True is not supported.*backward_dw"):
        make(delay_wgrad_compute=True)


def test_norms_take_sm_margin():
    x = torch.randn(3, H)
    for cls in (te.LayerNorm, te.RMSNorm):
        plain = cls(H, device="cpu")
        assert torch.equal(cls(H, device="cpu", sm_margin=4)(x), plain(x))


def test_recipes_take_te_backward_override_and_power_2_scales_at_their_defaults():
    assert DelayedScaling().backward_override is None
    recipe = Float8CurrentScaling(backward_override=None, use_power_2_scales=False)
    assert recipe.backward_override is None and recipe.use_power_2_scales is False
    for cls in (DelayedScaling, Float8CurrentScaling):
        with pytest.raises(ValueError, match=r"backward_override='dequantized'\) is not supported"):
            cls(backward_override="dequantized")
        with pytest.raises(ValueError, match="backward_override must be one of"):
            cls(backward_override="fp32")
    with pytest.raises(ValueError, match="use_power_2_scales=True.*not supported"):
        Float8CurrentScaling(use_power_2_scales=True)


def test_recipes_answer_tes_kind_predicates():
    for recipe, kind in ((DelayedScaling(), "delayed"),
                         (Float8CurrentScaling(), "float8_current_scaling")):
        answers = {name: getattr(recipe, name)() for name in (
            "delayed", "float8_current_scaling", "float8_per_tensor_scaling", "mxfp8",
            "float8_block_scaling", "nvfp4", "custom")}
        assert answers == {name: name in (kind, "float8_per_tensor_scaling") for name in answers}
    assert DelayedScaling.delayed() and not Float8CurrentScaling.delayed()  # TE's: classmethods


def test_older_fp8_names_warn_as_tes_do():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the current names are quiet
        with te.autocast(enabled=False), te.quantized_model_init(enabled=False):
            pass
    for old, new in ((lambda: te.fp8_autocast(enabled=False), "autocast"),
                     (lambda: te.fp8_model_init(enabled=False), "quantized_model_init")):
        with pytest.warns(DeprecationWarning, match=rf"is deprecated.*Use {new}\("):
            with old():
                pass
