"""CPU tests of TransformerLayer against TE's structure written out as formulas."""
import pytest
import torch

import module_reference as ref
from transformer_fa.attention.inference import InferenceParams
from transformer_fa.attention.rope import RotaryPositionEmbedding
from transformer_fa.transformer import TransformerLayer

ATOL, RTOL = 5e-5, 1e-4
H, FFN, HEADS = 32, 48, 4


def close(actual, expected, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=rtol)


def make_layer(**kwargs):
    args = dict(hidden_size=H, ffn_hidden_size=FFN, num_attention_heads=HEADS, hidden_dropout=0.0,
                attention_dropout=0.0, device="cpu")
    args.update(kwargs)
    return TransformerLayer(**args)


def copy_of(layer, **kwargs):
    """Another layer built with kwargs, holding the same weights."""
    other = make_layer(**kwargs)
    other.load_state_dict(layer.state_dict())
    return other


CONFIGS = {
    "default": {},
    "post_ln_residual": dict(apply_residual_connection_post_layernorm=True),
    "output_layernorm": dict(output_layernorm=True),
    "post_ln_residual+output_layernorm": dict(apply_residual_connection_post_layernorm=True,
                                              output_layernorm=True),
    "rmsnorm_swiglu_zcg_gqa": dict(normalization="RMSNorm", activation="swiglu",
                                   zero_centered_gamma=True, num_gqa_groups=2),
    "mqa_no_bias_reglu": dict(num_gqa_groups=1, bias=False, activation="reglu"),
    "parallel_attention_mlp": dict(parallel_attention_mlp=True),
    "no_mask_kv_channels": dict(self_attn_mask_type="no_mask", kv_channels=6),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layer_matches_formula(name):
    torch.manual_seed(0)
    layer = ref.randomize(make_layer(attn_input_format="bshd", **CONFIGS[name]))
    x = torch.randn(2, 6, H)
    close(layer(x), ref.transformer_layer(layer, x))


@pytest.mark.parametrize("option", ["apply_residual_connection_post_layernorm", "output_layernorm"])
def test_residual_options_change_the_function(option):
    torch.manual_seed(0)
    base = ref.randomize(make_layer())
    changed = copy_of(base, **{option: True}) if option != "output_layernorm" else None
    if changed is None:  # output_layernorm adds a norm and drops the attention's input norm
        changed = ref.randomize(make_layer(output_layernorm=True))
        assert not hasattr(changed.self_attention, "layernorm_qkv")
        assert hasattr(changed, "layernorm")
    x = torch.randn(5, 2, H)
    assert not torch.allclose(base(x), changed(x), atol=1e-3)


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_decoder_layer_matches_formula(groups):
    torch.manual_seed(0)
    layer = ref.randomize(make_layer(layer_type="decoder", num_gqa_groups=groups,
                                     attn_input_format="sbhd"))
    x, enc = torch.randn(2, 5, H), torch.randn(2, 7, H)
    out = layer(x.transpose(0, 1), encoder_output=enc.transpose(0, 1))
    close(out.transpose(0, 1), ref.transformer_layer(layer, x, enc))
    # the encoder output really feeds the result
    out2 = layer(x.transpose(0, 1), encoder_output=(enc * 2).transpose(0, 1))
    assert not torch.allclose(out, out2, atol=1e-3)


def test_decoder_post_ln_residual_matches_formula():
    torch.manual_seed(0)
    layer = ref.randomize(make_layer(layer_type="decoder", attn_input_format="bshd",
                                     apply_residual_connection_post_layernorm=True))
    x, enc = torch.randn(2, 4, H), torch.randn(2, 3, H)
    close(layer(x, encoder_output=enc), ref.transformer_layer(layer, x, enc))


def test_layer_with_rope_matches_formula():
    torch.manual_seed(0)
    layer = ref.randomize(make_layer(attn_input_format="bshd", num_gqa_groups=2))
    x = torch.randn(2, 6, H)
    freqs = RotaryPositionEmbedding(H // HEADS)(6).cpu()
    expected = ref.transformer_layer(layer, x, positions=torch.arange(6).expand(2, 6))
    close(layer(x, rotary_pos_emb=freqs), expected)


@pytest.mark.parametrize("fused", [False, True])
def test_formats_agree_with_equal_lengths(fused):
    torch.manual_seed(0)
    kwargs = dict(num_gqa_groups=2, fuse_qkv_params=fused, normalization="RMSNorm",
                  activation="geglu")
    layer_b = ref.randomize(make_layer(attn_input_format="bshd", **kwargs))
    layer_s = copy_of(layer_b, attn_input_format="sbhd", **kwargs)
    layer_t = copy_of(layer_b, attn_input_format="thd", **kwargs)
    b, s = 3, 5
    x = torch.randn(b, s, H)
    freqs = RotaryPositionEmbedding(H // HEADS)(s).cpu()
    out_b = layer_b(x, rotary_pos_emb=freqs)
    out_s = layer_s(x.transpose(0, 1), rotary_pos_emb=freqs).transpose(0, 1)
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32)
    out_t = layer_t(x.reshape(b * s, H), rotary_pos_emb=freqs, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                    max_seqlen_q=s, max_seqlen_kv=s)
    close(out_s, out_b)
    close(out_t.reshape(b, s, H), out_b)


def test_ragged_thd_matches_padded_bshd_with_padding_mask():
    torch.manual_seed(0)
    lens = [5, 2, 7]
    b, s = len(lens), max(lens)
    kwargs = dict(num_gqa_groups=2, self_attn_mask_type="padding_causal")
    layer_b = ref.randomize(make_layer(attn_input_format="bshd", **kwargs))
    layer_t = copy_of(layer_b, attn_input_format="thd", **kwargs)
    x = torch.randn(b, s, H)
    valid = torch.arange(s)[None, :] < torch.tensor(lens)[:, None]  # [b, s]
    mask = ~valid[:, None, None, :]  # True = padding, masked out
    freqs = RotaryPositionEmbedding(H // HEADS)(s).cpu()

    out_b = layer_b(x, attention_mask=mask, rotary_pos_emb=freqs)
    packed = x[valid]  # [t, H], sequences back to back
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out_t = layer_t(packed, rotary_pos_emb=freqs, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    close(out_t, out_b[valid])
    # and both equal the formula with per-sequence lengths
    expected = ref.transformer_layer(layer_b, x, positions=torch.arange(s).expand(b, s),
                                     kv_lens=lens)
    close(out_t, expected[valid])

    # gradients agree too when the loss only sees real tokens
    out_b[valid].square().sum().backward()
    out_t.square().sum().backward()
    for (name, p_b), p_t in zip(layer_b.named_parameters(), layer_t.parameters()):
        close(p_t.grad, p_b.grad, atol=2e-4, rtol=1e-3)


def test_interleaved_qkv_layer_equals_plain_with_permuted_weights():
    torch.manual_seed(0)
    groups, hn = 2, H // HEADS
    plain = ref.randomize(make_layer(fuse_qkv_params=True, qkv_weight_interleaved=False,
                                     num_gqa_groups=groups))
    inter = copy_of(plain, fuse_qkv_params=True, qkv_weight_interleaved=True,
                    num_gqa_groups=groups)
    with torch.no_grad():
        src, dst = plain.self_attention.layernorm_qkv, inter.self_attention.layernorm_qkv
        for p_src, p_dst in ((src.weight, dst.weight), (src.bias[:, None], dst.bias[:, None])):
            q, k, v = p_src.split([HEADS * hn, groups * hn, groups * hn])
            per_group = [t.reshape(groups, -1, hn, p_src.shape[-1]) for t in (q, k, v)]
            p_dst.copy_(torch.cat(per_group, dim=1).reshape(p_src.shape))
    x = torch.randn(6, 2, H)
    close(inter(x), plain(x))


def test_backward_reaches_every_parameter():
    torch.manual_seed(0)
    for kwargs in (dict(), dict(layer_type="decoder", num_gqa_groups=2, fuse_qkv_params=True),
                   dict(output_layernorm=True, normalization="RMSNorm", activation="swiglu"),
                   dict(apply_residual_connection_post_layernorm=True, layer_type="decoder"),
                   dict(parallel_attention_mlp=True, num_gqa_groups=1)):
        layer = ref.randomize(make_layer(**kwargs))
        x = torch.randn(4, 2, H, requires_grad=True)
        enc = torch.randn(3, 2, H) if kwargs.get("layer_type") == "decoder" else None
        layer(x, encoder_output=enc).square().sum().backward()
        assert x.grad.abs().sum() > 0
        for name, p in layer.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, (kwargs, name)


@pytest.mark.parametrize("kwargs, training, fused", [
    ({}, True, True),
    (dict(hidden_dropout=0.1), True, False),  # the dropout sits between the add and the norm
    (dict(hidden_dropout=0.1), False, True),
    (dict(drop_path_rate=0.1), True, False),
    (dict(parallel_attention_mlp=True), True, False),
    (dict(apply_residual_connection_post_layernorm=True), True, False),
    (dict(output_layernorm=True, normalization="RMSNorm"), True, True),
])
def test_residual_add_goes_into_the_mlp_norm_where_nothing_sits_between(kwargs, training, fused,
                                                                       monkeypatch):
    """The residual add before the MLP runs inside the MLP's norm (one kernel on GPUs:
    LayerNormMLP.add_residual_then_forward) unless dropout or stochastic depth act on the
    attention output first, or the layer's residuals are wired otherwise; the layer computes
    the same function either way (test_layer_matches_formula)."""
    from transformer_fa.module.linear import LayerNormMLP
    calls = []
    real = LayerNormMLP.add_residual_then_forward
    monkeypatch.setattr(LayerNormMLP, "add_residual_then_forward",
                        lambda self, *a: calls.append(1) or real(self, *a))
    layer = make_layer(**kwargs).train(training)
    layer(torch.randn(4, 2, H))
    assert len(calls) == int(fused)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    layer = ref.randomize(make_layer(hidden_dropout=0.3, attention_dropout=0.3))
    x = torch.randn(4, 2, H)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    assert not torch.allclose(layer(x), layer(x))


def test_drop_path_drops_whole_samples():
    torch.manual_seed(0)
    layer = ref.randomize(make_layer(drop_path_rate=0.5, attn_input_format="sbhd"))
    x = torch.randn(3, 32, H)  # 32 samples along dim 1
    layer.eval()
    assert not torch.allclose(layer(x), x, atol=1e-3)
    layer.train()
    out = layer(x)
    same = (out - x).abs().amax(dim=-1) < 1e-6  # [s, b]: both branches dropped
    per_sample = same.all(dim=0)
    assert torch.equal(same.any(dim=0), per_sample)  # all-or-nothing per sample
    assert 0 < int(per_sample.sum()) < 32


def test_params_dtype_and_default_dtype():
    layer = make_layer()
    assert all(p.dtype == torch.get_default_dtype() for p in layer.parameters())
    layer16 = make_layer(params_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in layer16.parameters())
    out = layer16(torch.randn(4, 2, H, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_layer_bad_arguments():
    with pytest.raises(ValueError, match="activation"):
        make_layer(activation="mish")
    with pytest.raises(ValueError, match="hidden_size"):
        make_layer(hidden_size=30)
    with pytest.raises(ValueError, match="num_gqa_groups"):
        make_layer(num_gqa_groups=3)
    with pytest.raises(ValueError, match="layer_type"):
        make_layer(layer_type="encdec")
    with pytest.raises(ValueError, match="self_attn_mask_type"):
        make_layer(self_attn_mask_type="top_left")
    with pytest.raises(ValueError, match="attn_input_format"):
        make_layer(attn_input_format="bhsd")
    with pytest.raises(ValueError, match="normalization"):
        make_layer(normalization="rmsnorm")
    with pytest.raises(ValueError, match="hidden_dropout"):
        make_layer(hidden_dropout=1.5)
    with pytest.raises(ValueError, match="parallel_attention_mlp"):
        make_layer(parallel_attention_mlp=True, layer_type="decoder")
    layer = make_layer(layer_type="decoder")
    x = torch.randn(3, 1, H)
    with pytest.raises(ValueError, match="encoder_output"):
        layer(x)
    cache = InferenceParams(1, 8, num_heads_kv=2, head_dim_k=4, dtype=torch.float32,
                               device="cpu")
    with pytest.raises(ValueError, match="inference_params.*self attention"):
        layer(x, encoder_output=x, inference_params=cache)
    with pytest.raises(ValueError, match="self_attn_mask_type"):
        layer(x, encoder_output=x, self_attn_mask_type="diagonal")
    with pytest.raises(TypeError, match="attention_mask"):
        layer(x, encoder_output=x, self_attn_mask_type="padding",
              attention_mask=torch.zeros(1, 1, 1, 3, dtype=torch.int32))


def test_params_dtype_follows_to_dtype():
    """model.to(torch.bfloat16) (as TE users do): the modules then take bf16 inputs and name a
    float32 one as the mismatch."""
    layer = TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                             device="cpu").to(torch.bfloat16)
    assert layer.params_dtype == torch.bfloat16
    assert layer.self_attention.params_dtype == torch.bfloat16
    assert layer.layernorm_mlp.params_dtype == torch.bfloat16
    assert layer(torch.randn(8, 2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="differs from params_dtype torch.bfloat16"):
        layer(torch.randn(8, 2, 64))
