#!/usr/bin/env bash
# Next session's second call (~10 min; carry .device/wheels). Session 14's GPU test runs stopped at
# their time limits with every finished test passing except the lean register-cap test (fixed since:
# its reference takes the capped launches' volatile reload). The whole GPU kernel suite in one call,
# slowest tests listed (the one-sided register-cap test alone took 126 s, mostly its compile).
# Usage on the device: bash scripts/device/pending15b.sh "$OUT"
set -u
out=${1:?output folder}
KVLOCKS_TEST_TIMEOUT=570 bash scripts/device/gpu_tests.sh "$out/tests" 8 tests/test_kernels.py tests/test_nvcc.py \
    --durations=40
