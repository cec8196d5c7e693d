#!/usr/bin/env bash
# Session 13's fourth call (~7 min): GLM-4-9B e2e rows, batch 1, 16K-1M, on the committed kernels
# (after call 3: the score kernel's one-tile variant removed, the short-context selection sizes kept).
# Usage on the device: bash scripts/device/pending13d.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 480 python -m kvlocks.cli bench e2e --out "$out/e2e" --models glm4-9b-1m --contexts 1M,128K,64K,32K,16K \
    --batches 1 --steps 16 --max-prefill 64K > "$out/e2e.txt" 2>&1
echo "e2e exit $?"; grep -E "x1|rows" "$out/e2e.txt" | tail -20
