"""examples/generate.py and benchmarks/bench_generate.py on CUDA (bf16): generation checked
against recomputation, a train_gpt.py checkpoint, sampling, the CUDA-graph decode step."""
import sys
from pathlib import Path

import pytest
import torch

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
