#!/usr/bin/env bash
# Session 12's second call (~8.5 min; limits sum to 500 s). pending12.sh's one-sided steps failed to
# compile on the device's Triton 3.6 (a @triton.jit helper returning a constant is not a constexpr
# there; fixed, and checked by compiling for sm_90 with Triton 3.6 here). This call reruns them, then
# pending12b.sh's steps:
# 1. the one-sided build against the float64 reference on the GPU;
# 2. build probe: one-sided against lean at 1M, both shapes;
# 3. Nsight Compute of both build solvers (pipe utilisation, stalls);
# 4. the engine's compile-once-across-cache-sizes test on the GPU, alone and verbose;
# 5. the full Llama e2e command (its 256K x3 row back in bench_e2e.json).
# Usage on the device (carry .device/wheels): bash scripts/device/pending12c.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH
KVLOCKS_TEST_TIMEOUT=70 bash scripts/device/gpu_tests.sh "$out/tests_build" 4 \
    tests/test_kernels.py::test_build_matches_reference -k onesided | tail -3
export PYTHONPATH=$PWD/src
timeout 100 python scripts/device/build_probe.py --variants lean:1:1,onesided:1:1,onesided:2:2,onesided:auto:0 \
    --out "$out/build.jsonl" > /dev/null 2> "$out/build.err"
echo "build probe exit $?"
python3 scripts/device/show_jsonl.py "$out/build.jsonl" shape rotation BP num_warps auto layer_ms model_s recon_diff_vs_first recon_err_vs_keys
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
KVLOCKS_TEST_TIMEOUT=80 bash scripts/device/gpu_tests.sh "$out/tests_engine" 1 -v \
    tests/test_engine.py::test_compiled_step_compiles_once_across_cache_sizes | tail -3
timeout 120 python -m kvlocks.cli bench e2e --out "$out/e2e_llama" --models llama3.1-8b \
    --contexts 1M,768K,512K,256K,128K,64K,32K,16K --batches 1,2,3,4 --batch-context 256K --steps 16 \
    --max-prefill 64K > "$out/e2e_llama.txt" 2>&1
echo "llama exit $?"
grep -E "tpot|skipped|rows|ERROR" "$out/e2e_llama.txt" | tail -30
tar czf /tmp/pending12c.tgz -C "$out" . && mv /tmp/pending12c.tgz "$out/all.tgz" && rm -rf "$out/ncu" "$out/tests_build" "$out/tests_engine" "$out/e2e_llama"
ls "$out"
