"""Smoke test of the benchmark harness: tiny shapes on CPU, and the report from a fixed JSON."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from distributed_utils import assert_case_passed, run_cases

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_attention, bench_distributed, report  # noqa: E402

TOP_KEYS = ["gpu", "date", "torch", "cudnn", "grid_repeats", "flash_family",
            "flash_bwd_family", "records", "decode", "layer"]


def test_tiny_run_on_cpu(tmp_path):
    path = bench_attention.main(["--tiny", "--device", "cpu", "--out-dir", str(tmp_path)])
    data = json.loads(path.read_text())
    assert list(data) == TOP_KEYS
    assert path.name.endswith(f"-{data['date']}.json")

    cases = {r["case"] for r in data["records"]}
    assert cases == {"grid", "gqa", "varlen", "padded", "overhead"}
    grid = [r for r in data["records"] if r["case"] == "grid"]
    assert {r["backend"] for r in grid} == set(report.BACKENDS)
    for r in data["records"]:
        assert set(bench_attention.RECORD_KEYS) <= set(r)
        assert r["reason"] or r["fwd_ms"] is not None or r["case"] == "overhead", r
    # The unfused backend runs on CPU: its rows carry numbers, not reasons.
    unfused = [r for r in grid if r["backend"] == "UnfusedDotProductAttention"]
    assert all(r["fwd_tflops"] is not None and r["bwd_ms"] is not None for r in unfused), unfused
    # FlashAttention cannot run on CPU: the reason names the backend, not the whole error.
    flash = next(r for r in grid if r["backend"] == "FlashAttention")
    assert flash["fwd_ms"] is None and flash["reason"].startswith("FlashAttention")

    assert {r["backend"] for r in data["decode"]} == set(report.BACKENDS)
    assert any(r["kv_tb_per_s"] is not None for r in data["decode"])
    torch_layer = next(r for r in data["layer"] if r["model"].startswith("torch"))
    assert torch_layer["tokens_per_s"] > 0
    assert path.with_suffix(".md").read_text().startswith("## Attention benchmarks")


def test_backends_and_tag_pick_what_is_measured(tmp_path):
    only = "UnfusedDotProductAttention"
    path = bench_attention.main(["--tiny", "--device", "cpu", "--out-dir", str(tmp_path),
                                 "--parts", "grid,decode,overhead", "--backends", only,
                                 "--tag", "unfused"])
    data = json.loads(path.read_text())
    assert path.name.endswith(f"-{data['date']}-unfused.json")
    rows = data["records"] + data["decode"]
    assert rows and {r["backend"] for r in rows} == {only}
    assert {r["case"] for r in data["records"]} == {"grid", "overhead"}
    with pytest.raises(SystemExit):
        bench_attention.main(["--tiny", "--device", "cpu", "--backends", "Flash"])


def test_repeats_record_the_median_pass(tmp_path):
    path = bench_attention.main(["--tiny", "--device", "cpu", "--out-dir", str(tmp_path),
                                 "--parts", "grid", "--repeats", "3",
                                 "--backends", "UnfusedDotProductAttention"])
    data = json.loads(path.read_text())
    assert data["grid_repeats"] == 3
    grid = data["records"]
    preset = bench_attention.PRESETS["tiny"]
    assert len(grid) == len(preset.head_dims) * 2 * len(preset.seqlens)  # one per row
    for r in grid:
        for x in ("fwd", "bwd"):
            runs = r[f"{x}_ms_runs"]
            assert len(runs) == 3 and r[f"{x}_ms"] == sorted(runs)[1]
            flops = bench_attention.attn_flops(r["b"], r["h"], r["s"], r["s"], r["d"],
                                               r["causal"]) * (2.5 if x == "bwd" else 1)
            assert r[f"{x}_tflops"] == round(flops / r[f"{x}_ms"] / 1e9, 2)
    assert "median time over the passes" in path.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):
        bench_attention.main(["--tiny", "--device", "cpu", "--repeats", "0"])


def test_median_over_passes_merges_rows_in_pass_order():
    rows = [dict(record(b, 1, 1), s=s, fwd_ms=t, bwd_ms=None if b == "x" else 2 * t)
            for t in (3.0, 1.0, 2.0) for s, b in ((512, "a"), (1024, "x"))]
    merged = bench_attention.median_over_passes(rows, 3)
    assert [(r["s"], r["fwd_ms"], r["fwd_ms_runs"]) for r in merged] == [
        (512, 2.0, [3.0, 1.0, 2.0]), (1024, 2.0, [3.0, 1.0, 2.0])]
    assert merged[0]["bwd_ms"] == 4.0 and merged[1]["bwd_ms"] is None
    assert merged[1]["bwd_ms_runs"] == []


def record(backend, fwd, bwd, **kw):
    base = dict(case="grid", backend=backend, dtype="bf16", d=128, causal=True, s=4096, b=4,
                h=16, fwd_tflops=fwd, bwd_tflops=bwd, fwd_ms=1.0, bwd_ms=2.0, peak_mem_gb=1.0,
                reason=None if fwd else "not built")
    return dict(base, **kw)


def test_report_ratios_and_readme(tmp_path):
    data = {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-23", "torch": "2.11", "cudnn": "9.19.0",
            "records": [record("FusedAttention", 600.0, 500.0),
                        record("FlashAttention", None, None),
                        record("torch:FLASH_ATTENTION", 300.0, 250.0),
                        record("torch:CUDNN_ATTENTION", 400.0, 520.0),
                        record("FusedAttention", 500.0, 400.0, s=8192, b=2)],
            "decode": [], "layer": []}
    path = tmp_path / "gpu-2026-11-23.json"
    path.write_text(json.dumps(data))
    readme = tmp_path / "README.md"
    readme.write_text(f"# B\n\n{report.BEGIN}\nold\n{report.END}\n\ntail\n")

    text = report.write(path, readme)
    # Best peer is the max per direction: 400 forward (cuDNN), 520 backward (cuDNN).
    assert "600 / 500 (1.50x / 0.96x)" in text
    assert "| 500 / 400 |" in text  # no peer on that row: no ratio
    assert "- FlashAttention (1 row): not built" in text
    assert "FlashAttention |" not in text.split("Not run")[0]  # a column only if it ran
    new = readme.read_text()
    assert "old" not in new and new.endswith("tail\n") and "1.50x" in new
    if path.with_suffix(".png").exists():
        assert path.with_suffix(".png").stat().st_size > 1000
    else:
        pytest.importorskip("matplotlib")  # matplotlib there but no PNG: fail
        raise AssertionError("no PNG written")


# ------------------------------------------------------------ bench_distributed.py (2 ranks)

def distributed_tiny_case(world, rank, group):
    out_dir = os.environ["BENCH_DISTRIBUTED_OUT"]
    path = bench_distributed.main(["--tiny", "--device", "cpu", "--out-dir", out_dir,
                                   "--comm-types", "p2p,a2a,all_gather"])
    assert (path is None) == (rank != 0)  # rank 0 writes


CASES = {"distributed-tiny": distributed_tiny_case}


def test_distributed_tiny_run_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_DISTRIBUTED_OUT", str(tmp_path))  # the spawned ranks inherit it
    assert_case_passed(run_cases(__name__, 2), "distributed-tiny")
    (path,) = tmp_path.glob("*-x2-*-distributed.json")
    data = json.loads(path.read_text())
    assert data["ranks"] == 2 and data["backend"] == "gloo" and data["nccl_nvls_enable"]
    preset = bench_distributed.PRESETS["tiny"]
    cp = data["cp"]
    assert [(r["s"], r["config"], r["gpus"]) for r in cp] == [
        (s, config, gpus) for s in preset.seqlens
        for config, gpus in (("1 GPU, no CP", 1), ("CP p2p", 2), ("CP a2a", 2),
                             ("CP all_gather", 2))]
    for r in cp:  # every row ran on CPU, with numbers that follow from its times
        assert r["reason"] is None and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0, r
        assert r["tokens_per_s"] == round(r["b"] * r["s"] / r["fwd_bwd_ms"] * 1e3)
        one = next(x for x in cp if x["s"] == r["s"] and x["gpus"] == 1)
        expected = None if r["gpus"] == 1 else round(
            r["tokens_per_s"] / (2 * one["tokens_per_s"]), 3)
        assert r["scaling_efficiency"] == expected
    assert [r["config"] for r in data["tp"]] == ["1 GPU", "TP 2", "TP 2 + SP"]
    for r in data["tp"]:
        assert r["reason"] is None and r["step_ms"] > 0, r
    assert data["tp"][1]["speedup"] == round(data["tp"][1]["tokens_per_s"]
                                             / data["tp"][0]["tokens_per_s"], 3)
    text = path.with_suffix(".md").read_text()
    assert text.startswith("## Distributed benchmarks: 2 x ")
    assert "| 32 | CP a2a | 2 |" in text and "| TP 2 + SP | 2 |" in text


def test_distributed_rows_too_large_for_memory_are_skipped(monkeypatch):
    monkeypatch.setattr(bench_distributed, "free_bytes", lambda device: 100e9)
    # p2p: 24 B x 8 heads x (32k / 2)^2 = 52 GB fits; a2a: 4 heads x 32k^2 = 103 GB does not
    # (on the CPU the blocks run the PyTorch math; on CUDA in bf16 the flash kernels: no check)
    cpu = ("p2p", 128, torch.bfloat16, "cpu")
    bench_distributed.check_scores_fit(cpu[0], 2, 1, 8, 32 * 1024, *cpu[1:])
    bench_distributed.check_scores_fit(None, 1, 1, 8, 256 * 1024, *cpu[1:])
    with pytest.raises(bench_distributed.Skip, match="about 103 GB per GPU; 100 GB free"):
        bench_distributed.check_scores_fit("a2a", 2, 1, 8, 32 * 1024, *cpu[1:])


def test_distributed_report_lists_skipped_rows():
    row = dict(s=65536, config="CP a2a", gpus=2, backend=None, fwd_ms=None, fwd_bwd_ms=None,
               tokens_per_s=None, tflops_per_gpu=None, scaling_efficiency=None,
               peak_mem_gb=None, b=1, h=8, hkv=8, d=128, dtype="bfloat16",
               reason="skipped: CP runs the unfused math, whose scores need about 412 GB")
    data = dict(ranks=2, gpu="NVIDIA H200", date="2026-11-24", torch="2.13", cudnn="9",
                backend="nccl", nccl_nvls_enable="0", cp=[row], tp=[])
    text = bench_distributed.markdown(data)
    assert "| 65536 | CP a2a | 2 | – | – |" in text
    assert "- CP a2a (1 row): skipped: CP runs the unfused math" in text
