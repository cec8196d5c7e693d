#!/usr/bin/env bash
# Ran in session 15 (docs/results/gpu_session15/call1); the prefetch and its l2_prefetch A/B modes were
# removed afterwards (slower), so it runs only at commit c1284b3.
# Next session's first call (~7 min; carry .device/wheels: `bash scripts/device/prepare.sh` first).
# 1. the L2 prefetch prepared in session 14 (engine.step.L2_PREFETCH, off): its GPU test (same tokens
#    with the prefetch on, under CUDA graphs), then GLM-4-9B end to end, interleaved A/B at 1M (budget
#    a quarter, half and three quarters of the L2; forked before the score kernel) and at 32K / 256K;
# 2. then (pending15b.sh) the whole GPU kernel suite: session 14's runs stopped at their time limits.
# Usage on the device: bash scripts/device/pending15.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_engine.py -k "prefetch or on_scored" > "$out/t_prefetch.txt" 2>&1
echo "prefetch tests exit $?"; tail -3 "$out/t_prefetch.txt"
timeout 300 python scripts/device/select_ab.py --out "$out/ab1m" --contexts 1048576 \
    --modes defaults11,l2_prefetch,l2_prefetch_075,l2_prefetch_025,l2_prefetch_q,defaults11,l2_prefetch > "$out/ab1m.txt" 2>&1
echo "ab 1M exit $?"; grep -E "^(defaults11|l2_prefetch)" "$out/ab1m.txt"
timeout 150 python scripts/device/select_ab.py --out "$out/ab_short" --contexts 32768,262144 \
    --modes defaults11,l2_prefetch,defaults11,l2_prefetch > "$out/ab_short.txt" 2>&1
echo "ab 32K/256K exit $?"; grep -E "^(defaults11|l2_prefetch)" "$out/ab_short.txt"
