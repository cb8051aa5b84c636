"""tools/te_suite (running TE's own tests against transformer_fa) and transformer_fa.utils.

The runner is exercised on a small synthetic TE-like checkout, so CI tests it without TE's
repository; with TE_REPO pointing at a TE checkout, the real numerics suite runs on CPU too.
"""
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import transformer_fa as tfa
import transformer_fa.utils as tfa_utils

TOOLS = Path(__file__).resolve().parent.parent / "tools" / "te_suite"
sys.path.insert(0, str(TOOLS))
import deselect  # noqa: E402
import reasons  # noqa: E402
import run as te_run  # noqa: E402

SYNTHETIC_UTILS = '''
import torch
from transformer_engine.pytorch.attention.dot_product_attention.utils import (
    check_set_window_size,
)


def reset_rng_states():
    torch.manual_seed(1234)
    torch.cuda.manual_seed(1234)
    torch.cuda.set_rng_state(torch.cuda.get_rng_state())
'''

SYNTHETIC_NUMERICS = '''
import pytest
import torch
import transformer_engine_torch as tex
from transformer_engine.common import recipe
from transformer_engine.pytorch import LayerNorm, Float8Quantizer, DType, is_fp8_available
from transformer_engine.pytorch import autocast
from transformer_engine.pytorch.utils import init_method_normal
from transformer_engine.pytorch.quantization import FP8GlobalStateManager
from utils import reset_rng_states, check_set_window_size

reset_rng_states()  # at import time, as TE's suites do
fp8_available, reason = is_fp8_available(return_reason=True)
quantizers = [Float8Quantizer(scale=torch.ones(1).cuda(), fp8_dtype=DType.kFloat8E4M3)]


@pytest.fixture(autouse=True)
def reset_global_fp8_state():
    yield
    FP8GlobalStateManager.reset()


def test_layernorm_matches_torch():
    ln = LayerNorm(8, eps=1e-5, params_dtype=torch.float32, device="cpu")
    x = torch.randn(3, 8)
    with autocast(enabled=False):
        out = ln(x)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (8,), eps=1e-5))


def test_window_for_causal():
    assert check_set_window_size("causal", None) == (-1, 0)


@pytest.mark.parametrize("quantizer", quantizers)
def test_gpt_fp8_parameters(quantizer):
    tex.quantize(quantizer)


def test_uses_te_extension_without_rule():
    tex.quantize(torch.ones(1))


def test_needs_cuda():
    torch.ones(1, device="cuda")


def test_wrong_result():
    assert init_method_normal(1.0)(torch.zeros(4)).abs().sum() < 0
'''

SYNTHETIC_ATTENTION = '''
from transformer_engine.pytorch import NoSuchTEName
'''


def _write_checkout(root: Path) -> Path:
    files = {"tests/pytorch/utils.py": SYNTHETIC_UTILS,
             "tests/pytorch/test_numerics.py": SYNTHETIC_NUMERICS,
             "tests/pytorch/attention/test_attention.py": SYNTHETIC_ATTENTION}
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))
    return root


def _by_test(outcomes):
    return {nodeid.split("::")[-1]: entry for nodeid, entry in outcomes.items()}


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    te_repo = _write_checkout(tmp_path_factory.mktemp("te"))
    code, outcomes = te_run.run(te_repo, ["numerics", "attention"], ["-q", "-p", "no:warnings"])
    return code, outcomes


def test_runner_passes_a_test_that_only_changed_its_import(synthetic_run):
    tests = _by_test(synthetic_run[1])
    assert tests["test_layernorm_matches_torch"]["outcome"] == "passed"
    assert tests["test_window_for_causal"]["outcome"] == "passed"


def test_runner_deselects_by_rule_with_reason(synthetic_run):
    entry = _by_test(synthetic_run[1])["test_gpt_fp8_parameters[quantizer0]"]
    assert entry["outcome"] == "deselected"
    assert entry["reason"] == "FP8"


def test_runner_fails_a_test_that_uses_a_missing_te_name(synthetic_run):
    entry = _by_test(synthetic_run[1])["test_uses_te_extension_without_rule"]
    assert entry["outcome"] == "failed"
    assert "transformer_engine_torch.quantize" in entry["detail"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report without CUDA")
def test_runner_reports_cuda_tests_as_skipped_without_cuda(synthetic_run):
    entry = _by_test(synthetic_run[1])["test_needs_cuda"]
    assert entry["outcome"] == "skipped"
    assert entry["detail"].startswith("needs CUDA")


def test_runner_reports_real_failures_and_unmapped_imports(synthetic_run):
    code, outcomes = synthetic_run
    assert code != 0
    assert _by_test(outcomes)["test_wrong_result"]["outcome"] == "failed"
    errors = [e for e in outcomes.values() if e["outcome"] == "collection error"]
    assert len(errors) == 1 and errors[0]["suite"] == "attention"
    assert "NoSuchTEName" in errors[0]["detail"]


def test_runner_summary_counts_per_suite(synthetic_run):
    counts = te_run.summarize(synthetic_run[1])
    # test_needs_cuda passes where CUDA is (else it is reported as skipped)
    assert counts["numerics"]["passed"] == (3 if torch.cuda.is_available() else 2)
    assert counts["numerics"]["deselected (FP8)"] == 1
    assert counts["attention"]["collection error"] == 1
    text = te_run.format_summary(synthetic_run[1])
    assert "numerics: " in text and "test_wrong_result" in text


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_runner_reads_suite_files_from_a_git_dir(tmp_path):
    work = _write_checkout(tmp_path / "work")
    git = ["git", "-C", str(work), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "synthetic"], check=True)
    (work / "tests/pytorch/utils.py").unlink()  # only the git dir has it now
    assert "check_set_window_size" in te_run.read_te_file(work / ".git", "tests/pytorch/utils.py")
    with pytest.raises(FileNotFoundError, match="tests/pytorch/nothing.py"):
        te_run.read_te_file(work / ".git", "tests/pytorch/nothing.py")


def test_deselect_rule_matches_file_function_and_params():
    rule = deselect.Rule("test_numerics.py::test_x*", "FP8", "why", params={"fp8": True})
    assert rule.matches("test_numerics.py", "test_xy", {"fp8": True, "bs": 1})
    assert not rule.matches("test_numerics.py", "test_xy", {"fp8": False})
    assert not rule.matches("test_attention.py", "test_xy", {"fp8": True})
    assert all(r.reason in reasons.ALL for r in deselect.RULES)


@pytest.mark.skipif(not os.environ.get("TE_REPO"), reason="set TE_REPO to a TE checkout")
def test_real_te_numerics_suite_collects_and_runs_on_cpu():
    code, outcomes = te_run.run(Path(os.environ["TE_REPO"]), ["numerics"],
                                ["-q", "-p", "no:warnings"])
    assert outcomes
    assert not [n for n, e in outcomes.items() if e["outcome"] == "collection error"]
    # every test that needs a missing TE feature has its deselect rule
    assert not [n for n, e in outcomes.items() if "without a deselect rule" in e.get("detail", "")]


# --- transformer_fa.utils -------------------------------------------------------------------

def test_init_method_normal_std():
    torch.manual_seed(0)
    w = tfa_utils.init_method_normal(0.5)(torch.empty(200_000))
    assert abs(w.std().item() - 0.5) < 0.01
    w = tfa_utils.scaled_init_method_normal(0.5, 8)(torch.empty(200_000))
    assert abs(w.std().item() - 0.5 / math.sqrt(16)) < 0.005
    with pytest.raises(ValueError, match="num_layers"):
        tfa_utils.scaled_init_method_normal(0.5, 0)
    with pytest.raises(ValueError, match="sigma"):
        tfa_utils.init_method_normal(-1.0)


def test_attention_mask_func_fills_masked_positions():
    scores = torch.zeros(2, 2)
    mask = torch.tensor([[False, True], [False, False]])
    out = tfa_utils.attention_mask_func(scores, mask)
    assert out[0, 1] == -10000.0 and out[0, 0] == 0 and out is scores
    with pytest.raises(TypeError, match="attention_mask"):
        tfa_utils.attention_mask_func(scores, mask.int())


def test_fp8_queries_and_contexts():
    for query in (tfa.is_mxfp8_available, tfa.is_fp8_block_scaling_available,
                  tfa.is_nvfp4_available):
        assert query() is False
        assert query(return_reason=True) == (
            False, "transformer_fa implements only the per-tensor FP8 recipes")
    with tfa.autocast(enabled=False), tfa.quantized_model_init(enabled=True):
        pass  # parameters stay high precision
    if not tfa.is_fp8_available():
        with pytest.raises(ValueError, match="FP8"):
            with tfa.autocast():  # TE's default turns FP8 on
                pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answers without CUDA")
def test_device_queries_without_cuda():
    assert tfa_utils.get_device_compute_capability() == (0, 0)
    assert tfa_utils.is_bf16_available(return_reason=True) == (False, "no CUDA device")


def test_get_cudnn_version_is_a_version_tuple():
    version = tfa_utils.get_cudnn_version()
    assert isinstance(version, tuple) and len(version) == 3
    assert all(isinstance(v, int) for v in version)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint_matches_plain_forward_and_backward(use_reentrant):
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.5), torch.nn.Tanh())
    x = torch.randn(4, 6, requires_grad=True)
    scale = torch.tensor(2.0)

    def body(inp, scale=None):
        return layer(inp) * scale

    torch.manual_seed(1)
    ref = body(x, scale=scale)
    ref.sum().backward()
    ref_grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    torch.manual_seed(1)
    out = tfa.checkpoint(body, x, scale=scale, use_reentrant=use_reentrant)
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    for got, want in zip([x.grad] + [p.grad for p in layer.parameters()], ref_grads):
        torch.testing.assert_close(got, want)


def test_checkpoint_rejects_parallel_arguments_and_grad_kwargs():
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="distribute_saved_activations"):
        tfa.checkpoint(torch.sin, x, distribute_saved_activations=True)
    with pytest.raises(ValueError, match="'other'"):
        tfa.checkpoint(torch.add, x, other=x, use_reentrant=True)
