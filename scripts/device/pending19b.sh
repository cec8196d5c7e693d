#!/usr/bin/env bash
# Prepared in session 18 for the next session (~4 min): are the step's weight products faster in the
# Triton small-batch kernel (kvlocks.engine.gemv) than in cuBLAS (4.83 ms of a GLM-4-9B step at ~87%
# of copy bandwidth)? Its GPU tests, then gemv_probe.py at both shapes, batch 1 and 4.
# Usage on the device (carry .device/wheels): bash scripts/device/pending19b.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH
KVLOCKS_TEST_TIMEOUT=120 bash scripts/device/gpu_tests.sh "$out" 2 tests/test_kernels.py -k gemv
export PYTHONPATH=$PWD/src
timeout 400 python scripts/device/gemv_probe.py --out "$out/gemv.jsonl" > "$out/gemv.txt" 2>&1
echo "probe exit $?"; grep step_ms "$out/gemv.jsonl"
