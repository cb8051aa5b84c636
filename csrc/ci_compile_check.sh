#!/usr/bin/env bash
# CI: compile one instantiation of every kernel family with nvcc (no torch, no GPU), then
# syntax-check the binding against the installed torch, so that a change that breaks the
# extension's build cannot land. Fails loudly on any error.
#   csrc/ci_compile_check.sh            # from anywhere; needs nvcc (CUDA 12.x/13.x)
# Every kernel family (csrc/generate.py's FAMILIES: sm80, whose sm_90a build also compiles
# sm90/'s bulk dQ copy, and sm90, forward and backward): each direction at each of the family's
# default targets (generate.py --compile-check-jobs). Also checks that the generated files are
# up to date.
set -euo pipefail
cd "$(dirname "$0")"
NVCC=${NVCC:-nvcc}
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "ci_compile_check: FAILED: nvcc not found (set NVCC=/path/to/nvcc)" >&2
  exit 1
fi
python3 generate.py --check || { echo "ci_compile_check: FAILED: stale generated files" >&2; exit 1; }

# The sm90 family needs the CUTLASS/CuTe headers of the pip package nvidia-cutlass.
CUTLASS_INCLUDE=${CUTLASS_INCLUDE:-$(python3 -c "import importlib.util, os
spec = importlib.util.find_spec('cutlass_library')
print(os.path.join(spec.submodule_search_locations[0], 'source', 'include') if spec else '')")}
if [ -z "$CUTLASS_INCLUDE" ] || [ ! -d "$CUTLASS_INCLUDE/cute" ]; then
  echo "ci_compile_check: FAILED: CUTLASS headers not found (pip install nvidia-cutlass==4.2.0.0" \
       "or set CUTLASS_INCLUDE)" >&2
  exit 1
fi

# The no-conversion macros are the ones torch's cpp_extension passes: the CI build must refuse
# what the real build refuses.
FLAGS=(-O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr -I. -I"$CUTLASS_INCLUDE" -Xptxas -v
       -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
       -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__)
# (file, target) jobs: each family's directions at each of its targets, dtypes and head dims
# rotating.
mapfile -t JOBS < <(python3 generate.py --compile-check-jobs)
[ ${#JOBS[@]} -gt 0 ] || { echo "ci_compile_check: FAILED: no jobs" >&2; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
status=0
pids=()
for job in "${JOBS[@]}"; do
  set -- $job
  log="$TMP/$(basename "$1").$2.log"
  ( "$NVCC" "${FLAGS[@]}" -gencode=arch=compute_$2,code=sm_$2 -c "$1" -o "$TMP/$(basename "$1").$2.o" \
      >"$log" 2>&1 ) &
  pids+=("$!:$1:$2:$log")
done
for entry in "${pids[@]}"; do
  IFS=: read -r pid file arch log <<<"$entry"
  if wait "$pid"; then
    spills=$(grep -E "bytes spill stores" "$log" | awk '{s += $5} END {print s + 0}')
    echo "ci_compile_check: ok   $file (sm_$arch; spill store bytes over its kernels: $spills)"
  else
    echo "ci_compile_check: FAILED $file (sm_$arch):" >&2
    cat "$log" >&2
    status=1
  fi
done
if [ $status -ne 0 ]; then
  echo "ci_compile_check: FAILED: a kernel family does not compile" >&2
fi

# The binding (flash_api.cpp, torch headers) with every kernel's dispatch case in: a syntax
# check against the installed torch (a CPU build is enough). A CPU build of torch lacks the
# generated c10/cuda/impl/cuda_cmake_macros.h that the c10/cuda headers include: a stand-in
# comes after torch's own include dirs, so a real one wins.
if python3 -c "import torch" 2>/dev/null; then
  mkdir -p "$TMP/stand-in/c10/cuda/impl"
  echo "#pragma once" > "$TMP/stand-in/c10/cuda/impl/cuda_cmake_macros.h"
  read -r -a TORCH_INC < <(python3 -c "import torch.utils.cpp_extension as c
print(' '.join('-I' + p for p in c.include_paths()))")
  PY_INC=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  # nvcc's own include flags (its dry run prints them; nvcc may be a wrapper script)
  read -r -a CUDA_INC < <(echo | "$NVCC" --dryrun -x cu -c - -o /dev/null 2>&1 \
    | sed -n 's/^#\$ INCLUDES="\(.*\)" *$/\1/p' | head -1)
  read -r -a MACROS < <(python3 generate.py --macros)
  if ${CXX:-g++} -std=c++17 -fsyntax-only -I. "${TORCH_INC[@]}" -I"$TMP/stand-in" "${CUDA_INC[@]}" \
      -I"$PY_INC" -DTORCH_EXTENSION_NAME=transformer_fa_flash "${MACROS[@]}" flash_api.cpp \
      >"$TMP/binding.log" 2>&1; then
    echo "ci_compile_check: ok   flash_api.cpp (the binding, every dispatch case; syntax check)"
  else
    echo "ci_compile_check: FAILED flash_api.cpp (the binding):" >&2
    cat "$TMP/binding.log" >&2
    status=1
  fi
else
  echo "ci_compile_check: torch not importable: skipping the binding's syntax check"
fi
exit $status
