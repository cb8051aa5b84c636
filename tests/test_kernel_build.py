"""The flash kernel set that setup.py builds (csrc/generate.py's instantiations, the
TRANSFORMER_FA_FLASH_KERNELS choice and the per-family nvcc targets): files that exist, one
dispatch macro each, and each file's -gencode flags."""
import importlib.util
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
_spec = importlib.util.spec_from_file_location("tfa_generate", CSRC / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)


def test_default_builds_every_instantiation_for_both_targets():
    files, macros = generate.selected("")
    assert len(files) == 2 * len(macros) == 2 * 2 * len(generate.HEAD_DIMS)
    assert all((CSRC / f).is_file() for f in files)
    assert set(files.values()) == {("80", "90a")}
    dispatch = (CSRC / "flash" / "dispatch.h").read_text()
    assert all(f"#ifdef {m[2:]}" in dispatch for m in macros)


def test_a_subset_builds_both_directions_of_each_named_kernel():
    files, macros = generate.selected(" bf16_hdim128, sm80_fp16_hdim64 ")
    assert macros == ["-DTFA_FLASH_SM80_FP16_HDIM64", "-DTFA_FLASH_SM80_BF16_HDIM128"]
    assert list(files) == sorted(f"flash/instantiations/{d}_{k}_sm80.cu" for d in ("fwd", "bwd")
                                 for k in ("bf16_hdim128", "fp16_hdim64"))


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match=r"unknown kernels: \['bf16_hdim100'\]"):
        generate.selected("bf16_hdim100,bf16_hdim128")


@pytest.fixture
def with_sm90a_family(monkeypatch):
    """A family that builds for sm_90a only, beside sm80 (as a Hopper family will)."""
    families = dict(generate.FAMILIES, sm90=generate.Family(enum="kSm90", archs=("90a",),
                                                            directions=("fwd",)))
    monkeypatch.setattr(generate, "FAMILIES", families)


def test_a_family_builds_only_for_its_targets(with_sm90a_family):
    files, macros = generate.selected("bf16_hdim128")
    assert files == {"flash/instantiations/bwd_bf16_hdim128_sm80.cu": ("80", "90a"),
                     "flash/instantiations/fwd_bf16_hdim128_sm80.cu": ("80", "90a"),
                     "flash/instantiations/fwd_bf16_hdim128_sm90.cu": ("90a",)}
    assert macros == ["-DTFA_FLASH_SM80_BF16_HDIM128", "-DTFA_FLASH_SM90_BF16_HDIM128"]
    groups = generate.compile_groups(files)
    assert {t: generate.gencode_flags(t) for t in groups} == {
        ("80", "90a"): ["-gencode=arch=compute_80,code=sm_80",
                        "-gencode=arch=compute_90a,code=sm_90a"],
        ("90a",): ["-gencode=arch=compute_90a,code=sm_90a"]}
    assert groups[("90a",)] == ["flash/instantiations/fwd_bf16_hdim128_sm90.cu"]
    # Without sm_90a among the targets, the family is left out (no macro: no dispatch case).
    files, macros = generate.selected("bf16_hdim128", "80")
    assert set(files.values()) == {("80",)} and macros == ["-DTFA_FLASH_SM80_BF16_HDIM128"]
    with pytest.raises(ValueError, match="sm90_bf16_hdim128, but its family builds for 90a"):
        generate.selected("sm90_bf16_hdim128", "80")
    # The CI compile check covers each family at each of its targets.
    assert ("flash/instantiations/fwd_fp16_hdim64_sm90.cu", "90a") in \
        generate.compile_check_jobs()


def test_dispatch_lists_the_user_names_of_the_every_gpu_family(with_sm90a_family):
    header = generate.dispatch_header()
    assert "arch == Arch::kSm90 && bf16 && hd == 128" in header
    assert header.count('built.push_back("bf16_hdim128")') == 1
