"""pytest plugin for a run of TE's tests against transformer_fa (loaded by run.py with -p).

- installs the import shim (shim/transformer_engine) before the test files import;
- deselects the tests that deselect.py lists, keeping each one's reason;
- fails a test that touched a placeholder while running (it needs a TE feature we lack and
  lacks a deselect rule), so it cannot pass by accident;
- without CUDA: lets TE's module-level RNG reset run, and reports tests that stop at their
  first CUDA call as skipped "needs CUDA" rather than failed;
- writes the outcomes as JSON to $TE_SUITE_REPORT for run.py's summary.
"""
import json
import os

import pytest
import torch

import transformer_engine  # noqa: F401  (installs the shim)
from transformer_engine import _shim
from deselect import find_rule
from reasons import NEEDS_CUDA

_CUDA_MISSING_MESSAGES = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver",
                          "No CUDA GPUs are available")
_outcomes = {}  # nodeid -> {"suite", "outcome", "detail"}


def suite_of(file_name: str) -> str:
    return file_name.removeprefix("test_").removesuffix(".py")


def pytest_configure(config):
    if not torch.cuda.is_available():
        # TE's utils.reset_rng_states() saves and restores the CUDA RNG state at import time.
        # With no CUDA device there is no such state: an empty one stands for it.
        torch.cuda.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)
        torch.cuda.set_rng_state = lambda new_state, device="cuda": None


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Without CUDA, ``.cuda()`` in module-level code (parametrize lists of TE's FP8 tests,
    which deselect.py drops) gives the CPU tensor during collection only."""
    if torch.cuda.is_available():
        yield
        return
    to_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = to_cuda


def pytest_collection_modifyitems(config, items):
    kept, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        rule = find_rule(item.path.name, item.originalname, params)
        if rule is None:
            kept.append(item)
            continue
        dropped.append(item)
        _outcomes[item.nodeid] = {"suite": suite_of(item.path.name), "outcome": "deselected",
                                  "reason": rule.reason, "detail": rule.detail}
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _needs_cuda(excinfo) -> bool:
    return (not torch.cuda.is_available() and excinfo is not None
            and any(m in str(excinfo.value) for m in _CUDA_MISSING_MESSAGES))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "setup":
        _shim.touched.clear()
    outcome = yield
    report = outcome.get_result()
    if report.failed and _needs_cuda(call.excinfo):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"{NEEDS_CUDA}: "
                           f"{call.excinfo.value}")
    elif _shim.touched and report.passed and call.when == "call":
        report.outcome = "failed"
        report.longrepr = ("used TE names that transformer_fa lacks, without a deselect rule: "
                           + ", ".join(sorted(set(_shim.touched))))
    if report.when == "call" or not report.passed:
        _record(item, report)


def _record(item, report):
    entry = _outcomes.setdefault(item.nodeid, {"suite": suite_of(item.path.name)})
    if entry.get("outcome") in ("failed", "skipped"):
        return  # a setup failure or skip already said what happened
    entry["outcome"] = report.outcome
    if report.failed:
        entry["detail"] = _first_line(report)
    elif report.skipped:
        entry["detail"] = (report.longrepr[2] if isinstance(report.longrepr, tuple)
                           else str(report.longrepr))


def _first_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0][:300] if text.strip() else "failed"


def _last_line(report) -> str:
    """The error itself: a collection report's traceback ends with it."""
    lines = [line for line in str(report.longrepr).splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "collection error"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("TE_SUITE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_outcomes, f, indent=1, sort_keys=True)


def pytest_collectreport(report):
    if report.failed:
        _outcomes[report.nodeid] = {"suite": suite_of(os.path.basename(report.nodeid)),
                                    "outcome": "collection error",
                                    "detail": _last_line(report)}
