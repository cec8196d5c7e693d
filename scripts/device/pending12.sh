#!/usr/bin/env bash
# Session 12's first call (~9 min; limits sum to 570 s). Questions left by session 11:
# 1. the cache rows of the compiled projection piece marked dynamic (engine.step.DYNAMIC_CACHE_ROWS,
#    on since 4aa9db0, never run on a GPU): the GPU engine tests, then an A/B against static rows
#    (GLM-4-9B shape, dense and LOCKS, 1M and 32K; select_ab resets Dynamo between modes);
# 2. Nsight Compute per-instruction stalls of the CUDA score kernel (pending10d.sh): its load-only
#    variant reads at 83-89% of copy bandwidth, the kernel at 50-59%, so its arithmetic is the limit;
#    which instructions stall is the input its next change needs;
# 3. the full Llama e2e command again: its 256K x 3 row (9th cache size in the process) ran the piece
#    eagerly in session 11 and is out of bench_e2e.json; with the fix it must be back near 10.7 ms
#    (the last step: partial rows survive the time limit);
# 4. Nsight Compute of the build kernel (pipe utilisation: shared memory / shuffles, see
#    docs/benchmarks.md "Session 11").
# Usage on the device (carry .device/wheels): bash scripts/device/pending12.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH
KVLOCKS_TEST_TIMEOUT=100 bash scripts/device/gpu_tests.sh "$out/tests" 4 \
    tests/test_engine.py::test_cuda_graph_replay_equals_eager_steps \
    tests/test_engine.py::test_compiled_step_compiles_once_across_cache_sizes \
    tests/test_engine.py::test_compiled_step_equals_eager_and_compiles_once_for_all_layers | tail -3
export PYTHONPATH=$PWD/src
timeout 150 python scripts/device/select_ab.py --modes defaults11,static_cache_rows --contexts 1048576,32768 \
    --methods dense,locks --out "$out/ab_rows" > "$out/ab_rows.txt" 2>&1
echo "A/B exit $?"
grep -E "^(defaults11|static)" "$out/ab_rows.txt"
timeout 150 bash scripts/device/pending10d.sh "$out/ncu" > "$out/ncu.txt" 2>&1
echo "ncu exit $?"
tail -30 "$out/ncu.txt"
mkdir -p "$out/ncu"
# the build kernel: is it bound by the shared-memory/shuffle pipe (docs/benchmarks.md, session 11)?
timeout 60 ncu --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section SourceCounters \
    -k regex:_build_kernel -c 1 -f -o "$out/ncu/build" python scripts/device/build_probe.py --shapes llama3-8b \
    --tokens 65536 --variants lean:1:1 --reps 1 --out /tmp/build_ncu.jsonl > "$out/ncu_build.log" 2>&1
echo "build ncu exit $?"
ncu -i "$out/ncu/build.ncu-rep" --page details > "$out/ncu_build.txt" 2>&1
grep -E "Duration|Issue Slots Busy|Achieved Occupancy|Registers Per Thread|Stall|Pipe|LSU|MIO" "$out/ncu_build.txt" | head -20
timeout 110 python -m kvlocks.cli bench e2e --out "$out/e2e_llama" --models llama3.1-8b \
    --contexts 1M,768K,512K,256K,128K,64K,32K,16K --batches 1,2,3,4 --batch-context 256K --steps 16 \
    --max-prefill 64K > "$out/e2e_llama.txt" 2>&1
echo "llama exit $?"
grep -E "tpot|skipped|rows" "$out/e2e_llama.txt"
# at most 8 files come back from $OUT: everything in one archive, the printed summaries beside it
tar czf /tmp/pending12.tgz -C "$out" . && mv /tmp/pending12.tgz "$out/all.tgz" && rm -rf "$out/ab_rows" "$out/tests" "$out/ncu"
ls "$out"
