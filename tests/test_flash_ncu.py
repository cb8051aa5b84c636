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
    for bad in ("fwd:128:c", "up:128:c:4096", "fwd:100:c:4096", "fwd:128:x:4096",
                "fwd:128:c:3000", "fwd:128:c:4096:cublas", "fwd:x:c:4096", "fwd:128:c:4k",
                "decode:8", "decode:0:4096", "decode:8:4k", "decode:8:4096:fa2"):
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
