"""transformer_fa install.

The CUDA extension (csrc/) is built when torch has CUDA and nvcc is found, or when
TRANSFORMER_FA_BUILD_CUDA=1 forces it (=0 forces it off). Otherwise the pure-Python package
is installed; it runs everywhere with the unfused backend. To build the extension against
the torch you already have, install without build isolation:
    pip install --no-build-isolation -e .
Arch list for the kernels: TRANSFORMER_FA_CUDA_ARCHS (default "80;90a"); kernel set:
TRANSFORMER_FA_FLASH_KERNELS (default all; e.g. "bf16_hdim128,fp16_hdim64" for a fast
development build: calls the build lacks go to another backend, with the reason).
"""
import glob
import importlib.util
import os
import shutil

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
EXTENSION = "transformer_fa_flash"


def flash_instantiations():
    """(kernel .cu files, macros) to build: csrc/generate.py knows the instantiations, their
    files and the macros that enable their dispatch cases; TRANSFORMER_FA_FLASH_KERNELS picks."""
    spec = importlib.util.spec_from_file_location("tfa_generate",
                                                  os.path.join(ROOT, "csrc", "generate.py"))
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    try:
        files, macros = generate.selected(os.environ.get("TRANSFORMER_FA_FLASH_KERNELS", ""))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return [os.path.join("csrc", f) for f in files], macros


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

    archs = os.environ.get("TRANSFORMER_FA_CUDA_ARCHS", "80;90a").split(";")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
    kernels, macros = flash_instantiations()
    ext = CUDAExtension(
        EXTENSION, sorted(glob.glob(os.path.join("csrc", "*.cpp"))) + kernels,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"] + macros,
                            "nvcc": ["-O3", "-std=c++17", "--use_fast_math",
                                     "--expt-relaxed-constexpr"] + gencode})
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


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
