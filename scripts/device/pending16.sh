#!/usr/bin/env bash
# Next session's first call (~8 min; carry .device/wheels: `bash scripts/device/prepare.sh` first).
# The whole GPU test list of gpu_tests.sh (kernel + nvcc tests and the engine's CUDA-graph / compiled
# step / CUDA score kernel tests) in one call, 8 workers: session 15 needed two calls because the
# one-sided build tests (up to 229 s each with the device's Triton 3.6) queued behind one worker;
# they now start first, one per worker (tests/conftest.py heavy_first). Every test is named (-v -v).
# Usage on the device: bash scripts/device/pending16.sh "$OUT"
set -u
out=${1:?output folder}
KVLOCKS_TEST_TIMEOUT=490 bash scripts/device/gpu_tests.sh "$out/tests" 8 tests/test_kernels.py tests/test_nvcc.py \
    tests/test_engine.py::test_engine_with_cuda_score_kernel_equals_triton_score_kernel \
    tests/test_engine.py::test_cuda_graph_replay_equals_eager_steps \
    tests/test_engine.py::test_compiled_step_equals_eager_and_compiles_once_for_all_layers \
    tests/test_engine.py::test_auto_switch_mid_decode_with_cuda_graphs tests/test_engine.py::test_triton_backend_matches_torch_backend \
    -v -v --durations=20 > /dev/null
grep -c PASSED "$out/tests/pytest_gpu.txt"; grep -E "FAILED|ERROR" "$out/tests/pytest_gpu.txt" | head -20
tail -3 "$out/tests/pytest_gpu.txt"
