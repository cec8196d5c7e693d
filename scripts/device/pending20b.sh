#!/usr/bin/env bash
# Prepared in session 19 for the next session (~2 min, the second of two calls: the first is
# `bash scripts/device/stage1.sh` with carry .device/p1, this one right after with carry .device/p2).
# Issue 6's correctness checks on the bundled model with every default since session 9's run (PDL for
# every kernel, fused q/k/v, K/V writes in the projection piece, tuned attention launches) and, with
# --compile, the compiled pieces (max-autotune at batch 1): the engine's greedy tokens against the CPU
# reference at budget >= context and against the Hugging Face LocksCache path at budget 256, 2K and 8K.
# Usage on the device: bash scripts/device/pending20b.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH
source scripts/device/stage2.sh
timeout 500 python3 scripts/device/engine_check.py --out "$out/engine_check" --lengths 2048 8000 --no-bench \
    --compile > "$out/engine_check.txt" 2>&1
echo "engine_check exit $?"; grep -E "PASS|FAIL|INFO" "$out/engine_check.txt"
