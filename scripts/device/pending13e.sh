#!/usr/bin/env bash
# Session 13's fifth call (~5 min): the same code as call 4; GLM-4-9B 32K / 16K again (the crossover's
# spread) with batch 2-4 at 256K, and Llama-3.1-8B at 16K-64K (the new short-context selection sizes).
# Usage on the device: bash scripts/device/pending13e.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 240 python -m kvlocks.cli bench e2e --out "$out/e2e_glm" --models glm4-9b-1m --contexts 32K,16K \
    --batches 2,3,4 --steps 16 --max-prefill 64K > "$out/e2e_glm.txt" 2>&1
echo "glm exit $?"; grep -E " x[0-9]|rows" "$out/e2e_glm.txt" | tail -20
timeout 200 python -m kvlocks.cli bench e2e --out "$out/e2e_llama" --models llama3.1-8b --contexts 64K,32K,16K \
    --batches 1 --steps 16 --max-prefill 64K > "$out/e2e_llama.txt" 2>&1
echo "llama exit $?"; grep -E " x[0-9]|rows" "$out/e2e_llama.txt" | tail -20
