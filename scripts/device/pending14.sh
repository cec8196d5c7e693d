#!/usr/bin/env bash
# Next session's first call (~9 min; carry .device/wheels: `bash scripts/device/prepare.sh` first).
# What session 13 changed and could not run on the GPU before its device time ran out:
# 1. the GPU kernel tests (xdist): incl. the new one-sided register-cap equality
#    (test_build_with_register_cap_equals_uncapped[onesided-loop], ~80 s to compile per variant on
#    the image's Triton 3.6) and the fused selection at session 13's pages per program;
# 2. the kernel grid at batch 1 (`kvlocks bench kernels --batches 1`: the select rows at 16K-64K changed).
# Usage on the device: bash scripts/device/pending14.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
KVLOCKS_TEST_TIMEOUT=330 bash scripts/device/gpu_tests.sh "$out/tests" 6 tests/test_kernels.py tests/test_nvcc.py
timeout 240 python -m kvlocks.cli bench kernels --out "$out/kern" --batches 1 > "$out/kern.txt" 2>&1
echo "kernels exit $?"; tail -30 "$out/kern.txt"
