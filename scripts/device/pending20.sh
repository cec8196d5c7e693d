#!/usr/bin/env bash
# Prepared in session 19 for the next session (~9 min): max-autotune at batch 2-4. Session 19's e2e run
# compiled the pieces in max-autotune at every batch and its GLM-4-9B 256K batch 2-4 rows came out
# 0.7-1.3 ms slower than session 18's default-mode rows (another machine), so max-autotune now applies
# at batch 1 only (engine.step.COMPILE_MODE_MAX_BATCH). 1) select_ab.py on one machine, GLM-4-9B 256K,
# batches 1-4, both methods: the defaults (max-autotune at batch 1) against max-autotune everywhere and
# against session 18's settings (no PDL for the score kernel and the pieces, default compile mode), which
# separates max-autotune's part from PDL's; 2) the e2e batch rows with the defaults, for bench_e2e.json.
# Usage on the device (carry .device/wheels): bash scripts/device/pending20.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 390 python scripts/device/select_ab.py --model glm4-9b-1m --contexts 262144 --batches 1,2,3,4 \
    --methods locks,dense --modes defaults19b,max_autotune_all,session18 --out "$out/ab256" > "$out/ab256.txt" 2>&1
echo "ab256 exit $?"; grep -E "^(defaults19b|max_autotune_all|session18) " "$out/ab256.txt"
rm -rf "$out/ab256"
timeout 190 python -m kvlocks.cli bench e2e --out "$out/e2e" --models glm4-9b-1m --contexts 256K --batches 2,3,4 \
    --steps 16 --max-prefill 64K > "$out/e2e.txt" 2>&1
echo "e2e exit $?"; grep -E " x[0-9]|rows|copy" "$out/e2e.txt" | tail -12
