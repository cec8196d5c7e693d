#!/usr/bin/env bash
# Next session's first call (~10 min; carry .device/wheels: `bash scripts/device/prepare.sh` first).
# Session 14's GPU test runs stopped at their time limits with every finished test passing except the
# lean register-cap test (fixed since: the reference takes the same volatile reload). This runs the
# whole GPU kernel suite in one call with the slowest tests listed (the one-sided register-cap test
# alone took 126 s, mostly its compile on the image's Triton 3.6).
# Usage on the device: bash scripts/device/pending15.sh "$OUT"
set -u
out=${1:?output folder}
KVLOCKS_TEST_TIMEOUT=570 bash scripts/device/gpu_tests.sh "$out/tests" 8 tests/test_kernels.py tests/test_nvcc.py \
    --durations=40
