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


FP8_CAST_MACROS = ["-DTRANSFORMER_FA_FP8_CAST", "-DTRANSFORMER_FA_FP8_CAST_ARCHS=90"]


def test_the_fp8_cast_kernel_builds_for_sm89_and_later():
    """csrc/fp8/cast_transpose.cu (FP8 conversions: sm_89+) builds for those targets only,
    whatever flash kernels are picked, and the binding learns which GPUs it serves."""
    files, macros = generate.selected("bf16_hdim128", "80")
    assert generate.FP8_CAST_FILE not in files and not any("FP8" in m for m in macros)
    files, macros = generate.selected("bf16_hdim128", "80;89;90a;100a")
    assert files[generate.FP8_CAST_FILE] == ("89", "90a", "100a")
    assert macros[-2:] == ["-DTRANSFORMER_FA_FP8_CAST",
                           "-DTRANSFORMER_FA_FP8_CAST_ARCHS=89,90,100"]
    assert (generate.FP8_CAST_FILE, "90a") in generate.compile_check_jobs()


def test_default_builds_every_instantiation_for_its_targets():
    files, macros = generate.selected("")
    sm80 = {f: t for f, t in files.items() if f.endswith("_sm80.cu")}
    sm90 = {f: t for f, t in files.items() if f.endswith("_sm90.cu")}
    assert len(sm80) == 3 * 2 * len(generate.HEAD_DIMS)  # fwd, bwd and decode, 2 dtypes
    assert set(sm80.values()) == {("80", "90a")}
    # sm90: forward and backward at d64, d128 and d256 (one macro per kernel)
    sm90_fwd = [f"flash/instantiations/fwd_{t}_hdim{d}_sm90.cu"
                for t in ("bf16", "fp16") for d in (64, 128, 256)]
    sm90_bwd = [f"flash/instantiations/bwd_{t}_hdim{d}_sm90.cu"
                for t in ("bf16", "fp16") for d in (64, 128, 256)]
    assert sorted(sm90) == sorted(sm90_fwd + sm90_bwd)
    assert set(sm90.values()) == {("90a",)}
    assert files[generate.FP8_CAST_FILE] == ("90a",)  # FP8 conversions need sm_89+
    assert len(files) == len(sm80) + len(sm90) + 1
    assert macros[-2:] == FP8_CAST_MACROS
    assert len(macros) == len(sm80) // 3 + len(sm90_fwd) + 2
    assert all((CSRC / f).is_file() for f in files)
    dispatch = (CSRC / "flash" / "dispatch.h").read_text()
    assert all(f"#ifdef {m[2:]}" in dispatch for m in macros[:-2])


def test_a_subset_builds_both_directions_of_each_named_kernel():
    files, macros = generate.selected(" bf16_hdim128, sm80_fp16_hdim64 ")
    assert macros == ["-DTFA_FLASH_SM80_FP16_HDIM64", "-DTFA_FLASH_SM80_BF16_HDIM128",
                      "-DTFA_FLASH_SM90_BF16_HDIM128"] + FP8_CAST_MACROS
    assert list(files) == sorted([f"flash/instantiations/{d}_{k}_sm80.cu"
                                  for d in ("fwd", "bwd", "decode")
                                  for k in ("bf16_hdim128", "fp16_hdim64")]
                                 + [f"flash/instantiations/{d}_bf16_hdim128_sm90.cu"
                                    for d in ("fwd", "bwd")] + [generate.FP8_CAST_FILE])


def test_without_cutlass_the_sm90_family_is_left_out():
    files, macros = generate.selected("bf16_hdim128", cutlass=False)
    assert macros == ["-DTFA_FLASH_SM80_BF16_HDIM128"] + FP8_CAST_MACROS
    assert all(f.endswith("_sm80.cu") for f in files if f != generate.FP8_CAST_FILE)
    with pytest.raises(ValueError, match="sm90_bf16_hdim128, whose family needs the CUTLASS"):
        generate.selected("sm90_bf16_hdim128", cutlass=False)


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match=r"unknown kernels: \['bf16_hdim100'\]"):
        generate.selected("bf16_hdim100,bf16_hdim128")


def test_a_family_builds_only_for_its_targets():
    files, macros = generate.selected("bf16_hdim128")
    assert files == {"flash/instantiations/bwd_bf16_hdim128_sm80.cu": ("80", "90a"),
                     "flash/instantiations/decode_bf16_hdim128_sm80.cu": ("80", "90a"),
                     "flash/instantiations/fwd_bf16_hdim128_sm80.cu": ("80", "90a"),
                     "flash/instantiations/fwd_bf16_hdim128_sm90.cu": ("90a",),
                     "flash/instantiations/bwd_bf16_hdim128_sm90.cu": ("90a",),
                     generate.FP8_CAST_FILE: ("90a",)}
    assert macros == ["-DTFA_FLASH_SM80_BF16_HDIM128", "-DTFA_FLASH_SM90_BF16_HDIM128"] \
        + FP8_CAST_MACROS
    groups = generate.compile_groups(files)
    assert {t: generate.gencode_flags(t) for t in groups} == {
        ("80", "90a"): ["-gencode=arch=compute_80,code=sm_80",
                        "-gencode=arch=compute_90a,code=sm_90a"],
        ("90a",): ["-gencode=arch=compute_90a,code=sm_90a"]}
    assert groups[("90a",)] == [f"flash/instantiations/{d}_bf16_hdim128_sm90.cu"
                                for d in ("bwd", "fwd")] + [generate.FP8_CAST_FILE]
    # Without sm_90a among the targets, the family is left out (no macro: no dispatch case).
    files, macros = generate.selected("bf16_hdim128", "80")
    assert set(files.values()) == {("80",)} and macros == ["-DTFA_FLASH_SM80_BF16_HDIM128"]
    with pytest.raises(ValueError, match="sm90_bf16_hdim128, but its family builds for 90a"):
        generate.selected("sm90_bf16_hdim128", "80")
    # The CI compile check covers each family at each of its targets.
    assert [job for job in generate.compile_check_jobs() if job[0].endswith("_sm90.cu")] == \
        [("flash/instantiations/fwd_fp16_hdim64_sm90.cu", "90a"),
         ("flash/instantiations/bwd_bf16_hdim256_sm90.cu", "90a")]


def test_dispatch_lists_the_user_names_of_the_every_gpu_family():
    header = generate.dispatch_header()
    assert "arch == Arch::kSm90 && bf16 && hd == 128" in header
    assert header.count('built.push_back("bf16_hdim128")') == 1


def test_the_fp8_cast_launcher_sizes_the_column_sums_as_the_kernel():
    """kernels/fp8_cast.py allocates the CUDA kernel's column-sum workspace at a row per
    kCastTileRows rows (the binding refuses any other size): the two constants agree."""
    pytest.importorskip("triton")
    import re

    from transformer_fa.kernels import fp8_cast
    header = (CSRC / "fp8" / "cast_transpose.h").read_text()
    rows = int(re.search(r"constexpr int kCastTileRows = (\d+);", header).group(1))
    assert fp8_cast._CUDA_TILE_ROWS == rows
