#!/usr/bin/env bash
# Session 8's open questions, prepared on the CPU for the next device session (one call, ~7 min):
# 1. do the merge's radix passes on one register tile (selection.triton.MERGE_IN_REGISTERS: the
#    chunks' winners loaded once instead of once per pass) and 5-bit radix digits (DIGIT_BITS = 5:
#    seven passes instead of eight, ~1 fewer with the early stop) speed the selection up, alone,
#    after the score kernel, and end to end (same pages by construction)?
# 2. the GPU kernel tests session 8 did not reach (build ranks 5/12, incremental build).
# Usage on the device: bash scripts/device/pending8.sh "$OUT"
set -u
out=${1:?output folder}
export PYTHONPATH=$PWD/src PATH=/usr/local/cuda/bin:$PATH
mkdir -p "$out"
timeout 120 python scripts/device/fused_select_probe.py --early on --regs both --bits 4,5 --chunks default --batches 1 \
    --out "$out/fused_select_regs.jsonl" > /dev/null 2> "$out/fused_select_regs.err"
timeout 130 python scripts/device/plan_probe.py --out "$out/plan_probe_regs.jsonl" > /dev/null 2> "$out/plan_probe.err"
timeout 200 python scripts/device/select_ab.py --modes fused,fused_regs,fused_bits5,fused_regs_bits5 --contexts 1048576,131072,32768 \
    --out "$out/select_ab_regs" > "$out/select_ab_regs.txt" 2>&1
timeout 100 python -m pytest -v -p no:cacheprovider tests/test_kernels.py -k "build_matches_reference and (dtype2 or dtype3) or incremental" \
    > "$out/pytest_gpu_build.txt" 2>&1
grep -cE "PASSED" "$out/pytest_gpu_build.txt"; grep -E "FAILED|passed|failed" "$out/pytest_gpu_build.txt" | tail -3
grep -E "^fused" "$out/select_ab_regs.txt"
