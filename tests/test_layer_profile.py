"""benchmarks/profile_layer.py on CPU, and the layer's memory that it measures: the tensors one
TransformerLayer saves for its backward, against the same block in plain PyTorch."""
import copy
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import profile_layer  # noqa: E402
from benchmarks.bench_attention import PRESETS, TorchBlock, tfa_layer  # noqa: E402

from transformer_fa import Linear  # noqa: E402
from transformer_fa.module.linear import join_rows  # noqa: E402

SAVED_KEYS = {"activation_bytes", "attention_bytes", "rest_bytes", "parameter_bytes",
              "pack_calls", "storages", "tensors"}


def test_tiny_profile_on_cpu(tmp_path):
    path = profile_layer.main(["--preset", "tiny", "--device", "cpu", "--steps", "1",
                               "--out-dir", str(tmp_path)])
    data = json.loads(path.read_text())
    assert path.name == "layer-profile-cpu-tiny.json"
    assert data["time"] == "CPU op self time" and data["steps"] == 1
    assert [m["model"] for m in data["models"]] == list(profile_layer.MODELS)
    for m in data["models"]:
        assert list(m["categories"]) == list(profile_layer.CATEGORIES)
        assert m["total_ms_per_step"] > 0 and m["tokens_per_s"] > 0
        assert m["peak_mem_gb"] is None  # CUDA only
        busy = [c for c in m["categories"].values() if c["ms_per_step"] > 0]
        assert busy and all(c["top"] and c["top"][0]["ms_per_step"] > 0 for c in busy)
        assert m["categories"]["GEMM"]["ms_per_step"] > 0
        assert m["categories"]["optimizer"]["ms_per_step"] > 0
        saved = m["saved_per_layer"]
        assert set(saved) == SAVED_KEYS
        assert saved["activation_bytes"] == saved["attention_bytes"] + saved["rest_bytes"] > 0
        assert saved["storages"] == len(saved["tensors"]) <= saved["pack_calls"]
    ours = data["models"][0]
    assert ours["attn_backend"] == "UnfusedDotProductAttention"
    # DotProductAttention's ops are filed under attention, whatever they are
    assert ours["categories"]["attention fwd"]["ms_per_step"] > 0
    md = path.with_suffix(".md").read_text()
    assert md.startswith("## Layer profile")
    assert "Run: `python benchmarks/profile_layer.py --preset tiny" in md
    assert "| norm |" in md and "| of which the rest |" in md


@pytest.mark.parametrize("kernel, chain, category", [
    ("void transformer_fa::flash::sm90::fwd_kernel<Cfg>(Params)", ["_FlashAttnFunction"],
     "attention fwd"),
    ("void transformer_fa::flash::sm80::bwd_kernel<Tr>(BwdParams, int)",
     ["_FlashAttnFunctionBackward", "autograd::engine::evaluate_function: "
      "_FlashAttnFunctionBackward"], "attention bwd"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>(Flash_fwd_params)",
     ["aten::_flash_attention_forward", "aten::scaled_dot_product_attention"],
     "attention fwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7", ["aten::_scaled_dot_product_cudnn_"
                                                      "attention_backward"], "attention bwd"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", ["aten::mm", "aten::matmul",
                                                    "aten::linear"], "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", ["aten::addmm"], "GEMM"),
    ("void at::native::vectorized_layer_norm_kernel<c10::BFloat16, float>",
     ["aten::native_layer_norm", "aten::layer_norm"], "norm"),
    ("void at::native::GammaBetaBackwardCUDAKernel<c10::BFloat16, float>",
     ["aten::native_layer_norm_backward", "NativeLayerNormBackward0"], "norm"),
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>",
     ["aten::copy_", "aten::_to_copy", "aten::to"], "copies/layout"),
    ("void at::native::CatArrayBatchedCopy<...>", ["aten::cat"], "copies/layout"),
    ("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>", ["aten::gelu"],
     "elementwise/activation"),
    ("void at::native::multi_tensor_apply_kernel<...>",
     ["aten::_foreach_add_", "Optimizer.step#AdamW.step"], "optimizer"),
    ("cutlass::device_kernel<GemmUniversal<SM90_TMA_LOAD, DefaultCopy>>", ["aten::mm"],
     "GEMM"),
    ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>",
     ["aten::copy_", "aten::contiguous", "DotProductAttention"], "attention fwd"),
    ("void some_kernel<...>", [], "other"),
])
def test_kernels_are_filed_by_name_and_launching_ops(kernel, chain, category):
    assert profile_layer.categorize(kernel, chain) == category


def _saved(block, dtype):
    layers, b, s, hidden, heads, ffn, _ = PRESETS["tiny"].layer
    torch.manual_seed(0)
    x = torch.randn(b, s, hidden, dtype=dtype, requires_grad=True)
    return profile_layer.saved_tensors(block(hidden, heads, ffn, dtype, "cpu"), x)


def test_layer_saves_no_more_than_the_torch_block():
    """The benchmark's layer keeps no more for its backward than the same block in plain
    PyTorch, outside the core attention (on CPU the unfused backend keeps its score matrices
    where SDPA's CPU kernel does not; on GPU both run flash kernels: tests/gpu). It used to
    keep a copy of the q, k and v weights concatenated."""
    ours, torch_block = _saved(tfa_layer, torch.float32), _saved(TorchBlock, torch.float32)
    assert ours["rest_bytes"] <= torch_block["rest_bytes"], (ours["tensors"],
                                                             torch_block["tensors"])
    # Every weight a GEMM keeps is a parameter, not a copy of one.
    assert ours["parameter_bytes"] == torch_block["parameter_bytes"]


def test_saved_tensors_counts_a_storage_once_and_parameters_apart():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x) * x  # x saved by the linear and by the product

    saved = profile_layer.saved_tensors(Twice(), x)
    assert saved["pack_calls"] == 4 and saved["storages"] == 3
    assert saved["activation_bytes"] == 2 * 4 * 8 * 4  # x and lin's output, once each
    assert saved["parameter_bytes"] == 8 * 8 * 4
    assert saved["attention_bytes"] == 0


def test_split_linear_joins_its_weights_without_a_copy():
    torch.manual_seed(0)
    lin = Linear(16, 24, parameters_split=("query", "key", "value"), device="cpu")
    weight = lin.full_weight()
    assert weight.data_ptr() == lin.query_weight.data_ptr()
    assert lin.full_bias().data_ptr() == lin.query_bias.data_ptr()
    # Moved apart (a deep copy holds each parameter on its own): torch.cat, same results.
    apart = copy.deepcopy(lin)
    assert apart.full_weight().data_ptr() != apart.query_weight.data_ptr()
    x = torch.randn(3, 16)
    g = torch.randn(3, 24)
    lin(x).backward(g)
    apart(x).backward(g)
    assert torch.equal(lin(x), apart(x))
    for name in ("query_weight", "key_weight", "value_weight", "query_bias", "value_bias"):
        assert torch.equal(getattr(lin, name).grad, getattr(apart, name).grad), name
    assert torch.equal(lin.query_weight.grad, (g.T @ x)[:8])


def test_join_rows_copies_parts_out_of_order():
    buffer = torch.arange(12.0).view(6, 2)
    first, second = buffer[:3], buffer[3:]
    joined = join_rows([second, first])
    assert torch.equal(joined, torch.cat([second, first]))
    assert joined.data_ptr() != buffer.data_ptr()
    assert join_rows([first, second]).data_ptr() == buffer.data_ptr()


def test_split_linear_stays_one_buffer_after_to():
    torch.manual_seed(0)
    lin = Linear(16, 24, parameters_split=("query", "key", "value"), device="cpu")
    key = lin.key_weight
    expected = lin.full_weight().detach().double()
    lin.to(torch.float64)
    assert lin.key_weight is key  # the same parameters (an optimizer's references hold)
    assert lin.full_weight().data_ptr() == lin.query_weight.data_ptr()
    assert lin.full_bias().data_ptr() == lin.query_bias.data_ptr()
    assert torch.equal(lin.full_weight(), expected)
