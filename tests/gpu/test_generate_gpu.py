"""examples/generate.py and benchmarks/bench_generate.py on CUDA (bf16): generation checked
against recomputation, a train_gpt.py checkpoint, sampling, the CUDA-graph decode step."""
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import transformer_fa as te

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]
import generate  # noqa: E402
import train_gpt  # noqa: E402
from benchmarks import bench_generate  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOY = ["--device", "cuda", "--train-steps", "20", "--new-tokens", "16", "--no-progress"]


@pytest.mark.parametrize("argv", [[], ["--qkv-format", "sbhd"], ["--paged", "--qkv-format", "thd"],
                                  ["--temperature", "0.8", "--top-k", "5"]])
def test_toy_generation_matches_recomputation(argv):
    seqs, err = generate.main(TOY + argv)  # raises if a step's logits differ
    assert all(len(seq) == len(prompt) + 16
               for seq, prompt in zip(seqs.values(), generate.TOY_PROMPTS))


def test_sampling_on_cuda_is_reproducible():
    argv = TOY + ["--temperature", "1.5", "--top-k", "8", "--seed", "5"]
    assert generate.main(argv)[0] == generate.main(argv)[0]


def test_checkpoint_on_cuda(tmp_path):
    path = tmp_path / "gpt.pt"
    train_gpt.main(["--device", "cuda", "--steps", "20", "--eval-interval", "100",
                    "--sample-chars", "8", "--save", str(path)])
    seqs, _ = generate.main(["--checkpoint", str(path), "--device", "cuda", "--prompt", "THE ",
                             "--prompt", "Once", "--new-tokens", "32", "--no-progress"])
    assert len(seqs[0]) == 4 + 32 and len(seqs[1]) == 4 + 32


def test_bench_on_cuda(tmp_path):
    path = bench_generate.main(["--device", "cuda", "--new-tokens", "16", "--batch-sizes", "1",
                                "8", "--repeats", "1", "--train-steps", "5", "--out-dir",
                                str(tmp_path)])
    assert path.exists() and path.with_suffix(".md").exists()


def test_cuda_graph_decode_equals_eager():
    """The captured and replayed decode step gives the eager step's tokens and logits."""
    model, prompts, _ = generate.build_model(generate.parse_args(TOY))
    results = []
    for graphed in (False, True):
        params = generate.make_params(model, len(prompts), 64, torch.bfloat16,
                                      cuda_graph=graphed)
        results.append(generate.generate(model, prompts, 16, params, cuda_graph=graphed,
                                         progress=False))
    (eager_seqs, eager_logits, _), (graph_seqs, graph_logits, _) = results
    assert graph_seqs == eager_seqs
    for a, b in zip(graph_logits, eager_logits):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("argv", [[], ["--qkv-format", "sbhd"], ["--qkv-format", "thd"],
                                  ["--paged"]], ids=["bshd", "sbhd", "thd", "paged"])
@pytest.mark.parametrize("backend", ["FlashAttention", "FusedAttention"])
def test_decode_step_does_not_wait_for_the_gpu(backend, argv, monkeypatch):
    """pre_step() and an eager decode step only queue GPU work: no host sync (torch's sync
    debug mode raises on one), so the host prepares the next layers while the GPU runs."""
    args = generate.parse_args(TOY + argv)
    fmt = args.qkv_format or "bshd"
    # head dim 64 (cuDNN's smallest is not the toy's 16); the weights need no training
    model = generate.TinyGPT(32, hidden=256, heads=4, gqa=2, layers=2, max_seqlen=64,
                             qkv_format=fmt, device="cuda").eval().to(args.dtype)
    prompts = [list(p) for p in generate.TOY_PROMPTS]
    for name, var in (("FlashAttention", "NVTE_FLASH_ATTN"), ("FusedAttention", "NVTE_FUSED_ATTN"),
                      ("UnfusedDotProductAttention", "NVTE_UNFUSED_ATTN")):
        monkeypatch.setenv(var, "1" if name == backend else "0")
    params = generate.make_params(model, len(prompts), 64, args.dtype, args.paged)
    generate.generate(model, prompts, 4, params, progress=False)  # prefill and 3 steps
    tokens = torch.zeros(len(prompts), dtype=torch.long, device="cuda")
    one_each = OrderedDict((i, 1) for i in range(len(prompts)))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            params.pre_step(one_each)
            model(generate.one_token_input(tokens, fmt), inference_params=params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ran = {m.last_backend for m in model.modules() if isinstance(m, te.DotProductAttention)}
    assert ran == {backend}
