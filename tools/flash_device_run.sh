#!/usr/bin/env bash
# One device call: build the flash extension (timed), run its GPU tests, the sanitizers and,
# unless SKIP_BENCH=1, the standard grid of FlashAttention against torch's FLASH_ATTENTION.
#   bash tools/flash_device_run.sh            (OUT=... collects logs and the built .so)
set -uo pipefail
OUT=${OUT:-/tmp/flash_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TRANSFORMER_FA_CUDA_ARCHS=${TRANSFORMER_FA_CUDA_ARCHS:-90a}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
date -u
if [ -n "${PREBUILT:-}" ] && [ -f "$PREBUILT" ]; then
  cp "$PREBUILT" . && TRANSFORMER_FA_BUILD_CUDA=0 python3 -m pip install --no-build-isolation --no-deps -e . \
    > "$OUT/build.log" 2>&1
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  echo "using prebuilt $PREBUILT"
else
  start=$(date +%s)
  python3 -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1
  echo "build rc=$? in $(( $(date +%s) - start )) s"; tail -3 "$OUT/build.log"
fi
so=$(find . -path ./.prebuilt -prune -o -name 'transformer_fa_flash*.so' -print | head -1); echo "extension: $so"; cp "$so" "$OUT/" 2>/dev/null
python3 -c "import torch, transformer_fa_flash as m; print('extension ok', m.HEAD_DIMS)" || exit 1
timeout ${TEST_TIMEOUT:-150} python3 -m pytest tests/gpu/test_flash.py -q -p no:cacheprovider \
  --tb=short --maxfail=25 ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest.log" | tail -${TEST_TAIL:-40}
for tool in racecheck memcheck; do
  timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool python3 tools/flash_sanitize_case.py ${SAN_ARGS:---backward} \
    > "$OUT/sanitizer_$tool.log" 2>&1
  echo "compute-sanitizer $tool rc=$?: $(grep -E 'SUMMARY' "$OUT/sanitizer_$tool.log" | tr '\n' ' ')"
done
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_attention.py --parts grid \
    --backends FlashAttention,torch:FLASH_ATTENTION --tag flash --out-dir "$OUT" 2>&1 | tail -5
fi
date -u
