"""CPU tests of the building blocks: norms, linears, activations, RoPE and MultiheadAttention.

Every module is checked against a direct formula (tests/module_reference.py), not against
another path through the same code.
"""
import pytest
import torch

import module_reference as ref
from transformer_fa.attention.multi_head_attention import MultiheadAttention
from transformer_fa.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb
from transformer_fa.module import LayerNorm, LayerNormLinear, LayerNormMLP, Linear, RMSNorm
from transformer_fa.module import activations

ATOL, RTOL = 2e-5, 1e-4
ACTIVATION_NAMES = ["gelu", "qgelu", "relu", "srelu", "silu", "glu", "geglu", "qgeglu",
                    "reglu", "sreglu", "swiglu"]


def close(actual, expected, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=rtol)


# ---------------------------------------------------------------- norms


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_norm_matches_formula(cls, zero_centered_gamma):
    torch.manual_seed(0)
    norm = cls(24, eps=1e-3, zero_centered_gamma=zero_centered_gamma, device="cpu")
    # zero-centered gamma starts at 0, i.e. a scale of 1
    assert torch.all(norm.weight == (0.0 if zero_centered_gamma else 1.0))
    ref.randomize(norm)
    x = torch.randn(3, 5, 24) * 2 + 0.5
    kind = cls.__name__
    beta = norm.bias if kind == "LayerNorm" else None
    close(norm(x), ref.norm(x, kind, norm.weight, beta, 1e-3, zero_centered_gamma))
    if kind == "RMSNorm":
        assert norm.bias is None


def test_norm_keeps_input_dtype_and_te_aliases():
    norm = LayerNorm(normalized_shape=8, device="cpu", dtype=torch.float64)
    assert norm.weight.dtype == torch.float64
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    assert norm(x).dtype == torch.bfloat16
    assert RMSNorm(8, device="cpu").weight.dtype == torch.get_default_dtype()
    with pytest.raises(TypeError, match="normalized_shape and hidden_size"):
        LayerNorm(device="cpu")
    # TE's signature: hidden_size (deprecated, warned as TE warns) is the sixth, device a keyword
    with pytest.warns(DeprecationWarning, match="renamed to `normalized_shape`"):
        assert LayerNorm(hidden_size=8, device="cpu").weight.shape == (8,)
    with pytest.raises(TypeError):
        LayerNorm(8, 1e-5, None, None, False, "cpu")  # the sixth is hidden_size, as in TE


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_norm_over_a_multi_dim_normalized_shape(cls):
    # torch.nn.LayerNorm's and TE's normalized_shape: the last dims normalized together, the
    # parameters of that shape
    torch.manual_seed(0)
    norm = ref.randomize(cls((4, 8), eps=1e-3, device="cpu", dtype=torch.float64))
    assert norm.weight.shape == (4, 8)
    x = torch.randn(3, 5, 4, 8, dtype=torch.float64)
    beta = None if norm.bias is None else norm.bias.reshape(-1)
    expected = ref.norm(x.reshape(3, 5, 32), cls.__name__, norm.weight.reshape(-1), beta, 1e-3)
    close(norm(x), expected.reshape(x.shape))
    with pytest.raises(ValueError, match=r"last dims \[8, 4\] are not normalized_shape=\[4, 8\]"):
        norm(torch.randn(3, 8, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="normalized_shape must be an int or a shape of ints"):
        cls((4, 8.0), device="cpu")


# ---------------------------------------------------------------- linear layers


def test_linear_matches_formula_and_return_bias():
    torch.manual_seed(0)
    lin = ref.randomize(Linear(6, 10, device="cpu"))
    x = torch.randn(4, 6)
    close(lin(x), x @ lin.weight.T + lin.bias)
    lin.return_bias = True
    out, bias = lin(x)
    close(out, x @ lin.weight.T)
    assert bias is lin.bias or torch.equal(bias, lin.bias)


def test_linear_defaults_follow_te():
    torch.manual_seed(0)
    lin = Linear(256, 512, device="cpu")
    assert torch.all(lin.bias == 0)
    assert abs(lin.weight.std().item() - 0.023) < 0.002  # TE: normal(0, 0.023)
    assert lin.weight.dtype == torch.get_default_dtype()
    assert Linear(4, 4, bias=False, device="cpu").bias is None


def test_linear_parameters_split_is_one_weight_cut_in_pieces():
    torch.manual_seed(0)
    seen = []
    lin = Linear(5, 12, parameters_split={"query": 6, "key": 3, "value": 3}, device="cpu",
                 init_method=lambda w: seen.append(tuple(w.shape)) or torch.nn.init.normal_(w))
    assert seen == [(12, 5)]  # the init saw the whole matrix, as in TE
    names = [n for n, _ in lin.named_parameters()]
    # TE's order (all weights, then all biases): optimizer state carries over from TE.
    assert names == ["query_weight", "key_weight", "value_weight", "query_bias", "key_bias",
                     "value_bias"]
    ref.randomize(lin)
    x = torch.randn(3, 5)
    w = torch.cat([lin.query_weight, lin.key_weight, lin.value_weight])
    b = torch.cat([lin.query_bias, lin.key_bias, lin.value_bias])
    close(lin(x), x @ w.T + b)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_matches_formula(normalization):
    torch.manual_seed(0)
    mod = ref.randomize(LayerNormLinear(8, 6, normalization=normalization, return_bias=True,
                                        return_layernorm_output=True, device="cpu"))
    x = torch.randn(2, 3, 8)
    out, bias, ln_out = mod(x)
    expected_ln = ref.norm(x, normalization, mod.layer_norm_weight, mod.layer_norm_bias, 1e-5)
    close(ln_out, expected_ln)
    close(out, expected_ln @ mod.weight.T)
    close(bias, mod.bias)


# ---------------------------------------------------------------- activations and MLP


@pytest.mark.parametrize("name", ACTIVATION_NAMES)
def test_activation_matches_formula(name):
    torch.manual_seed(0)
    x = torch.randn(5, 16) * 3
    fn, gated = activations.get_activation(name)
    assert gated == (name in ref.GATED)
    close(fn(x), ref.activation(name, x))


@pytest.mark.parametrize("name", ACTIVATION_NAMES)
def test_layernorm_mlp_matches_formula(name):
    torch.manual_seed(0)
    mlp = ref.randomize(LayerNormMLP(8, 12, activation=name, device="cpu"))
    gated = name in ref.GATED
    assert mlp.fc1_weight.shape == ((24 if gated else 12), 8)
    assert mlp.fc2_weight.shape == (8, 12)
    x = torch.randn(2, 3, 8)
    ln = ref.layer_norm(x, mlp.layer_norm_weight, mlp.layer_norm_bias, 1e-5)
    hidden = ref.activation(name, ln @ mlp.fc1_weight.T + mlp.fc1_bias)
    close(mlp(x), hidden @ mlp.fc2_weight.T + mlp.fc2_bias)


def test_mlp_return_bias_and_layernorm_output():
    torch.manual_seed(0)
    mlp = ref.randomize(LayerNormMLP(8, 12, normalization="RMSNorm", return_bias=True,
                                 return_layernorm_output=True, zero_centered_gamma=True,
                                 device="cpu"))
    assert mlp.layer_norm_bias is None
    x = torch.randn(4, 8)
    out, bias, ln_out = mlp(x)
    expected_ln = ref.rms_norm(x, mlp.layer_norm_weight, 1e-5, zero_centered_gamma=True)
    close(ln_out, expected_ln)
    hidden = ref.gelu_tanh(expected_ln @ mlp.fc1_weight.T + mlp.fc1_bias)
    close(out, hidden @ mlp.fc2_weight.T)
    close(bias, mlp.fc2_bias)


def test_unknown_activation_names_argument():
    with pytest.raises(ValueError, match="activation"):
        LayerNormMLP(8, 8, activation="tanhglu", device="cpu")


# ---------------------------------------------------------------- rotary embeddings


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_table_matches_formula(interleaved):
    table = RotaryPositionEmbedding(8, rotary_base=500.0, interleaved=interleaved)(6, offset=2)
    assert table.shape == (6, 1, 1, 8) and table.dtype == torch.float32
    angles = ref.rope_angles(torch.arange(2, 8), 8, base=500.0)  # [6, 4]
    expected = angles.repeat_interleave(2, -1) if interleaved else torch.cat([angles] * 2, -1)
    close(table.cpu()[:, 0, 0], expected.float())


def test_rope_interpolation_and_partial_rotary():
    rope = RotaryPositionEmbedding(16, rotary_percent=0.5, seq_len_interpolation_factor=4)
    table = rope(8).cpu()
    assert table.shape == (8, 1, 1, 8)
    angles = ref.rope_angles(torch.arange(8) / 4, 8)
    close(table[:, 0, 0], torch.cat([angles] * 2, -1).float())
    # past pretrained * factor positions the scale grows to fit (TE's dynamic scaling)
    dyn = RotaryPositionEmbedding(8, seq_len_interpolation_factor=2,
                                  pretrained_max_position_embeddings=4)(16).cpu()
    close(dyn[:, 0, 0, :4], ref.rope_angles(torch.arange(16) / 4, 8).float())


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_apply_rope_matches_formula(fmt, interleaved):
    torch.manual_seed(0)
    b, s, h, d, rot = 2, 7, 3, 12, 8  # partial rotary: the last 4 channels pass through
    x = torch.randn(b, s, h, d)
    freqs = RotaryPositionEmbedding(rot, interleaved=interleaved)(10).cpu()
    expected = ref.rope(x, torch.arange(s).expand(b, s), rot_dim=rot, interleaved=interleaved)
    t = x if fmt == "bshd" else x.transpose(0, 1).contiguous()
    out = apply_rotary_pos_emb(t, freqs, fmt, interleaved=interleaved)
    out = out if fmt == "bshd" else out.transpose(0, 1)
    close(out, expected)
    assert torch.equal(out[..., rot:], x[..., rot:])


def test_apply_rope_start_positions():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 2, 8)
    start = torch.tensor([3, 0])
    freqs = RotaryPositionEmbedding(8)(12).cpu()
    expected = ref.rope(x, start[:, None] + torch.arange(5))
    close(apply_rotary_pos_emb(x, freqs, "bshd", start_positions=start), expected)
    sb = apply_rotary_pos_emb(x.transpose(0, 1), freqs, "sbhd", start_positions=start)
    close(sb.transpose(0, 1), expected)


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_thd_restarts_positions_per_sequence(interleaved):
    torch.manual_seed(0)
    lens = [3, 1, 6]
    cu = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    x = torch.randn(11, 2, 8)  # one trailing token past cu_seqlens[-1] stays untouched
    freqs = RotaryPositionEmbedding(8, interleaved=interleaved)(6).cpu()
    out = apply_rotary_pos_emb(x, freqs, "thd", interleaved=interleaved, cu_seqlens=cu)
    start = 0
    for n in lens:
        piece = x[start:start + n]
        close(out[start:start + n], ref.rope(piece, torch.arange(n), interleaved=interleaved))
        start += n
    assert torch.equal(out[10], x[10])


def test_rope_bad_arguments():
    freqs = RotaryPositionEmbedding(8)(4).cpu()
    with pytest.raises(ValueError, match="tensor_format"):
        apply_rotary_pos_emb(torch.randn(4, 1, 1, 8), freqs, "bhsd")
    with pytest.raises(ValueError, match="cu_seqlens"):
        apply_rotary_pos_emb(torch.randn(4, 1, 8), freqs, "thd")
    with pytest.raises(ValueError, match="sequence length"):
        apply_rotary_pos_emb(torch.randn(5, 1, 1, 8), freqs, "sbhd")
    with pytest.raises(ValueError, match="dim"):
        RotaryPositionEmbedding(0)


# ---------------------------------------------------------------- MultiheadAttention


def make_mha(**kwargs):
    args = dict(hidden_size=32, num_attention_heads=4, attention_dropout=0.0, device="cpu")
    args.update(kwargs)
    return MultiheadAttention(**args)


@pytest.mark.parametrize("groups", [4, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("input_layernorm", [False, True])
def test_self_attention_matches_formula(groups, input_layernorm):
    torch.manual_seed(0)
    mha = ref.randomize(make_mha(num_gqa_groups=groups, input_layernorm=input_layernorm,
                             qkv_format="bshd"))
    assert mha.qkv_weight_interleaved is False  # TE: forced off without fuse_qkv_params
    x = torch.randn(2, 6, 32)
    close(mha(x), ref.mha(mha, x))


def test_self_attention_with_rope_matches_formula():
    torch.manual_seed(0)
    mha = ref.randomize(make_mha(num_gqa_groups=2, qkv_format="bshd"))
    x = torch.randn(2, 6, 32)
    freqs = RotaryPositionEmbedding(4)(6).cpu()  # partial: 4 of 8 channels per head
    expected = ref.mha(mha, x, positions=torch.arange(6).expand(2, 6), rope_dim=4)
    close(mha(x, rotary_pos_emb=freqs), expected)


@pytest.mark.parametrize("input_layernorm", [False, True])
def test_cross_attention_matches_formula(input_layernorm):
    torch.manual_seed(0)
    mha = ref.randomize(make_mha(num_gqa_groups=2, attention_type="cross", attn_mask_type="no_mask",
                             input_layernorm=input_layernorm, qkv_format="sbhd"))
    x, enc = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    out = mha(x.transpose(0, 1), encoder_output=enc.transpose(0, 1))
    close(out.transpose(0, 1), ref.mha(mha, x, enc, causal=False))


def interleave_qkv(wq, wk, wv, groups):
    """Rows of separate q, k, v projections -> TE's interleaved order [groups, heads/g + 2, hn]."""
    in_f = wq.shape[-1]
    wk = wk.reshape(groups, 1, -1, in_f)
    hn = wk.shape[2]
    wq = wq.reshape(groups, -1, hn, in_f)
    return torch.cat([wq, wk, wv.reshape(groups, 1, hn, in_f)], dim=1).reshape(-1, in_f)


@pytest.mark.parametrize("groups", [4, 2, 1])
@pytest.mark.parametrize("input_layernorm", [False, True])
def test_fused_qkv_weight_orders_compute_the_same_function(groups, input_layernorm):
    torch.manual_seed(0)
    kwargs = dict(num_gqa_groups=groups, input_layernorm=input_layernorm, qkv_format="sbhd")
    separate = ref.randomize(make_mha(**kwargs))
    plain = make_mha(fuse_qkv_params=True, qkv_weight_interleaved=False, **kwargs)
    inter = make_mha(fuse_qkv_params=True, qkv_weight_interleaved=True, **kwargs)
    name = "layernorm_qkv" if input_layernorm else "qkv"
    src = getattr(separate, name)
    w = [src.query_weight, src.key_weight, src.value_weight]
    b = [src.query_bias[:, None], src.key_bias[:, None], src.value_bias[:, None]]
    with torch.no_grad():
        for mod, order in ((plain, torch.cat), (inter, lambda t: interleave_qkv(*t, groups))):
            dst = getattr(mod, name)
            dst.weight.copy_(order(w))
            dst.bias.copy_(order(b).squeeze(-1))
            mod.proj.load_state_dict(separate.proj.state_dict())
            if input_layernorm:
                dst.layer_norm_weight.copy_(src.layer_norm_weight)
                dst.layer_norm_bias.copy_(src.layer_norm_bias)
    x = torch.randn(6, 2, 32)
    expected = separate(x)
    close(plain(x), expected)
    close(inter(x), expected)
    if groups > 1:  # the two readings really differ: swapping the weights changes the result
        with torch.no_grad():
            getattr(inter, name).weight.copy_(getattr(plain, name).weight)
            getattr(inter, name).bias.copy_(getattr(plain, name).bias)
        assert not torch.allclose(inter(x), expected, atol=1e-3)


def test_fused_kv_weight_orders_for_cross_attention():
    torch.manual_seed(0)
    kwargs = dict(num_gqa_groups=2, attention_type="cross", attn_mask_type="no_mask",
                  fuse_qkv_params=True)
    plain = ref.randomize(make_mha(qkv_weight_interleaved=False, **kwargs))
    inter = make_mha(qkv_weight_interleaved=True, **kwargs)
    hn = 8
    with torch.no_grad():
        inter.load_state_dict(plain.state_dict())
        # non-interleaved rows: [k groups..., v groups...]; interleaved: per group [k, v]
        for p_src, p_dst in ((plain.key_value.weight, inter.key_value.weight),
                             (plain.key_value.bias, inter.key_value.bias)):
            rows = p_src.reshape(2, 2, hn, -1)  # [k|v, group, hn, in]
            p_dst.copy_(rows.transpose(0, 1).reshape(p_src.shape))
    x, enc = torch.randn(5, 2, 32), torch.randn(3, 2, 32)
    close(inter(x, encoder_output=enc), plain(x, encoder_output=enc))


def test_mha_parameter_names_follow_te():
    names = lambda m: {n for n, _ in m.named_parameters()}  # noqa: E731
    assert names(make_mha(input_layernorm=True)) == {
        "layernorm_qkv.layer_norm_weight", "layernorm_qkv.layer_norm_bias",
        "layernorm_qkv.query_weight", "layernorm_qkv.query_bias", "layernorm_qkv.key_weight",
        "layernorm_qkv.key_bias", "layernorm_qkv.value_weight", "layernorm_qkv.value_bias",
        "proj.weight", "proj.bias"}
    assert names(make_mha(fuse_qkv_params=True, bias=False)) == {"qkv.weight", "proj.weight"}
    assert names(make_mha(attention_type="cross", input_layernorm=True)) == {
        "layernorm_query.layer_norm_weight", "layernorm_query.layer_norm_bias",
        "layernorm_query.query_weight", "layernorm_query.query_bias", "key_value.key_weight",
        "key_value.key_bias", "key_value.value_weight", "key_value.value_bias", "proj.weight",
        "proj.bias"}


def test_mha_formats_agree():
    torch.manual_seed(0)
    mods = {f: make_mha(num_gqa_groups=2, qkv_format=f, fuse_qkv_params=True) for f in
            ("sbhd", "bshd", "thd")}
    ref.randomize(mods["sbhd"])
    for f in ("bshd", "thd"):
        mods[f].load_state_dict(mods["sbhd"].state_dict())
    x = torch.randn(2, 5, 32)
    freqs = RotaryPositionEmbedding(8)(5).cpu()
    out_b = mods["bshd"](x, rotary_pos_emb=freqs)
    out_s = mods["sbhd"](x.transpose(0, 1), rotary_pos_emb=freqs).transpose(0, 1)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    out_t = mods["thd"](x.reshape(10, 32), rotary_pos_emb=freqs, cu_seqlens_q=cu,
                        cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    close(out_s, out_b)
    close(out_t.reshape(2, 5, 32), out_b)


def test_mha_return_bias_and_layernorm_output():
    torch.manual_seed(0)
    mha = ref.randomize(make_mha(input_layernorm=True, return_bias=True, qkv_format="bshd",
                                 return_layernorm_output=True))
    x = torch.randn(1, 4, 32)
    out, bias, ln_out = mha(x)
    close(ln_out, ref.layer_norm(x, mha.layernorm_qkv.layer_norm_weight,
                                 mha.layernorm_qkv.layer_norm_bias, 1e-5))
    close(out + bias, ref.mha(mha, x))


def test_mha_qk_norm():
    torch.manual_seed(0)
    mha = ref.randomize(make_mha(qk_norm_type="RMSNorm", qkv_format="bshd"))
    assert mha.q_norm.weight.shape == (8,)
    x = torch.randn(2, 3, 32)
    out = mha(x)
    with torch.no_grad():
        mha.q_norm.weight.mul_(3.0)
    assert not torch.allclose(mha(x), out)


def test_mha_l2_qk_norm_matches_formula():
    # TE's qk_norm_type="L2Normalization": q and k heads scaled to unit L2 norm (eps inside the
    # root), no parameters (before or after RoPE alike: a rotation keeps the norm)
    torch.manual_seed(0)
    mha = ref.randomize(make_mha(qk_norm_type="L2Normalization", qk_norm_eps=1e-2,
                                 qkv_format="bshd"))
    assert not list(mha.q_norm.parameters()) and not list(mha.k_norm.parameters())
    x = torch.randn(2, 6, 32)
    freqs = RotaryPositionEmbedding(4)(6).cpu()
    def l2(t):
        return t / torch.sqrt(t.square().sum(-1, keepdim=True) + 1e-2)
    expected = ref.mha(mha, x, positions=torch.arange(6).expand(2, 6), rope_dim=4, qk_norm=l2)
    close(mha(x, rotary_pos_emb=freqs), expected)
    # bf16 heads are normalized in float32 and come back in bf16
    q = torch.randn(3, 2, 8, dtype=torch.bfloat16) * 40
    out = mha.q_norm(q)
    assert out.dtype == torch.bfloat16
    close(out, l2(q.double()), atol=1e-2, rtol=1e-2)


def test_checkpoint_core_attention_gives_same_gradients():
    torch.manual_seed(0)
    mha = ref.randomize(make_mha(num_gqa_groups=2))
    x = torch.randn(5, 2, 32)
    grads = []
    for ckpt in (False, True):
        mha.zero_grad()
        mha(x, checkpoint_core_attention=ckpt).square().sum().backward()
        grads.append([p.grad.clone() for p in mha.parameters()])
    for a, b in zip(*grads):
        close(a, b)


def test_mha_backward_reaches_every_parameter():
    torch.manual_seed(0)
    for kwargs in (dict(input_layernorm=True, num_gqa_groups=2),
                   dict(attention_type="cross", input_layernorm=True, attn_mask_type="no_mask"),
                   dict(fuse_qkv_params=True, qk_norm_type="LayerNorm")):
        mha = ref.randomize(make_mha(**kwargs))
        x = torch.randn(4, 2, 32)
        enc = torch.randn(3, 2, 32) if kwargs.get("attention_type") == "cross" else None
        mha(x, encoder_output=enc).square().sum().backward()
        for name, p in mha.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_mha_bad_arguments():
    with pytest.raises(ValueError, match="hidden_size"):
        make_mha(hidden_size=30)
    with pytest.raises(ValueError, match="num_gqa_groups"):
        make_mha(num_gqa_groups=3)
    with pytest.raises(ValueError, match="attention_type"):
        make_mha(attention_type="global")
    with pytest.raises(ValueError, match="qkv_format"):
        make_mha(qkv_format="hbsd")
    with pytest.raises(ValueError, match="normalization"):
        make_mha(normalization="BatchNorm", input_layernorm=True)
    with pytest.raises(ValueError, match="tp_size"):
        make_mha(tp_size=2)
    with pytest.raises(TypeError, match="not_an_arg"):
        make_mha(not_an_arg=1)
    mha = make_mha(hidden_size=24, kv_channels=4)  # explicit kv_channels: no divisibility rule
    assert mha.hidden_size_q == 16
    x = torch.randn(3, 1, 24)
    with pytest.raises(TypeError, match="inference_params must be a transformer_fa.InferenceParams"):
        mha(x, inference_params=object())
    with pytest.raises(TypeError, match="attention_mask"):
        mha(x, attention_mask=torch.zeros(1, 1, 1, 3), attn_mask_type="padding")
    with pytest.raises(ValueError, match="encoder_output"):
        make_mha(attention_type="cross")(torch.randn(3, 1, 32))
