"""tools/flash_ncu.py's case syntax and its summary of ncu's raw CSV (a synthetic one: the
profiling itself needs a GPU and ncu)."""
import argparse
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "tools" / "flash_ncu.py"
_spec = importlib.util.spec_from_file_location("flash_ncu", _PATH)
flash_ncu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(flash_ncu)


def test_case_syntax():
    assert flash_ncu.parse_case("bwd:128:c:4096") == dict(direction="bwd", d=128, causal=True,
                                                           s=4096, who="sm90")
    assert flash_ncu.parse_case("fwd:256:nc:1024:cudnn")["who"] == "cudnn"
    assert flash_ncu.parse_case("decode:8:32768") == dict(direction="decode", b=8, sk=32768,
                                                          who="ours")
    assert flash_ncu.parse_case("decode:32:4096:cudnn")["who"] == "cudnn"
    assert flash_ncu.parse_case("decode:1:4096:nolens")["who"] == "nolens"
    assert flash_ncu.parse_case("decode:1:4096:paged64") == dict(
        direction="decode", b=1, sk=4096, who="paged64", page_size=64)
    for bad in ("fwd:128:c", "up:128:c:4096", "fwd:100:c:4096", "fwd:128:x:4096",
                "fwd:128:c:3000", "fwd:128:c:4096:cublas", "fwd:x:c:4096", "fwd:128:c:4k",
                "decode:8", "decode:0:4096", "decode:8:4k", "decode:8:4096:fa2",
                "decode:1:4096:paged", "decode:1:4096:paged24", "decode:1:4000:paged64",
                "decode:1:4096:pagedx"):
        with pytest.raises(argparse.ArgumentTypeError, match="case"):
            flash_ncu.parse_case(bad)


RAW = '''"ID","Process ID","Process Name","Host Name","Kernel Name","gpu__time_duration.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed","launch__registers_per_thread","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio","sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
"","","","","","nsecond","%","register/thread","ratio","ratio","ratio","%"
"0","42","python3","host","void transformer_fa::flash::sm90::fwd_kernel<Cfg, false>(Params)","1,234,000","71.5","168","0.31","1.25","0.07","63.2"
"1","42","python3","host","convert_dq_kernel","5000","12.0","40","","0.5","",""
'''


def test_summary_of_the_raw_csv():
    (name, first), (_, second) = flash_ncu.summarize(RAW)
    assert name.startswith("void transformer_fa::flash::sm90::fwd_kernel")
    assert first["duration us"] == 1234.0
    assert first["SM throughput %"] == 71.5 and first["registers / thread"] == 168
    assert first["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"] == 63.2
    assert first["top stalls"] == "wait 1.25, barrier 0.31, math_pipe_throttle 0.07"
    assert second["duration us"] == 5.0 and second["top stalls"] == "wait 0.50"


# ncu's source page (--page source --print-source cuda,sass), cut down: two files of one
# kernel, each with its source lines and the kernel's SASS repeated under it
SOURCE = '''"File Path","/work/csrc/flash/sm90/fwd_kernel.cuh"
"Function Name","void fwd_kernel<Cfg>(Params)"
"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait","stall_mio","stall_barrier","stall_wait (Not Issued)"
"439","s = fast_exp2(s);","-","-","60","300","40","20","0","7"
"","","0x10","      MUFU.EX2 R1, R2","50","200","35","15","0","5"
"","","0x20","      FFMA R3, R1, R4, R5","10","100","5","5","0","2"
"88","m_block = tile % n;","-","-","10","50","10","0","0","1"
"","","0x30","  @P0 IMAD.HI.U32 R6, R7, R8, RZ","10","50","10","0","0","1"
"","","...","...","-","-","-","-","-","-"
"File Path","/cute/arch/mma_sm90_gmma.hpp"
"Function Name","void fwd_kernel<Cfg>(Params)"
"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait","stall_mio","stall_barrier","stall_wait (Not Issued)"
"67","asm volatile(wgmma.fence);","-","-","30","10","0","0","30","0"
"","","0x10","      MUFU.EX2 R1, R2","50","200","35","15","0","5"
"","","0x40","      WARPGROUP.ARRIVE","30","10","0","0","30","0"
'''


def test_summary_of_the_source_view():
    (name, view), = flash_ncu.summarize_source(SOURCE, top=2).items()
    assert name == "void fwd_kernel<Cfg>(Params)"
    # shares of the kernel's SASS totals (100 samples, 360 instructions; 0x10 counted once)
    where, samples, executed, stalls = view["lines"][0]
    assert where == "fwd_kernel.cuh:439"
    assert samples == pytest.approx(60) and executed == pytest.approx(100 * 300 / 360)
    assert [reason for reason, _ in stalls] == ["wait", "mio"]  # a zero share is left out
    assert stalls[0][1] == pytest.approx(40)
    assert [line[0] for line in view["lines"]] == ["fwd_kernel.cuh:439", "mma_sm90_gmma.hpp:67"]
    ops = {op: (millions, share, samples) for op, millions, share, samples in view["opcodes"]}
    assert list(ops)[0] == "MUFU"  # by instructions executed; a predicate is not the opcode
    assert ops["MUFU"][0] == pytest.approx(200e-6) and ops["IMAD"][1] == pytest.approx(100 * 50 / 360)
    assert ops["WARPGROUP"][2] == pytest.approx(30)


# ncu's SASS-only page (--print-source sass), cut down: the one view with kernels built without
# line info (cuDNN's); a kernel's block at times comes twice
SASS = '''"Kernel Name","cudnn_generated_sdpa_bprop_kernel0",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x7f00","      LDC R1, c[0x0][0x28]","5","40","0","0","5","0"
"0x7f10","      HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ","20","100","0","0","20","0"
"0x7f20","      WARPGROUP.DEPBAR.LE gsb0, 0x0","60","100","55","0","5","0"
"0x7f30","  @!P0 BRA 0x7f60","15","60","0","15","0","9"
"Kernel Name","cudnn_generated_sdpa_bprop_kernel0",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"
"0x7f00","      LDC R1, c[0x0][0x28]","5","40","0","0","5","0"
'''


def test_summary_of_the_sass_view():
    (name, view), = flash_ncu.summarize_source(SASS, top=3).items()
    assert name == "cudnn_generated_sdpa_bprop_kernel0" and view["lines"] == []
    # totals 100 samples, 300 instructions: the repeated block counted once
    ops = {op: (millions, share, samples) for op, millions, share, samples in view["opcodes"]}
    assert ops["HGMMA"][1] == pytest.approx(100 / 3) and ops["BRA"][2] == pytest.approx(15)
    index, instruction, share, stalls = view["hottest"][0]
    assert (index, instruction, share) == (2, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 60)
    assert stalls == [("barrier", 55), ("wait", 5)]
    assert [row[0] for row in view["hottest"]] == [2, 1, 3]


def test_source_mode_runs_ncu_to_a_report_and_reads_it_back(monkeypatch, tmp_path, capsys):
    # the --source flow without a GPU: ncu (a stand-in) profiles into a report, then the raw
    # and source pages are read from it; both summaries are printed and the CSVs kept
    calls = []

    def fake_run(cmd, capture_output, text):
        calls.append(cmd)
        page = cmd[cmd.index("--page") + 1] if "--page" in cmd else None
        view = cmd[cmd.index("--print-source") + 1] if "--print-source" in cmd else None
        stdout = {"raw": "==PROF== noise\n" + RAW, "source": SOURCE if view == "cuda,sass" else
                  SASS}.get(page, "==PROF== done\n")
        return argparse.Namespace(returncode=0, stdout=stdout, stderr="")

    monkeypatch.setattr(flash_ncu.subprocess, "run", fake_run)
    monkeypatch.setattr("sys.argv", ["flash_ncu.py", "--source", "2", "--out", str(tmp_path),
                                     "fwd:64:nc:512"])
    flash_ncu.main()
    profile, raw_page, source_page, sass_page = calls
    report = str(tmp_path / "ncu-fwd-64-nc-512")
    assert profile[profile.index("-o") + 1] == report and "SourceCounters" in profile
    assert profile[profile.index("--import-source") + 1] == "yes" and "--csv" not in profile
    assert raw_page[:3] == ["ncu", "-i", report + ".ncu-rep"] and "raw" in raw_page
    assert source_page[:3] == ["ncu", "-i", report + ".ncu-rep"]
    assert source_page[source_page.index("--print-source") + 1] == "cuda,sass"
    assert sass_page[:3] == source_page[:3] and sass_page[-1] == "sass"
    printed = capsys.readouterr().out
    assert "duration us: 1234.0" in printed and "fwd_kernel.cuh:439: 60.0 / 83.3" in printed
    # the SASS views come from the SASS page: its kernel has no line info
    assert "HGMMA: 0.00M, 33.3, 20.0" in printed and "(no line info: no source lines)" in printed
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x0  (barrier 55.0, wait 5.0)" in printed
    assert (tmp_path / "ncu-fwd-64-nc-512.csv").exists()
    assert (tmp_path / "ncu-fwd-64-nc-512-source.csv").read_text() == SOURCE
    assert (tmp_path / "ncu-fwd-64-nc-512-sass.csv").read_text() == SASS
