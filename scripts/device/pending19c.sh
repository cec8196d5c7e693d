#!/usr/bin/env bash
# Session 19 (~8 min): Inductor's max-autotune for the compiled pieces (engine.step.COMPILE_MODE, it
# times Triton GEMM templates against cuBLAS for each weight product) against the defaults (PDL for
# everything), GLM-4-9B shape, batch 1, both methods, interleaved at 32K, then 1M.
# Usage on the device (carry .device/wheels): bash scripts/device/pending19c.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 330 python scripts/device/select_ab.py --model glm4-9b-1m --contexts 32768 --methods locks,dense \
    --modes defaults19,max_autotune,defaults19,max_autotune --out "$out/ab32" > "$out/ab32.txt" 2>&1
echo "ab32 exit $?"; grep -E "^(defaults19|max_autotune) " "$out/ab32.txt"
rm -rf "$out/ab32"
timeout 230 python scripts/device/select_ab.py --model glm4-9b-1m --contexts 1048576 --methods locks,dense \
    --modes defaults19,max_autotune --out "$out/ab1m" > "$out/ab1m.txt" 2>&1
echo "ab1m exit $?"; grep -E "^(defaults19|max_autotune) " "$out/ab1m.txt"
