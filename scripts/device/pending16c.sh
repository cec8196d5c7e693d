#!/usr/bin/env bash
# Session 16's third call (~6 min): the Llama-3.1-8B e2e rows, batch 1 at 16K-768K, against the tuned
# dense baseline.
# Usage on the device: bash scripts/device/pending16c.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 540 python -m kvlocks.cli bench e2e --out "$out/e2e_llama" --models llama3.1-8b \
    --contexts 768K,512K,128K,64K,32K,16K --batches 1 --steps 16 --max-prefill 64K > "$out/e2e_llama.txt" 2>&1
echo "llama exit $?"; grep -E " x[0-9]|rows|copy" "$out/e2e_llama.txt" | tail -20
python scripts/device/show_dense_launch.py "$out/e2e_llama/summary.json"
