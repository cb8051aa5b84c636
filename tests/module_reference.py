"""Direct formulas for the module tests, written apart from transformer_fa's module code.

Everything here works on batch-first ``[b, s, ...]`` tensors and is plain math: the tests
convert to and from the other formats themselves.
"""
import math

import torch

from reference import attention_one


def layer_norm(x, gamma, beta, eps, zero_centered_gamma=False):
    g = gamma + 1 if zero_centered_gamma else gamma
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * g + beta


def rms_norm(x, gamma, eps, zero_centered_gamma=False):
    g = gamma + 1 if zero_centered_gamma else gamma
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


def norm(x, kind, gamma, beta, eps, zero_centered_gamma=False):
    if kind == "LayerNorm":
        return layer_norm(x, gamma, beta, eps, zero_centered_gamma)
    return rms_norm(x, gamma, eps, zero_centered_gamma)


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


ACTIVATION_FORMULAS = {
    "gelu": gelu_tanh,
    "qgelu": lambda x: x / (1 + torch.exp(-1.702 * x)),
    "relu": lambda x: torch.where(x > 0, x, torch.zeros_like(x)),
    "srelu": lambda x: torch.where(x > 0, x * x, torch.zeros_like(x)),
    "silu": lambda x: x / (1 + torch.exp(-x)),
}
GATED = {"glu": "sigmoid", "geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu",
         "sreglu": "srelu", "swiglu": "silu"}


def activation(name, x):
    """TE activation by formula; gated ones: act(first half) * second half."""
    if name in GATED:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        act = GATED[name]
        fa = 1 / (1 + torch.exp(-a)) if act == "sigmoid" else ACTIVATION_FORMULAS[act](a)
        return fa * b
    return ACTIVATION_FORMULAS[name](x)


def rope_angles(positions, dim, base=10000.0):
    """[..., dim/2] angles position * base^(-2i/dim)."""
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return positions.double()[..., None] * inv


def rope(x, positions, rot_dim=None, interleaved=False, base=10000.0):
    """Rotate channel pairs of x [..., s, h, d] by complex multiplication.

    positions: [..., s] integer positions (broadcast over heads). Pairs are (i, i + rot_dim/2),
    or (2i, 2i+1) when interleaved; channels past rot_dim pass through.
    """
    d = x.shape[-1]
    rot_dim = d if rot_dim is None else rot_dim
    half = rot_dim // 2
    xr = x[..., :rot_dim].double()
    if interleaved:
        re, im = xr[..., 0::2], xr[..., 1::2]
    else:
        re, im = xr[..., :half], xr[..., half:]
    z = torch.complex(re, im) * torch.polar(
        torch.ones(1, dtype=torch.float64), rope_angles(positions, rot_dim, base)
    ).unsqueeze(-2)
    if interleaved:
        out = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        out = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rot_dim:]), dim=-1)


def attention(q, k, v, causal=False, kv_lens=None, q_lens=None):
    """softmax(q k^T / sqrt(d)) v per head, through the float64 reference of tests/reference.py,
    one sequence at a time; q [b, sq, h, d], k/v [b, skv, g, d]. causal is top-left; kv_lens
    masks keys past each sequence's length; rows past q_lens give zeros. Returns [b, sq, h*d]."""
    b, sq, h, d = q.shape
    out = torch.zeros(b, sq, h, v.shape[-1], dtype=torch.float64)
    for i in range(b):
        nq = sq if q_lens is None else int(q_lens[i])
        nk = k.shape[1] if kv_lens is None else int(kv_lens[i])
        out[i, :nq] = attention_one(q[i, :nq], k[i, :nk], v[i, :nk],
                                    "causal" if causal else "no_mask")
    return out.reshape(b, sq, -1).to(q.dtype)


def randomize(module, scale=0.3):
    """Non-trivial values for every parameter (biases and norm gains included)."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, scale)
    return module


def _linear(x, w, b):
    return x @ w.T + (b if b is not None else 0)


def _norm_of(mod, x):
    """The input norm of a LayerNormLinear / LayerNormMLP by formula."""
    return norm(x, mod.normalization, mod.layer_norm_weight, mod.layer_norm_bias, mod.eps,
                mod.zero_centered_gamma)


def mha(mha, x, enc=None, causal=True, positions=None, rope_dim=None, kv_lens=None,
        with_ln_out=False, qk_norm=None):
    """A MultiheadAttention's function by formula, read from its separate query/key/value
    weights (fuse_qkv_params=False); x and enc [b, s, hidden]. qk_norm: a function applied to
    the query and key heads, after RoPE or before it (mha.qk_norm_before_rope). Returns out
    (bias added), and the input norm's output too if with_ln_out."""
    hn = mha.hidden_size_per_attention_head
    heads, groups = mha.num_attention_heads, mha.num_gqa_groups
    if mha.attention_type == "self":
        proj = mha.layernorm_qkv if mha.input_layernorm else mha.qkv
        wq, bq = proj.query_weight, getattr(proj, "query_bias", None)
        wk, bk = proj.key_weight, getattr(proj, "key_bias", None)
        wv, bv = proj.value_weight, getattr(proj, "value_bias", None)
    else:
        proj = mha.layernorm_query if mha.input_layernorm else mha.query_layer
        prefix = "query_" if mha.input_layernorm else ""
        wq, bq = getattr(proj, prefix + "weight"), getattr(proj, prefix + "bias", None)
        kv = mha.key_value
        wk, bk = kv.key_weight, getattr(kv, "key_bias", None)
        wv, bv = kv.value_weight, getattr(kv, "value_bias", None)
    ln_out = _norm_of(proj, x) if mha.input_layernorm else None
    xq = ln_out if ln_out is not None else x
    src = xq if mha.attention_type == "self" else enc
    b, s = x.shape[:2]
    q = _linear(xq, wq, bq).view(b, s, heads, hn)
    k = _linear(src, wk, bk).view(b, src.shape[1], groups, hn)
    v = _linear(src, wv, bv).view(b, src.shape[1], groups, hn)
    if qk_norm is not None and mha.qk_norm_before_rope:
        q, k = qk_norm(q), qk_norm(k)
    if positions is not None:
        q = rope(q, positions, rot_dim=rope_dim)
        k = rope(k, positions, rot_dim=rope_dim)
    if qk_norm is not None and not mha.qk_norm_before_rope:
        q, k = qk_norm(q), qk_norm(k)
    ctx = attention(q, k, v, causal=causal, kv_lens=kv_lens)
    out = _linear(ctx, mha.proj.weight, mha.proj.bias)
    return (out, ln_out) if with_ln_out else out


def mlp(mod, x, with_ln_out=False):
    ln_out = _norm_of(mod, x)
    hidden = activation(mod.activation, _linear(ln_out, mod.fc1_weight, mod.fc1_bias))
    out = _linear(hidden, mod.fc2_weight, mod.fc2_bias)
    return (out, ln_out) if with_ln_out else out


def transformer_layer(layer, x, enc=None, positions=None, kv_lens=None):
    """TE's TransformerLayer by formula (no dropout); x [b, s, hidden]."""
    post = layer.apply_residual_connection_post_layernorm
    causal = "causal" in layer.self_attn_mask_type
    attn, ln1 = mha(layer.self_attention, x, causal=causal, positions=positions,
                    kv_lens=kv_lens, with_ln_out=True)
    if layer.parallel_attention_mlp:
        return x + attn + mlp(layer.layernorm_mlp, x)
    h = (ln1 if post and ln1 is not None else x) + attn
    if layer.layer_type == "decoder":
        cross, ln2 = mha(layer.inter_attention, h, enc, causal=False, with_ln_out=True)
        h = (ln2 if post else h) + cross
    m, ln3 = mlp(layer.layernorm_mlp, h, with_ln_out=True)
    out = (ln3 if post else h) + m
    if layer.output_layernorm:
        norm_mod = layer.layernorm
        out = norm(out, type(norm_mod).__name__, norm_mod.weight, norm_mod.bias, norm_mod.eps,
                   norm_mod.zero_centered_gamma)
    return out
