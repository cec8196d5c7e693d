#!/usr/bin/env bash
# Session 16's second call (~9 min): the rest of the e2e table against the tuned dense baseline:
# GLM-4-9B 256K x 2-4 and Llama-3.1-8B batch 1 at 16K-768K.
# Usage on the device: bash scripts/device/pending16b.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 200 python -m kvlocks.cli bench e2e --out "$out/e2e_glm" --models glm4-9b-1m --contexts 256K \
    --batches 2,3,4 --steps 16 > "$out/e2e_glm.txt" 2>&1
echo "glm exit $?"; grep -E " x[0-9]|rows" "$out/e2e_glm.txt" | tail -12
timeout 360 python -m kvlocks.cli bench e2e --out "$out/e2e_llama" --models llama3.1-8b \
    --contexts 768K,512K,128K,64K,32K,16K --batches 1 --steps 16 --max-prefill 64K > "$out/e2e_llama.txt" 2>&1
echo "llama exit $?"; grep -E " x[0-9]|rows" "$out/e2e_llama.txt" | tail -20
