#!/usr/bin/env bash
# Session 13's first call (~9 min). Open questions of session 12:
# 1. the build with Triton 3.9 (what users install; 1.094 s for llama3-8b at 1M, target < 1 s): do
#    register caps (more resident warps: both solvers run 2 warps per scheduler, latency-bound) help?
#    Cubins compiled on the CPU host beforehand (~3 min):
#      PYTHONPATH=src .venv/bin/python scripts/device/cubin_probe.py --compile .device/cubins13 \
#          --variants lean,onesided,lean:128,onesided:128,onesided:168
# 2. GLM-4-9B at 32K: the kernel grid puts LOCKS's kernels below dense's there (bench_kernels.json:
#    16K 27.5 vs 23.5 us, 64K 33.0 vs 52.8 us per layer), yet its TPOT is 0.98x dense's: the step
#    profile (kernel classes and the time with no kernel running) says where the rest goes.
# Usage on the device (carry .device/cubins13): bash scripts/device/pending13.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 120 python scripts/device/cubin_probe.py --time .device/cubins13 --out "$out/cubin.jsonl" > "$out/cubin.txt" 2>&1
echo "cubin exit $?"
python3 scripts/device/show_jsonl.py "$out/cubin.jsonl" file layer_ms model_s recon_diff_vs_first
for ctx in 32768 1048576; do
    timeout 150 python scripts/device/step_profile.py --model glm4-9b-1m --context $ctx --compile \
        --out "$out/profile_glm_$ctx.json" > "$out/profile_glm_$ctx.txt" 2>&1
    echo "profile $ctx exit $?"
    tail -25 "$out/profile_glm_$ctx.txt"
done
# 3. the CUDA score kernel with four accumulator chains per page pair instead of two (half the
#    dependent-MMA depth; Nsight Compute, session 12: 20% of its stall samples are fixed-latency
#    waits), checked against the torch reference and timed side by side with the default, interleaved
{ echo '#define KVLOCKS_SCORE_CHAINS 4'; cat src/kvlocks/scoring/score_mma.cu; } > /tmp/score_chains4.cu
timeout 200 python scripts/device/mma_probe.py --check --time --reps 3 \
    --sources chains2=src/kvlocks/scoring/score_mma.cu,chains4=/tmp/score_chains4.cu --out "$out/chains.jsonl" \
    > "$out/chains.txt" 2>&1
echo "chains exit $?"
grep -E "FAIL|FAILURES|source:" "$out/chains.txt" | tail -6
python3 scripts/device/show_jsonl.py "$out/chains.jsonl" shape name source rep us pct_copy
