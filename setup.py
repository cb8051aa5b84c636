"""transformer_fa install.

The CUDA extension (csrc/) is built when torch has CUDA and nvcc is found, or when
TRANSFORMER_FA_BUILD_CUDA=1 forces it (=0 forces it off). Otherwise the pure-Python package
is installed; it runs everywhere with the unfused backend. To build the extension against
the torch you already have, install without build isolation:
    pip install --no-build-isolation -e .
Arch list for the kernels: TRANSFORMER_FA_CUDA_ARCHS (default "80;90a"; each kernel family's
files build for the targets of this list it runs on, csrc/generate.py); kernel set:
TRANSFORMER_FA_FLASH_KERNELS (default all; e.g. "bf16_hdim128,fp16_hdim64" for a fast
development build, or one family's "sm80_bf16_hdim128": calls the build lacks go to another
backend, with the reason).
The sm90 family (Hopper's wgmma/TMA forward) includes CuTe/CUTLASS headers: those of the pip
package nvidia-cutlass (CUTLASS_PIN; installed by this script when missing), or
CUTLASS_INCLUDE=<dir with cute/ and cutlass/>. Without them the build leaves that family out.
"""
import glob
import importlib.util
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
EXTENSION = "transformer_fa_flash"


def load_generate():
    spec = importlib.util.spec_from_file_location("tfa_generate",
                                                  os.path.join(ROOT, "csrc", "generate.py"))
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    return generate


def flash_instantiations(generate, archs, cutlass):
    """({kernel .cu file: its nvcc targets}, macros) to build: csrc/generate.py knows the
    instantiations, their files, targets and the macros that enable their dispatch cases;
    TRANSFORMER_FA_FLASH_KERNELS picks."""
    try:
        files, macros = generate.selected(os.environ.get("TRANSFORMER_FA_FLASH_KERNELS", ""),
                                          archs, cutlass=cutlass)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return {os.path.join("csrc", f): targets for f, targets in files.items()}, macros


CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"  # header-only use; the version the kernels are tested with


def _pip_cutlass_include():
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "source", "include")
    return path if os.path.isdir(os.path.join(path, "cute")) else None


def cutlass_include():
    """The CuTe/CUTLASS include dir for the sm90 family, or None (the family is left out)."""
    given = os.environ.get("CUTLASS_INCLUDE")
    if given:
        if not os.path.isdir(os.path.join(given, "cute")):
            raise SystemExit(f"CUTLASS_INCLUDE={given} has no cute/ directory")
        return given
    found = _pip_cutlass_include()
    if found is None:
        print(f"transformer_fa: installing {CUTLASS_PIN} (CuTe headers for the sm90 kernels)")
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", CUTLASS_PIN])
        importlib.invalidate_caches()
        found = _pip_cutlass_include() if done.returncode == 0 else None
    if found is None:
        print(f"transformer_fa: CUTLASS headers not found ({CUTLASS_PIN} could not be "
              "installed): building without the sm90 kernel family")
    return found


def want_cuda_build():
    forced = os.environ.get("TRANSFORMER_FA_BUILD_CUDA")
    if forced is not None:
        return forced == "1", f"TRANSFORMER_FA_BUILD_CUDA={forced}"
    try:
        import torch
    except ImportError:
        return False, "torch is not importable in the build environment"
    if torch.version.cuda is None:
        return False, "torch has no CUDA"
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                "bin", "nvcc")
    if not os.path.exists(nvcc):
        return False, "nvcc was not found"
    return True, "torch has CUDA and nvcc was found"


def extensions():
    build, why = want_cuda_build()
    print(f"transformer_fa: {'building' if build else 'not building'} the CUDA extension ({why})")
    if not build:
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    archs = os.environ.get("TRANSFORMER_FA_CUDA_ARCHS", "80;90a")
    generate = load_generate()
    wants_cutlass = any(f.needs_cutlass and generate.family_archs(name, archs)
                        for name, f in generate.FAMILIES.items())
    cutlass = cutlass_include() if wants_cutlass else None
    kernels, macros = flash_instantiations(generate, archs, cutlass is not None)
    # source lines in the kernels' SASS, for Nsight Compute's source view (tools/flash_ncu.py
    # --source); the code is the same
    lineinfo = ["-lineinfo"] if os.environ.get("TRANSFORMER_FA_LINEINFO") == "1" else []
    ext = CUDAExtension(
        EXTENSION, sorted(glob.glob(os.path.join("csrc", "*.cpp"))) + sorted(kernels),
        include_dirs=[os.path.join(ROOT, "csrc")] + ([cutlass] if cutlass else []),
        extra_compile_args={"cxx": ["-O3", "-std=c++17"] + macros,
                            "nvcc": ["-O3", "-std=c++17", "--use_fast_math",
                                     "--expt-relaxed-constexpr"] + lineinfo})

    class PerFileGencode(BuildExtension):
        """torch's CUDAExtension has one nvcc flag list for every file; a kernel family's files
        build only for its targets (csrc/generate.py). So the sources compile in groups, one
        per target set, each with its -gencode flags (through torch's own compile, ninja
        included), and link together as one extension."""

        def build_extension(self, extension):
            compile_all = self.compiler.compile

            def compile_groups(sources, *args, extra_postargs=None, **kwargs):
                # the binding (no device code) goes with the build's targets
                targets = {f: kernels.get(os.path.relpath(os.path.abspath(f), ROOT),
                                          generate.build_targets(archs)) for f in sources}
                objects = []
                for group_targets, group in generate.compile_groups(targets).items():
                    flags = dict(extra_postargs)
                    flags["nvcc"] = flags["nvcc"] + generate.gencode_flags(group_targets)
                    objects += compile_all(group, *args, extra_postargs=flags, **kwargs)
                return objects

            self.compiler.compile = compile_groups
            try:
                super().build_extension(extension)
            finally:
                self.compiler.compile = compile_all

    return [ext], {"build_ext": PerFileGencode.with_options(use_ninja=True)}


ext_modules, cmdclass = extensions()

setup(
    name="transformer_fa",
    version="0.1.0",
    description="Layout-aware transformer layers for PyTorch with TransformerEngine's API",
    long_description=open(os.path.join(ROOT, "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["transformer_fa", "transformer_fa.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    extras_require={
        # backends/fused executes plans through the frontend's own path, tested with 1.32.
        "cudnn": ["nvidia-cudnn-frontend>=1.32,<1.33"],
        "test": ["pytest", "hypothesis", "tqdm", "matplotlib", "ruff>=0.4"],
        "bench": ["matplotlib"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
