"""TE's own examples, run with `import transformer_fa as te`.

The user code below follows TE's docs/examples (the quickstart notebook's TransformerLayer
cells and quickstart_utils.share_parameters_with_transformerlayer_te_model; te_llama.py's
TELlamaDecoderLayer) with only the changes TE hard-codes: CUDA becomes the CPU, float16
becomes float32, and the sizes are small. Everything else is as a TE user writes it.
"""
import pytest
import torch

import transformer_fa as te
from transformer_fa.attention import RotaryPositionEmbedding
from transformer_fa.common.recipe import DelayedScaling, Format

# quickstart's configuration, scaled down
hidden_size = 64
sequence_length = 16
batch_size = 2
ffn_hidden_size = 256
num_attention_heads = 4
dtype = torch.float32
device = "cpu"


class BasicMLP(torch.nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size):
        super().__init__()
        self.linear1 = torch.nn.Linear(hidden_size, ffn_hidden_size, bias=True)
        self.linear2 = torch.nn.Linear(ffn_hidden_size, hidden_size, bias=True)

    def forward(self, x):
        x = self.linear1(x)
        x = torch.nn.functional.gelu(x, approximate="tanh")
        return self.linear2(x)


class BasicTransformerLayer(torch.nn.Module):
    """The quickstart's plain PyTorch layer (its attention written with torch SDPA)."""

    def __init__(self, hidden_size, ffn_hidden_size, num_attention_heads, layernorm_eps=1e-5):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.kv_channels = hidden_size // num_attention_heads
        self.ln1 = torch.nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.qkv_projection = torch.nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.projection = torch.nn.Linear(hidden_size, hidden_size, bias=True)
        self.ln2 = torch.nn.LayerNorm(hidden_size, eps=layernorm_eps)
        self.mlp = BasicMLP(hidden_size, ffn_hidden_size)

    def forward(self, x, attention_mask):
        res = x
        x = self.ln1(x)
        qkv = self.qkv_projection(x)
        qkv = qkv.view(qkv.size(0), qkv.size(1), self.num_attention_heads, 3 * self.kv_channels)
        q, k, v = torch.split(qkv, qkv.size(3) // 3, dim=3)
        # [s, b, h, d] -> [b, h, s, d]; causal, as te.TransformerLayer's default mask
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        x = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x.permute(2, 0, 1, 3).reshape(res.shape)
        x = res + self.projection(x)
        res = x
        return res + self.mlp(self.ln2(x))


def share_parameters_with_transformerlayer_te_model(te_model, basic_model):
    te_model.self_attention.layernorm_qkv.layer_norm_weight = basic_model.ln1.weight
    te_model.self_attention.layernorm_qkv.layer_norm_bias = basic_model.ln1.bias
    te_model.self_attention.layernorm_qkv.weight = basic_model.qkv_projection.weight
    te_model.self_attention.layernorm_qkv.bias = basic_model.qkv_projection.bias
    te_model.self_attention.proj.weight = basic_model.projection.weight
    te_model.self_attention.proj.bias = basic_model.projection.bias
    te_model.layernorm_mlp.layer_norm_weight = basic_model.ln2.weight
    te_model.layernorm_mlp.layer_norm_bias = basic_model.ln2.bias
    te_model.layernorm_mlp.fc1_weight = basic_model.mlp.linear1.weight
    te_model.layernorm_mlp.fc1_bias = basic_model.mlp.linear1.bias
    te_model.layernorm_mlp.fc2_weight = basic_model.mlp.linear2.weight
    te_model.layernorm_mlp.fc2_bias = basic_model.mlp.linear2.bias


def test_quickstart_transformer_layer():
    torch.manual_seed(1234)
    x = torch.rand(sequence_length, batch_size, hidden_size).to(device).to(dtype=dtype)
    dy = torch.rand(sequence_length, batch_size, hidden_size).to(device).to(dtype=dtype)
    basic_transformer = BasicTransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads)
    basic_transformer.to(dtype=dtype).to(device)

    # The quickstart's cells: build with TE's defaults (device="cuda" there), share the
    # plain layer's weights, run forward and backward. (With fuse_qkv_params=False, TE's
    # default, `layernorm_qkv.weight` is a new attribute the layer does not read, in TE too.)
    te_transformer = te.TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads,
                                         device=device)
    te_transformer.to(dtype=dtype).to(device)
    share_parameters_with_transformerlayer_te_model(te_transformer, basic_transformer)
    torch.manual_seed(1234)
    y = te_transformer(x, attention_mask=None)
    y.backward(dy)
    assert y.shape == x.shape
    assert basic_transformer.mlp.linear1.weight.grad is not None  # shared Parameters

    # With the fused QKV weight the sharing is complete: TE's interleaved per-head q, k, v
    # is the quickstart's view(s, b, h, 3 * d) split, so the two layers compute the same.
    fused = te.TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads,
                                fuse_qkv_params=True, device=device)
    share_parameters_with_transformerlayer_te_model(fused, basic_transformer)
    fused.eval()  # dropout (0.1 by default) off for the comparison
    torch.testing.assert_close(fused(x, attention_mask=None),
                               basic_transformer(x, attention_mask=None), atol=1e-4, rtol=1e-4)

    # speedometer's loop, with autocast_kwargs={"enabled": False}
    te_transformer.train()
    with te.autocast(enabled=False):
        output = te_transformer(x, attention_mask=None)
    output.backward(dy)

    # The FP8 cell builds a recipe; running it needs FP8, which is named in the error.
    fp8_format = Format.HYBRID
    fp8_recipe = DelayedScaling(fp8_format=fp8_format, amax_history_len=16,
                                amax_compute_algo="max")
    with pytest.raises(ValueError, match="FP8"):
        with te.autocast(enabled=True, recipe=fp8_recipe):
            te_transformer(x, attention_mask=None)


class LlamaConfig:
    """The fields of Hugging Face's LlamaConfig that te_llama.py reads (small values)."""

    hidden_size = 64
    intermediate_size = 128
    num_attention_heads = 4
    num_key_value_heads = 2
    rms_norm_eps = 1e-5
    max_position_embeddings = 32


class TELlamaDecoderLayer(te.TransformerLayer):
    """te_llama.py's wrapper (there: `te.pytorch.TransformerLayer` and `.cuda()`)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(
            hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size,
            num_attention_heads=config.num_attention_heads,
            bias=False,
            layernorm_epsilon=config.rms_norm_eps,
            hidden_dropout=0,
            attention_dropout=0,
            fuse_qkv_params=False,
            normalization="RMSNorm",
            activation="swiglu",
            attn_input_format="bshd",
            num_gqa_groups=config.num_key_value_heads,
            device=device,
        )
        te_rope = RotaryPositionEmbedding(config.hidden_size // config.num_attention_heads)
        self.te_rope_emb = te_rope(max_seq_len=config.max_position_embeddings).to(device)

    def forward(self, hidden_states, *args, attention_mask, **kwargs):
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
        return super().forward(
            hidden_states, attention_mask=attention_mask, rotary_pos_emb=self.te_rope_emb
        )


def test_te_llama_decoder_layer():
    torch.manual_seed(0)
    config = LlamaConfig()
    layers = torch.nn.ModuleList(TELlamaDecoderLayer(config, i) for i in range(2))
    x = torch.randn(2, 10, config.hidden_size, requires_grad=True)
    # Hugging Face hands the decoder its own causal mask (an additive float mask here) or
    # None: with TE's default self_attn_mask_type="causal" the layer does not read it.
    hf_mask = torch.triu(torch.full((10, 10), float("-inf")), 1).view(1, 1, 10, 10)
    h = x
    for decoder in layers:
        h = decoder(h, None, attention_mask=hf_mask, position_ids=None, use_cache=False)
    h.square().mean().backward()
    assert h.shape == x.shape and torch.isfinite(x.grad).all()
    torch.testing.assert_close(layers[0](x, attention_mask=None),
                               layers[0](x, attention_mask=hf_mask))
    # causal: a later token does not change an earlier one's output
    y = x.detach().clone()
    y[:, -1] += 1.0
    torch.testing.assert_close(layers[0](y, attention_mask=None)[:, :-1],
                               layers[0](x.detach(), attention_mask=None)[:, :-1])
