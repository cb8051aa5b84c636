"""examples/generate.py (checkpoints, sampling, the CUDA-graph plan cache) and
benchmarks/bench_generate.py (the plain PyTorch model, the smoke run) on the CPU."""
import json
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]
import generate  # noqa: E402
import train_gpt  # noqa: E402
from benchmarks import bench_generate  # noqa: E402

TINY_TRAIN = ["--device", "cpu", "--steps", "2", "--hidden-size", "32", "--layers", "1",
              "--seq-len", "16", "--batch-size", "4", "--eval-interval", "100",
              "--sample-chars", "4"]
TOY = ["--train-steps", "2", "--new-tokens", "6", "--no-progress"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt") / "gpt.pt"
    train_gpt.main(TINY_TRAIN + ["--save", str(path), "--normalization", "RMSNorm"])
    return path


def test_checkpoint_round_trip(checkpoint):
    saved = torch.load(checkpoint, weights_only=True)
    gpt, tokenizer = train_gpt.load_checkpoint(checkpoint, torch.device("cpu"))
    assert saved["config"]["hidden_size"] == 32 and saved["config"]["layers"] == 1
    for name, value in gpt.state_dict().items():
        assert torch.equal(value, saved["model"][name]), name
    seqs, err = generate.main(["--checkpoint", str(checkpoint), "--prompt", "THE ",
                               "--prompt", "A fox", "--new-tokens", "5", "--no-progress"])
    assert tokenizer.decode(seqs[0]).startswith("THE ") and len(seqs[0]) == 4 + 5
    assert tokenizer.decode(seqs[1]).startswith("A fox") and len(seqs[1]) == 5 + 5
    assert err < 1e-4


def test_checkpoint_prompt_and_format_errors(checkpoint):
    with pytest.raises(ValueError, match="--prompt 'TH@' must be non-empty text in the "
                                         "checkpoint's vocab"):
        generate.main(["--checkpoint", str(checkpoint), "--prompt", "TH@", "--no-progress"])
    with pytest.raises(ValueError, match="--qkv-format thd: the checkpoint's model was built "
                                         "for bshd"):
        generate.main(["--checkpoint", str(checkpoint), "--qkv-format", "thd"])
    with pytest.raises(ValueError, match="--prompt needs --checkpoint"):
        generate.main(TOY + ["--prompt", "x"])


def test_save_needs_whole_weights():
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--save", "x.pt", "--tp", "2"])


@pytest.mark.parametrize("argv", [["--qkv-format", "sbhd"], ["--paged", "--qkv-format", "thd"]])
def test_sampling_is_reproducible_and_checked(argv):
    sampled = TOY + argv + ["--temperature", "2.0", "--top-k", "8"]
    first, err = generate.main(sampled + ["--seed", "3"])
    assert err < 1e-4
    assert generate.main(sampled + ["--seed", "3"])[0] == first
    assert generate.main(sampled + ["--seed", "4"])[0] != first  # the seed draws the tokens


def test_temperature_zero_is_greedy():
    greedy, _ = generate.main(TOY)
    assert generate.main(TOY + ["--temperature", "0", "--top-k", "3", "--seed", "9"])[0] == greedy
    logits = torch.randn(16, 32)
    assert torch.equal(generate.sample(logits, 0.0, 5), logits.argmax(-1))


def test_top_k_stays_in_the_top_k():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen)
    top = logits.topk(3, dim=-1).indices
    seen = torch.zeros(64, 50, dtype=torch.bool)
    for _ in range(50):  # a high temperature: almost uniform over what is allowed
        tokens = generate.sample(logits, 100.0, 3, gen)
        seen[torch.arange(64), tokens] = True
    allowed = torch.zeros_like(seen).scatter_(1, top, True)
    assert not (seen & ~allowed).any()
    assert seen.sum(1).eq(3).all()  # every one of the k is drawn
    assert generate.sample(logits, 100.0, 0, gen).ne(logits.argmax(-1)).any()
    assert generate.sample(logits, 1.0, 500, gen).shape == (64,)  # k above the vocab: all


def test_bad_sampling_arguments():
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        generate.sample(torch.zeros(1, 4), -1.0)
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        generate.sample(torch.zeros(1, 4), 1.0, -2)
    with pytest.raises(SystemExit):
        generate.parse_args(["--top-k", "-1"])


def test_cuda_graph_needs_cuda():
    with pytest.raises(SystemExit):
        generate.parse_args(["--cuda-graph"])
    with pytest.raises(SystemExit):
        generate.parse_args(["--cuda-graph", "--device", "cuda", "--paged"])
    model = generate.TinyGPT(32, 16, 2, 1, 1, 16, "bshd", "cpu")
    params = generate.make_params(model, 1, 8, torch.float32, cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph needs the model on a CUDA device"):
        generate.generate(model, [[1, 2]], 3, params, cuda_graph=True)


def test_static_plan_cache_keeps_addresses_and_follows_the_plan():
    """What a captured decode step reads: the same tensors every step, holding that step's
    write rows (the plain manager makes new tensors each step)."""
    model = generate.TinyGPT(32, 16, 2, 1, 1, 16, "bshd", "cpu")
    static = generate.make_params(model, 2, 8, torch.float32, cuda_graph=True)
    plain = generate.make_params(model, 2, 8, torch.float32)
    static.pre_step(OrderedDict({0: 3, 1: 2}))
    plain.pre_step(OrderedDict({0: 3, 1: 2}))
    addresses = None
    for _ in range(3):
        for params in (static, plain):
            params.pre_step(OrderedDict({0: 1, 1: 1}))
        manager = static.cache_manager
        now = [getattr(manager, n).data_ptr() for n in generate.StaticPlanCache.PLAN]
        assert addresses in (None, now)
        addresses = now
        for name in generate.StaticPlanCache.PLAN:
            assert torch.equal(getattr(manager, name), getattr(plain.cache_manager, name))


def test_plain_model_matches_transformer_fa():
    """The benchmark's plain PyTorch model on both generate.py models: train_gpt's GPT
    (RMSNorm, SwiGLU, fused interleaved QKV, no bias, tied head) and the toy one (LayerNorm,
    GELU, separate Q/K/V with bias); a changed weight is caught."""
    torch.manual_seed(0)
    gpt = train_gpt.GPT(40, 32, 2, 4, 2, 16, "sbhd", "RMSNorm", 0.0, torch.device("cpu"))
    for model in (generate.CheckpointGPT(gpt.eval(), 24),
                  generate.TinyGPT(32, 32, 4, 2, 2, 24, "bshd", "cpu").eval()):
        plain = bench_generate.PlainGPT(model)
        assert bench_generate.check_plain_matches(model, plain, [[1, 2, 3], [4, 5]], 8) < 1e-5
        weight, bias = plain.blocks[-1].proj
        plain.blocks[-1].proj = (weight * 1.01, bias)
        with pytest.raises(AssertionError, match="plain PyTorch logits differ"):
            bench_generate.check_plain_matches(model, plain, [[1, 2, 3], [4, 5]], 8)


def test_bench_smoke_run(tmp_path):
    path = bench_generate.main(["--device", "cpu", "--new-tokens", "4", "--batch-sizes", "1",
                                "2", "--repeats", "1", "--train-steps", "1", "--out-dir",
                                str(tmp_path)])
    data = json.loads(path.read_text())
    assert {"device", "date", "torch", "dtype", "max_logit_difference", "rows"} <= set(data)
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    for row in data["rows"]:
        for name in ("transformer_fa", "plain_sdpa_cat"):
            assert row[name]["decode_tokens_per_s"] > 0
    assert "| 2 | 4 |" in path.with_suffix(".md").read_text()
