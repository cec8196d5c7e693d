#!/usr/bin/env bash
# Session 12's fourth call (~6 min). The CUDA score kernel's Nsight Compute run (pending12.sh) put 8.6%
# of its stall samples on the float16 -> float32 conversions right after the centroid-scale loads
# (long scoreboard: the conversion waits for the load). score_mma.cu now keeps those scales as raw bits
# until the tile's end. Here: the kernel against the torch reference (mma_probe --check), then the
# session-11 source (carried in .device/prev) and the new one timed side by side at 1M, interleaved.
# Usage on the device (carry .device/prev): bash scripts/device/pending12e.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 150 python scripts/device/mma_probe.py --check > "$out/check.txt" 2>&1
echo "check exit $?"
grep -E "FAIL|FAILURES" "$out/check.txt" | tail -5
timeout 200 python scripts/device/mma_probe.py --time --reps 3 \
    --sources s11=.device/prev/score_mma_s11.cu,new=src/kvlocks/scoring/score_mma.cu --out "$out/time.jsonl" \
    > "$out/time.txt" 2>&1
echo "time exit $?"
python3 scripts/device/show_jsonl.py "$out/time.jsonl" shape name source rep us pct_copy
