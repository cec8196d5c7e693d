#!/usr/bin/env bash
# Session 17's fourth call (~7 min). The fused selection's pages per program at short contexts
# (session 13 timed 512, 1024 and 2048 at 32K: 9.43 / 10.61 / 10.96 us, smaller was faster, 256
# and 128 untried): alone at 16K-64K with 128-1024 pages per program at 4 and 8 warps, then end
# to end at 32K (GLM-4-9B, batch 1, LOCKS), the default (512 at 8 warps) against 256 at 4 warps,
# interleaved twice.
# Usage on the device: bash scripts/device/pending17d.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 150 python scripts/device/small_ctx_probe.py --skip-score --contexts 16384,32768,65536 \
    --select-chunks 128,256,512,1024 --select-warps 4,8 --out "$out/small.jsonl" > "$out/small.txt" 2>&1
echo "probe exit $?"
python3 scripts/device/show_jsonl.py "$out/small.jsonl" shape tokens chunk warps n_chunks default same_pages us
for rep in 1 2; do
    for chunk in 0 256; do
        timeout 100 python scripts/device/select_ab.py --out "$out/ab_${chunk}_$rep" --contexts 32768 \
            --modes defaults11 --fused-chunk $chunk --fused-warps $([ $chunk = 0 ] && echo 0 || echo 4) \
            --steps 16 > "$out/ab_${chunk}_$rep.txt" 2>&1
        echo "ab chunk=$chunk rep=$rep exit $?: $(grep -E '^defaults11 ' "$out/ab_${chunk}_$rep.txt")"
    done
done
