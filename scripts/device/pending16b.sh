#!/usr/bin/env bash
# Session 16's second call (~8 min): the GPU tests of the tuned dense (the tuner's kernel test and
# the engine's CUDA-graph tests, which tune before capture); the GLM-4-9B e2e rows (batch 1 at
# 16K-1M, 256K x 2-4) with the tuner's candidates extended to a quarter of the default split count
# (call 1's winner everywhere was the fewest splits it timed, half the default).
# Usage on the device: bash scripts/device/pending16b.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 150 python -m pytest -q -rs -p no:cacheprovider \
    "tests/test_kernels.py::test_dense_tuner_checks_every_launch_and_keeps_the_fastest_correct_one" \
    tests/test_engine.py::test_cuda_graph_replay_equals_eager_steps \
    tests/test_engine.py::test_auto_switch_mid_decode_with_cuda_graphs \
    tests/test_engine.py::test_triton_backend_matches_torch_backend > "$out/pytest_gpu.txt" 2>&1
echo "pytest exit $?"; tail -3 "$out/pytest_gpu.txt"
timeout 400 python -m kvlocks.cli bench e2e --out "$out/e2e" --models glm4-9b-1m \
    --contexts 1M,512K,128K,64K,32K,16K --batches 1,2,3,4 --steps 16 --max-prefill 64K > "$out/e2e.txt" 2>&1
echo "e2e exit $?"; grep -E " x[0-9]|rows|copy" "$out/e2e.txt" | tail -30
python scripts/device/show_dense_launch.py "$out/e2e/summary.json"
