"""tools/flash_switch_ab.py's pass order, arguments and summary (the timing itself needs a GPU)."""
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "tools" / "flash_switch_ab.py"
_spec = importlib.util.spec_from_file_location("flash_switch_ab", _PATH)
flash_switch_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(flash_switch_ab)


def test_passes_alternate_the_order():
    assert flash_switch_ab.pass_order(["0", "1", "2"], 0) == ["0", "1", "2"]
    assert flash_switch_ab.pass_order(["0", "1", "2"], 1) == ["2", "1", "0"]
    assert flash_switch_ab.pass_order(["0", "1"], 2) == ["0", "1"]


def test_arguments():
    args = flash_switch_ab.parse_args(["bwd", "TRANSFORMER_FA_X", "0", "1"])
    assert (args.kind, args.var, args.values, args.passes) == ("bwd", "TRANSFORMER_FA_X",
                                                               ["0", "1"], 2)
    for bad in (["up", "X", "0"], ["bwd", "X"], ["bwd", "X", "0", "--passes", "0"]):
        with pytest.raises(SystemExit):
            flash_switch_ab.parse_args(bad)


def test_summary_takes_the_best_pass_and_the_ratio_to_cudnn():
    results = {"d128 causal=0 s4096": {"0": [500.0, 515.0], "1": [456.0, 452.0],
                                       "cudnn": [519.0, 510.0]},
               "b1 sk4096": {"0 contiguous": [1.10, 1.14], "0 paged64": [1.08, 1.07],
                             "1 contiguous": [1.12, 1.11], "1 paged64": [1.07, 1.06],
                             "cudnn": [1.01, 1.00]}}
    lines = flash_switch_ab.summarize(results, ["0", "1"], "TFLOPS")
    assert lines[0] == "best of passes (TFLOPS), ratio to cuDNN"
    assert lines[1] == ("d128 causal=0 s4096 | 0: 515 (0.992x) | 1: 456 (0.879x) | "
                        "cudnn: 519")
    assert lines[2].startswith("b1 sk4096 | 0 contiguous: 1.14 (1.129x) | 0 paged64: 1.08 "
                               "(1.069x) | 1 contiguous: 1.12 (1.109x)")
