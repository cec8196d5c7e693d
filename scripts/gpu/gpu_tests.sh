#!/usr/bin/env bash
# The GPU test list in one GPU run: the kernel, nvcc, re-rank and vLLM decode-step tests, the batch-invariant
# plans' bits, and the engine's GPU tests (small random models, no bundled model needed), under pytest-xdist workers that share the GPU (Triton and
# nvcc compiles are CPU-bound: one process needs about three 10-minute calls for the list).
#
#   bash scripts/gpu/gpu_tests.sh OUT [workers] [pytest args]
#
# OUT gets pytest_gpu.txt (every test named, the 20 slowest timed). workers: default 8 (on the H200
# 8 ran the list in about 6 min; 12 ran out of GPU memory, a test alone takes up to ~30 GB). pytest
# args replace the default list (quote a -k expression). TIMEOUT_S: pytest's time limit, default 540.
# The compile-heavy tests (marker compile_heavy: minutes each with the image's Triton 3.6) start first,
# one per worker (KVLOCKS_HEAVY_FIRST=1 with --maxschedchunk 2; tests/conftest.py heavy_first).
# pytest-xdist comes from the image or from the staged tests bundle (scripts/gpu/README.md).
set -u
out=${1:?usage: gpu_tests.sh OUT [workers] [pytest args]}
workers=${2:-8}
shift $(( $# > 1 ? 2 : 1 ))
cd "$(dirname "$0")/../.." || exit 2
python3 scripts/gpu/stage.py env > /dev/null && . /tmp/kvlocks-stage/env.sh || exit 2
python3 -c "import xdist" 2>/dev/null || { echo "pytest-xdist is missing: stage the tests bundle"; exit 2; }
mkdir -p "$out"
if [ $# -gt 0 ]; then
    args=("$@")
else
    args=(tests/test_kernels.py tests/test_nvcc.py tests/test_rerank.py tests/test_vllm_cuda_step.py
          "tests/test_plan_paths.py::test_a_batch_invariant_plan_gives_each_row_the_same_bits_in_any_batch")
    for t in test_engine_with_cuda_score_kernel_equals_triton_score_kernel test_cuda_graph_replay_equals_eager_steps \
             test_compiled_step_equals_eager_and_compiles_once_for_all_layers test_auto_switch_mid_decode_with_cuda_graphs \
             test_triton_backend_matches_torch_backend test_compiled_graph_step_with_inductor_pdl_equals_without; do
        if grep -q "^def $t(" tests/test_engine.py; then args+=("tests/test_engine.py::$t"); else echo "not in tests/test_engine.py: $t"; fi
    done
fi
KVLOCKS_HEAVY_FIRST=1 timeout "${TIMEOUT_S:-540}" python3 -m pytest -v -rs -p no:cacheprovider -p xdist -n "$workers" \
    --maxschedchunk 2 --durations=20 "${args[@]}" > "$out/pytest_gpu.txt" 2>&1
rc=$?
echo "pytest exit $rc ($(grep -c PASSED "$out/pytest_gpu.txt") passed lines)"
grep -E "^(FAILED|ERROR)" "$out/pytest_gpu.txt" | head -20
tail -2 "$out/pytest_gpu.txt"
exit $rc
