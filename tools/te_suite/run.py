"""Run TransformerEngine's own tests against transformer_fa, changing only the imports.

    python tools/te_suite/run.py --te-repo <TE work tree or git dir> [--suite numerics|attention]
                                 [--rev HEAD] [--keep DIR] [pytest args...]

Copies the suite files (and their helper tests/pytorch/utils.py) from the TE checkout into a
temporary directory, runs pytest on them with the import shim (shim/transformer_engine) first
on the path and the plugin te_suite_plugin (deselect.py's rules, CPU handling, the report),
then prints passed / failed / skipped / deselected counts per suite. TE's test code is read
from the checkout at run time; this repo does not vendor it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
from reasons import NEEDS_CUDA  # noqa: E402

SUITES = {
    "numerics": "tests/pytorch/test_numerics.py",
    "attention": "tests/pytorch/attention/test_attention.py",
}
HELPERS = ("tests/pytorch/utils.py",)


def read_te_file(te_repo: Path, path: str, rev: str = "HEAD") -> str:
    """A file of the TE checkout: from the work tree, else from the git dir at ``rev``."""
    in_tree = te_repo / path
    if in_tree.is_file():
        return in_tree.read_text()
    result = subprocess.run(["git", f"--git-dir={te_repo}", "show", f"{rev}:{path}"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise FileNotFoundError(f"{path} is neither in the work tree {te_repo} nor at {rev} "
                                f"in it as a git dir: {result.stderr.strip()}")
    return result.stdout


def copy_suite(te_repo: Path, suites, dest: Path, rev: str = "HEAD") -> list[Path]:
    """Writes the suites' files and helpers under ``dest`` (TE's relative paths); returns the
    test files."""
    tests = []
    for path in [SUITES[s] for s in suites] + list(HELPERS):
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(read_te_file(te_repo, path, rev))
        if path in SUITES.values():
            tests.append(target)
    (dest / "pytest.ini").write_text("[pytest]\n")  # pins rootdir: no outside config applies
    return tests


def pytest_command(test_files, pytest_args) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "te_suite_plugin", "-p", "no:cacheprovider",
            "--continue-on-collection-errors",
            *map(str, test_files), *pytest_args]


def pytest_env(report_path: Path) -> dict:
    env = dict(os.environ)
    path = [str(HERE / "shim"), str(HERE), str(REPO_ROOT)]
    if env.get("PYTHONPATH"):
        path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["TE_SUITE_REPORT"] = str(report_path)
    return env


def run(te_repo: Path, suites, pytest_args, rev: str = "HEAD", workdir: Path | None = None):
    """Runs the suites; returns (pytest exit code, outcomes by test id)."""
    with tempfile.TemporaryDirectory(prefix="te_suite_") as tmp:
        root = workdir or Path(tmp)
        tests = copy_suite(te_repo, suites, root, rev)
        report = root / "te_suite_report.json"
        code = subprocess.run(pytest_command(tests, pytest_args), cwd=root,
                              env=pytest_env(report)).returncode
        outcomes = json.loads(report.read_text()) if report.exists() else {}
    return code, outcomes


def summarize(outcomes: dict) -> dict:
    """Counts per suite: passed / failed / skipped / deselected by reason."""
    out = {}
    for entry in outcomes.values():
        counts = out.setdefault(entry["suite"], Counter())
        key = entry["outcome"]
        if key == "deselected":
            key = f"deselected ({entry['reason']})"
        elif key == "skipped" and entry.get("detail", "").startswith(NEEDS_CUDA):
            key = f"skipped ({NEEDS_CUDA})"
        counts[key] += 1
    return out


def format_summary(outcomes: dict) -> str:
    lines = []
    for suite, counts in sorted(summarize(outcomes).items()):
        lines.append(f"{suite}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    failed = sorted((nid, e.get("detail", "")) for nid, e in outcomes.items()
                    if e["outcome"] in ("failed", "collection error"))
    if failed:
        lines.append("failures:")
        lines += [f"  {nid}: {detail}" for nid, detail in failed]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--te-repo", required=True, type=Path,
                        help="TransformerEngine work tree, or its git dir (bare or .git)")
    parser.add_argument("--suite", choices=sorted(SUITES), action="append",
                        help="suite to run (repeatable; default: all)")
    parser.add_argument("--rev", default="HEAD", help="revision, when --te-repo is a git dir")
    parser.add_argument("--keep", type=Path, help="write the copied files here and keep them")
    args, pytest_args = parser.parse_known_args(argv)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    code, outcomes = run(args.te_repo, args.suite or sorted(SUITES), pytest_args, args.rev,
                         args.keep)
    print("\n=== transformer_fa vs TE's tests ===")
    print(format_summary(outcomes))
    return code


if __name__ == "__main__":
    sys.exit(main())
