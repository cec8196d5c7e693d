#!/usr/bin/env bash
# Session 12's third call (~9 min). pending12c.sh's one-sided steps ran out of time: the one-sided
# kernel takes ~80 s to compile with Triton 3.6 (timed on the CPU host, sm_90 target), more than the
# 70-100 s limits they had. Here with room for the compile:
# 1. build probe: lean and one-sided at 1M, both shapes (times and reconstruction vs lean);
# 2. Llama e2e: the rows pending12c's 120 s did not reach (32K, 16K, batch 1-4 at 256K);
# 3. Nsight Compute of the one-sided build kernel.
# Usage on the device: bash scripts/device/pending12d.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 220 python scripts/device/build_probe.py --variants lean:1:1,onesided:1:1 \
    --out "$out/build.jsonl" > /dev/null 2> "$out/build.err"
echo "build probe exit $?"
python3 scripts/device/show_jsonl.py "$out/build.jsonl" shape rotation BP num_warps auto layer_ms model_s recon_diff_vs_first recon_err_vs_keys
timeout 170 python -m kvlocks.cli bench e2e --out "$out/e2e_llama" --models llama3.1-8b \
    --contexts 32K,16K --batches 1,2,3,4 --batch-context 256K --steps 16 \
    --max-prefill 64K > "$out/e2e_llama_rest.txt" 2>&1
echo "llama exit $?"
grep -E "tpot|skipped|rows|ERROR" "$out/e2e_llama_rest.txt" | tail -30
mkdir -p "$out/ncu"
timeout 130 ncu --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section SchedulerStats --section SourceCounters -k regex:_build_kernel -c 1 -f -o "$out/ncu/build_onesided" \
    python scripts/device/build_probe.py --shapes llama3-8b --tokens 65536 --variants onesided:1:1 --reps 1 \
    --out /tmp/build_ncu_onesided.jsonl > "$out/ncu_build_onesided.log" 2>&1
echo "build ncu onesided exit $?"
ncu -i "$out/ncu/build_onesided.ncu-rep" --page details > "$out/ncu_build_onesided.txt" 2>&1
grep -E "Duration|Issue Slots Busy|Achieved Occupancy|Registers Per Thread|Eligible" "$out/ncu_build_onesided.txt" | head -12
tar czf /tmp/pending12d.tgz -C "$out" . && mv /tmp/pending12d.tgz "$out/all.tgz" && rm -rf "$out/ncu" "$out/e2e_llama"
ls "$out"
