#!/usr/bin/env bash
# Session 18's third and fourth calls (~8 min each): every e2e row of one model with programmatic
# dependent launch on (kvlocks.pdl.ENABLED, the default since session 18), the same commands as
# session 16's table. Usage on the device: bash scripts/device/pending18c.sh "$OUT" glm|llama
set -u
out=${1:?output folder}
model=${2:?glm or llama}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
if [ "$model" = glm ]; then
    timeout 480 python -m kvlocks.cli bench e2e --out "$out/e2e" --models glm4-9b-1m \
        --contexts 1M,512K,128K,64K,32K,16K --batches 1,2,3,4 --steps 16 --max-prefill 64K > "$out/e2e.txt" 2>&1
else
    timeout 480 python -m kvlocks.cli bench e2e --out "$out/e2e" --models llama3.1-8b \
        --contexts 768K,512K,128K,64K,32K,16K --batches 1 --steps 16 --max-prefill 64K > "$out/e2e.txt" 2>&1
fi
echo "e2e exit $?"; grep -E " x[0-9]|rows|copy" "$out/e2e.txt" | tail -30
python scripts/device/show_dense_launch.py "$out/e2e/summary.json"
