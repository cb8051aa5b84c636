"""float64 stays float64: norms, linear layers, RoPE, attention and whole layers compute in at
least the input's precision (float32 for half types). Checked with torch.autograd.gradcheck
(finite differences need float64 all the way) and against plain float64 formulas to ~1e-12.
"""
import pytest
import torch
from torch.func import functional_call

import module_reference as ref
import transformer_fa as tfa
from transformer_fa.attention.rope import RotaryPositionEmbedding, apply_rotary_pos_emb

F64 = torch.float64
HIDDEN, FFN, HEADS, GROUPS = 8, 12, 4, 2
HEAD_DIM = HIDDEN // HEADS


def gradcheck_module(module, *inputs, fast_mode=False, **kwargs):
    """gradcheck of module(*inputs, **kwargs) w.r.t. the inputs and every parameter."""
    names = [name for name, _ in module.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in module.parameters()]
    inputs = [t.detach().clone().requires_grad_() for t in inputs]

    def fn(*args):
        values = dict(zip(names, args[len(inputs):]))
        out = functional_call(module, values, tuple(args[:len(inputs)]), kwargs)
        return out[0] if isinstance(out, tuple) else out

    assert torch.autograd.gradcheck(fn, (*inputs, *params), fast_mode=fast_mode)


def randomized(module):
    torch.manual_seed(0)
    return ref.randomize(module)


NORM_CASES = [
    (tfa.LayerNorm, False), (tfa.LayerNorm, True), (tfa.RMSNorm, False), (tfa.RMSNorm, True)]


@pytest.mark.parametrize("norm_class, zero_centered_gamma", NORM_CASES)
def test_norm_gradcheck_float64(norm_class, zero_centered_gamma):
    norm = randomized(norm_class(HIDDEN, params_dtype=F64, device="cpu",
                                 zero_centered_gamma=zero_centered_gamma))
    gradcheck_module(norm, torch.randn(3, HIDDEN, dtype=F64))


@pytest.mark.parametrize("norm_class, zero_centered_gamma", NORM_CASES)
def test_norm_float64_matches_formula(norm_class, zero_centered_gamma):
    norm = randomized(norm_class(HIDDEN, params_dtype=F64, device="cpu",
                                 zero_centered_gamma=zero_centered_gamma))
    x = torch.randn(3, 5, HIDDEN, dtype=F64)
    expected = ref.norm(x, norm_class.__name__, norm.weight, norm.bias, norm.eps,
                        zero_centered_gamma)
    out = norm(x)
    assert out.dtype == F64
    torch.testing.assert_close(out, expected, atol=1e-13, rtol=1e-13)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_of_half_types_computes_in_float32(dtype):
    norm = randomized(tfa.RMSNorm(HIDDEN, params_dtype=dtype, device="cpu"))
    x = torch.randn(4, HIDDEN).to(dtype)
    expected = ref.rms_norm(x.float(), norm.weight.float(), norm.eps).to(dtype)
    torch.testing.assert_close(norm(x), expected, atol=0, rtol=0)


def test_linear_gradcheck_float64():
    linear = randomized(tfa.Linear(HIDDEN, 6, params_dtype=F64, device="cpu"))
    gradcheck_module(linear, torch.randn(3, HIDDEN, dtype=F64))


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_gradcheck_float64(normalization):
    module = randomized(tfa.LayerNormLinear(HIDDEN, 6, normalization=normalization,
                                            params_dtype=F64, device="cpu"))
    gradcheck_module(module, torch.randn(3, HIDDEN, dtype=F64))


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp_gradcheck_float64(activation):
    module = randomized(tfa.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm",
                                         activation=activation, params_dtype=F64, device="cpu"))
    gradcheck_module(module, torch.randn(3, HIDDEN, dtype=F64))


def float64_freqs(seqlen, dim):
    """TE's table layout [s, 1, 1, dim] (two halves) with float64 angles (the reference's)."""
    angles = ref.rope_angles(torch.arange(seqlen), dim)
    return torch.cat((angles, angles), dim=-1).view(seqlen, 1, 1, dim)


@pytest.mark.parametrize("fmt", ["bshd", "thd"])
def test_rope_float64_matches_formula(fmt):
    b, s = 2, 6
    x = torch.randn(b, s, HEADS, HEAD_DIM * 2, dtype=F64)
    freqs = float64_freqs(s, HEAD_DIM * 2)
    expected = ref.rope(x, torch.arange(s).expand(b, s))
    if fmt == "thd":
        cu = torch.tensor([0, s, 2 * s], dtype=torch.int32)
        out = apply_rotary_pos_emb(x.reshape(b * s, HEADS, -1), freqs, "thd", cu_seqlens=cu)
        out = out.view(b, s, HEADS, -1)
    else:
        out = apply_rotary_pos_emb(x, freqs, "bshd")
    assert out.dtype == F64
    torch.testing.assert_close(out, expected, atol=1e-13, rtol=1e-13)


def test_rope_table_follows_the_module_dtype():
    rope = RotaryPositionEmbedding(HEAD_DIM * 2)
    table32 = rope(5)
    table64 = rope.double()(5)
    assert table32.dtype == torch.float32 and table64.dtype == F64
    torch.testing.assert_close(table64, table32.double(), atol=1e-6, rtol=1e-6)


def test_rope_gradcheck_float64():
    freqs = float64_freqs(5, HEAD_DIM)
    x = torch.randn(5, 2, HEADS, HEAD_DIM, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rotary_pos_emb(t, freqs, "sbhd"), (x,))


def test_dot_product_attention_gradcheck_float64():
    dpa = tfa.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GROUPS, qkv_format="bshd")
    torch.manual_seed(0)
    q = torch.randn(2, 5, HEADS, HEAD_DIM, dtype=F64)
    k, v = (torch.randn(2, 5, GROUPS, HEAD_DIM, dtype=F64) for _ in range(2))
    gradcheck_module(dpa, q, k, v)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train_p0"])
def test_multihead_attention_gradcheck_float64(training):
    mha = randomized(tfa.MultiheadAttention(
        HIDDEN, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0, input_layernorm=True,
        attn_mask_type="causal", params_dtype=F64, device="cpu"))
    mha.train(training)
    gradcheck_module(mha, torch.randn(4, 2, HIDDEN, dtype=F64), fast_mode=True)


def make_layer(**kwargs):
    args = dict(hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
                num_gqa_groups=GROUPS, hidden_dropout=0.0, attention_dropout=0.0,
                params_dtype=F64, device="cpu")
    args.update(kwargs)
    return randomized(tfa.TransformerLayer(**args))


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train_p0"])
def test_transformer_layer_gradcheck_float64(training):
    layer = make_layer(normalization="RMSNorm", activation="swiglu")
    layer.train(training)
    x = torch.randn(4, 2, HIDDEN, dtype=F64)
    gradcheck_module(layer, x, fast_mode=True, rotary_pos_emb=float64_freqs(4, HEAD_DIM))


class LlamaStack(torch.nn.Module):
    """A small Llama: pre-norm RMSNorm layers with SwiGLU, RoPE and GQA, no biases, and a
    final RMSNorm."""

    def __init__(self, layers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            make_layer(normalization="RMSNorm", activation="swiglu", bias=False,
                       attn_input_format="bshd", self_attn_mask_type="causal")
            for _ in range(layers))
        self.norm = randomized(tfa.RMSNorm(HIDDEN, params_dtype=F64, device="cpu"))

    def forward(self, x, freqs):
        for layer in self.layers:
            x = layer(x, rotary_pos_emb=freqs)
        return self.norm(x)


def llama_reference(model, x):
    """The same stack from the plain float64 formulas of tests/module_reference.py."""
    b, s = x.shape[:2]
    positions = torch.arange(s).expand(b, s)
    for layer in model.layers:
        x = ref.transformer_layer(layer, x, positions=positions)
    return ref.rms_norm(x, model.norm.weight, model.norm.eps)


def test_llama_stack_float64_matches_reference():
    model = LlamaStack()
    x = torch.randn(2, 7, HIDDEN, dtype=F64)
    out = model(x, float64_freqs(7, HEAD_DIM))
    assert out.dtype == F64
    torch.testing.assert_close(out, llama_reference(model, x), atol=1e-12, rtol=1e-12)
