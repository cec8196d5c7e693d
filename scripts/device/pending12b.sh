#!/usr/bin/env bash
# Session 12's second call (~4 min; limits sum to 240 s), right after pending12.sh:
# 1. Nsight Compute of the build kernel, the default (lean, Gram + two-sided Jacobi) and the
#    one-sided solver: pipe utilisation (shared memory / shuffles against the ALUs) and stalls, to
#    confirm or refute docs/benchmarks.md's "bound by the shared-memory/shuffle pipe" reading;
# 2. the full Llama e2e command again: its 256K x 3 row (9th cache size in the process) ran the
#    projection piece eagerly in session 11 and is out of bench_e2e.json; with the dynamic cache rows
#    it must be back near 10.7 ms (and the bench now errors instead of running eagerly).
# Usage on the device: bash scripts/device/pending12b.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
mkdir -p "$out/ncu"
for rot in lean onesided; do
    timeout 50 ncu --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --section SchedulerStats --section SourceCounters -k regex:_build_kernel -c 1 -f -o "$out/ncu/build_$rot" \
        python scripts/device/build_probe.py --shapes llama3-8b --tokens 65536 --variants "$rot:1:1" --reps 1 \
        --out "/tmp/build_ncu_$rot.jsonl" > "$out/ncu_build_$rot.log" 2>&1
    echo "build ncu $rot exit $?"
    ncu -i "$out/ncu/build_$rot.ncu-rep" --page details > "$out/ncu_build_$rot.txt" 2>&1
    grep -E "Duration|Issue Slots Busy|Achieved Occupancy|Registers Per Thread|Stall|Pipe|LSU|MIO|Eligible" \
        "$out/ncu_build_$rot.txt" | head -20
done
timeout 120 python -m kvlocks.cli bench e2e --out "$out/e2e_llama" --models llama3.1-8b \
    --contexts 1M,768K,512K,256K,128K,64K,32K,16K --batches 1,2,3,4 --batch-context 256K --steps 16 \
    --max-prefill 64K > "$out/e2e_llama.txt" 2>&1
echo "llama exit $?"
grep -E "tpot|skipped|rows|ERROR" "$out/e2e_llama.txt"
tar czf /tmp/pending12b.tgz -C "$out" . && mv /tmp/pending12b.tgz "$out/all.tgz" && rm -rf "$out/ncu"
ls "$out"
