#!/usr/bin/env bash
# Session 12's first call (~9.5 min; limits sum to 570 s). Questions left by session 11, most
# informative first (outputs survive a time limit: everything is archived at the end):
# 1. GPU tests: the engine with the caches' rows of the compiled piece marked dynamic
#    (engine.step.DYNAMIC_CACHE_ROWS, on since 4aa9db0, never run on a GPU), and the one-sided Jacobi
#    build (summary.triton ROTATION "onesided", prepared, off) against the float64 reference;
# 2. build probe: the one-sided solver against the default (lean) at 1M, both shapes. Its sm_90 SASS
#    (docs/benchmarks.md, "Session 11") trades the Gram solver's 67 shared-memory/shuffle operations
#    per Jacobi step for 40 butterfly shuffles and no shared memory, at 464 instead of 252 other
#    instructions per step: faster if the shared-memory/shuffle pipe is what binds the build;
# 3. Nsight Compute per-instruction stalls of the CUDA score kernel (pending10d.sh): its load-only
#    variant reads at 83-89% of copy bandwidth, the kernel at 50-59%;
# 4. A/B: dynamic against static cache rows (GLM-4-9B shape, dense and LOCKS, 1M and 32K).
# The second call, pending12b.sh: Nsight Compute of both build solvers, the full Llama e2e command again.
# Usage on the device (carry .device/wheels): bash scripts/device/pending12.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH
KVLOCKS_TEST_TIMEOUT=100 bash scripts/device/gpu_tests.sh "$out/tests_engine" 4 \
    tests/test_engine.py::test_cuda_graph_replay_equals_eager_steps \
    tests/test_engine.py::test_compiled_step_compiles_once_across_cache_sizes \
    tests/test_engine.py::test_compiled_step_equals_eager_and_compiles_once_for_all_layers | tail -3
KVLOCKS_TEST_TIMEOUT=80 bash scripts/device/gpu_tests.sh "$out/tests_build" 4 \
    tests/test_kernels.py::test_build_matches_reference -k onesided | tail -3
export PYTHONPATH=$PWD/src
timeout 100 python scripts/device/build_probe.py --variants lean:1:1,onesided:1:1,onesided:2:2,onesided:auto:0 \
    --out "$out/build.jsonl" > /dev/null 2> "$out/build.err"
echo "build probe exit $?"
python3 scripts/device/show_jsonl.py "$out/build.jsonl" shape rotation BP num_warps auto layer_ms model_s recon_diff_vs_first recon_err_vs_keys
timeout 150 bash scripts/device/pending10d.sh "$out/ncu" > "$out/ncu.txt" 2>&1
echo "ncu exit $?"
tail -30 "$out/ncu.txt"
timeout 130 python scripts/device/select_ab.py --modes defaults11,static_cache_rows --contexts 1048576,32768 \
    --methods dense,locks --out "$out/ab_rows" > "$out/ab_rows.txt" 2>&1
echo "A/B exit $?"
grep -E "^(defaults11|static)" "$out/ab_rows.txt"
# at most 8 files come back from $OUT: everything in one archive, the printed summaries beside it
tar czf /tmp/pending12.tgz -C "$out" . && mv /tmp/pending12.tgz "$out/all.tgz" && rm -rf "$out/ab_rows" "$out/tests_engine" "$out/tests_build" "$out/ncu"
ls "$out"
