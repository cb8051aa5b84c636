"""The flash kernel set that setup.py builds (csrc/generate.py's instantiations and the
TRANSFORMER_FA_FLASH_KERNELS choice): files that exist, and one dispatch macro each."""
import importlib.util
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
_spec = importlib.util.spec_from_file_location("tfa_generate", CSRC / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)


def test_default_builds_every_instantiation():
    files, macros = generate.selected("")
    assert len(files) == 2 * len(macros) == 2 * 2 * len(generate.HEAD_DIMS)
    assert all((CSRC / f).is_file() for f in files)
    dispatch = (CSRC / "flash" / "dispatch.h").read_text()
    assert all(f"#ifdef {m[2:]}" in dispatch for m in macros)


def test_a_subset_builds_both_directions_of_each_named_kernel():
    files, macros = generate.selected(" bf16_hdim128, fp16_hdim64 ")
    assert macros == ["-DTFA_FLASH_BF16_HDIM128", "-DTFA_FLASH_FP16_HDIM64"]
    assert files == sorted(f"flash/instantiations/{d}_{k}_sm80.cu" for d in ("fwd", "bwd")
                           for k in ("bf16_hdim128", "fp16_hdim64"))


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match=r"unknown kernels: \['bf16_hdim100'\]"):
        generate.selected("bf16_hdim100,bf16_hdim128")
