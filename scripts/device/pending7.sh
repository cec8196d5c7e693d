#!/usr/bin/env bash
# Session 7's open questions, prepared on the CPU for the next device session (one call, ~6 min):
# 1. does stopping the radix passes early (selection.triton.EARLY_EXIT) speed the selection up,
#    alone, in sequence after the score kernel, and end to end (same pages by construction)?
# 2. the GPU kernel tests in one call, now that the reference builds run on the GPU.
# Usage on the device: bash scripts/device/pending7.sh "$OUT"
set -u
out=${1:?output folder}
export PYTHONPATH=$PWD/src PATH=/usr/local/cuda/bin:$PATH
mkdir -p "$out"
timeout 120 python scripts/device/fused_select_probe.py --early both --chunks default --batches 1 \
    --out "$out/fused_select_early.jsonl" > /dev/null 2> "$out/fused_select_early.err"
timeout 100 python scripts/device/plan_probe.py --out "$out/plan_probe_early.jsonl" > /dev/null 2> "$out/plan_probe.err"
timeout 120 python scripts/device/select_ab.py --modes fused,fused_early --contexts 1048576,131072,32768 \
    --out "$out/select_ab_early" > "$out/select_ab_early.txt" 2>&1
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "select or rank_and_select or decode_plan or graph" \
    > "$out/pytest_gpu.txt" 2>&1
tail -1 "$out/pytest_gpu.txt"; grep -E "^fused" "$out/select_ab_early.txt"
