#!/usr/bin/env bash
# Session 17's first call (~6 min; carry .device/prev, made by
#   git show 45d1ecb:src/kvlocks/scoring/score_mma.cu > .device/prev/score_mma_s16.cu).
# The CUDA score kernel with two 4-page groups per pipeline step (KVLOCKS_SCORE_PAIR: both groups'
# dependent chains in one interleaved body, two groups copied ahead; two-warp blocks, four group
# slots per warp) against session 16's kernel and this tree's (the group body generalised over the
# groups per step, one group at four warps), checked against the torch reference, then timed
# side by side, interleaved, at 1M and 32K (the score kernel is the largest excess over the byte
# floor at 1M, and one tile's four dependent groups per warp set its time at 32K).
# Ran at 7aba31f (session 17, call 1): not faster; the pair variant was removed in the next commit
# (570d609), so this script is the record and needs that commit's score_mma.cu to run again.
# Usage on the device: bash scripts/device/pending17.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
{ echo '#define KVLOCKS_SCORE_PAIR 1'; cat src/kvlocks/scoring/score_mma.cu; } > /tmp/score_pair.cu
src=src/kvlocks/scoring/score_mma.cu
timeout 420 python scripts/device/mma_probe.py --check --time --reps 3 --tokens 1048576,32768 \
    --sources "s16=.device/prev/score_mma_s16.cu@4,base=$src@4,pair=/tmp/score_pair.cu@2,base2=$src@2" \
    --out "$out/pair.jsonl" > "$out/pair.txt" 2>&1
echo "pair exit $?"
grep -E "FAIL|FAILURES|source:" "$out/pair.txt" | tail -12
python3 scripts/device/show_jsonl.py "$out/pair.jsonl" tokens shape name source warps ppp rep us pct_copy
