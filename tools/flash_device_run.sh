#!/usr/bin/env bash
# One device call: build the flash extension (timed), run its GPU tests, the sanitizers and,
# unless SKIP_BENCH=1, the standard grid of FlashAttention against its peers; a short summary
# last. Logs and the bench's JSON, Markdown and PNG go to $OUT. The built extension stays in
# the checkout on the device (too large to come back): a later call on the same warm machine
# can skip the build with PREBUILT (copy it aside first, e.g. into .prebuilt/).
#   bash tools/flash_device_run.sh
# The device tool brings back at most 8 files, so the logs also go into one logs.tgz (read
# with tar xzf) and the test failures are printed again after the summary, last.
# Settings (environment):
#   TRANSFORMER_FA_CUDA_ARCHS  build targets (default 90a; "80;90a" times the full build)
#   PREBUILT=path.so           skip the build, use that extension (same image and Python)
#   TESTS                      test files (default: the flash, sm90 and sm90 backward tests;
#                              "none" skips them)
#   PYTEST_ARGS, TEST_TIMEOUT  extra pytest arguments (e.g. -k 256), its limit in s (240)
#   SAN_MODES                  flash_sanitize_case.py modes, one racecheck and one memcheck
#                              run each (default "--sm90 --sm90-backward"; "--backward" for
#                              the sm80 family; "none" skips them); SAN_TIMEOUT per run (150)
#   BENCH_BACKENDS             peers in the grid (default FlashAttention beside torch's cuDNN)
#   BENCH_PARTS                bench_attention.py parts (default grid; e.g. grid,gqa,varlen)
#   BENCH_DIMS, BENCH_TIMEOUT  the grid's head dims (default the preset's), its limit (300)
#   BENCH_FAMILY               TRANSFORMER_FA_FLASH_FAMILY for the grid (default auto)
#   BENCH_TAG                  suffix of the result files' names (default flash)
# The wheels in .whl/ (nvidia-cutlass for the sm90 headers; the machine has no network) are
# installed into /tmp/site first when present (carry .whl).
set -uo pipefail
OUT=${OUT:-/tmp/flash_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TRANSFORMER_FA_CUDA_ARCHS=${TRANSFORMER_FA_CUDA_ARCHS:-90a}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
date -u
summary=()
if [ -n "${PREBUILT:-}" ] && [ -f "$PREBUILT" ]; then
  cp "$PREBUILT" . && TRANSFORMER_FA_BUILD_CUDA=0 python3 -m pip install --no-build-isolation --no-deps -e . \
    > "$OUT/build.log" 2>&1
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  summary+=("build: prebuilt $PREBUILT")
else
  start=$(date +%s)
  python3 -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1
  rc=$?
  summary+=("build: rc=$rc in $(( $(date +%s) - start )) s (archs $TRANSFORMER_FA_CUDA_ARCHS, MAX_JOBS=16)")
  [ $rc -eq 0 ] || { grep -E "error" "$OUT/build.log" | head -20; }
fi
python3 -c "import torch, transformer_fa_flash as m; print('extension ok', m.HEAD_DIMS)" || exit 1

TESTS=${TESTS:-tests/gpu/test_flash.py tests/gpu/test_flash_sm90.py tests/gpu/test_flash_sm90_bwd.py}
if [ "$TESTS" != none ]; then
  # shellcheck disable=SC2086  # (TESTS and PYTEST_ARGS are word lists)
  # (faulthandler: a test still running after 120 s prints every thread's stack, so that a
  # kernel that hangs names its test before the timeout kills the run)
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest $TESTS -q -p no:cacheprovider --tb=short \
    --maxfail=25 -o faulthandler_timeout=120 ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1
  summary+=("pytest rc=$?: $(tail -1 "$OUT/pytest.log")")
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -25
fi

SAN_MODES=${SAN_MODES:---sm90 --sm90-backward}
if [ "$SAN_MODES" != none ]; then
  for mode in $SAN_MODES; do
    for tool in racecheck memcheck; do
      extra=(); [ $tool = racecheck ] && extra=(--racecheck-report all)
      timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool "${extra[@]}" \
        python3 tools/flash_sanitize_case.py $mode > "$OUT/sanitizer.run" 2>&1
      rc=$?
      { echo "== $tool $mode rc=$rc"; cat "$OUT/sanitizer.run"; } >> "$OUT/sanitizer.log"
      summary+=("compute-sanitizer $tool $mode rc=$rc: $(grep -E 'SUMMARY' "$OUT/sanitizer.run" | tr '\n' ' ')")
    done
  done
  rm -f "$OUT/sanitizer.run"
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  dims=(); [ -n "${BENCH_DIMS:-}" ] && dims=(--head-dims "$BENCH_DIMS")
  TRANSFORMER_FA_FLASH_FAMILY=${BENCH_FAMILY:-auto} timeout ${BENCH_TIMEOUT:-300} \
    python3 benchmarks/bench_attention.py --parts "${BENCH_PARTS:-grid}" "${dims[@]}" \
    --backends "${BENCH_BACKENDS:-FlashAttention,torch:CUDNN_ATTENTION}" --tag "${BENCH_TAG:-flash}" \
    --out-dir "$OUT" > "$OUT/bench.log" 2>&1
  summary+=("bench rc=$?: $(tail -1 "$OUT/bench.log")")
  md=$(ls "$OUT"/*.md 2>/dev/null | head -1); [ -n "$md" ] && grep -E "^\|" "$md"
fi
date -u
printf '%s\n' "${summary[@]}"
# the logs in one file (the 8-file limit), and the failures last (the output's tail survives)
(cd "$OUT" && tar czf logs.tgz --ignore-failed-read build.log pytest.log sanitizer.log bench.log \
  2>/dev/null)
[ -f "$OUT/pytest.log" ] && grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -25
true
