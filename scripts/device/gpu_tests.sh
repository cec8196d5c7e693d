#!/usr/bin/env bash
# The GPU test run in one device call: the kernel and nvcc tests and the engine's GPU tests (small
# random models: no bundled model needed) with pytest-xdist workers sharing the GPU (Triton and nvcc compiles are CPU-bound; one process took three 10-minute
# calls in session 8). Needs the pytest-xdist / execnet wheels carried in .device/wheels
# (`bash scripts/device/prepare.sh` fetches them here).
# Usage on the device (carry .device/wheels): bash scripts/device/gpu_tests.sh "$OUT" [workers] [pytest args]
# (KVLOCKS_TEST_TIMEOUT: pytest's time limit in seconds, default 540). 12 workers ran out of GPU memory
# in session 9 (11 of 130 failed with out-of-memory errors, each test alone uses up to ~30 GB); 8 ran
# without running out of memory in session 15.
# The compile-heavy tests (marker compile_heavy: the one-sided build, minutes each with Triton 3.6) start
# first, one per worker (KVLOCKS_HEAVY_FIRST=1 and --maxschedchunk 2; tests/conftest.py heavy_first).
set -u
out=${1:?output folder}
workers=${2:-6}
shift $(( $# > 1 ? 2 : 1 ))
export PYTHONPATH=$PWD/src:/tmp/xdist PATH=/usr/local/cuda/bin:$PATH
mkdir -p "$out"
python -m pip install -q --no-deps --target /tmp/xdist .device/wheels/*.whl > "$out/pip.txt" 2>&1
if [ $# -gt 0 ]; then args=("$@"); else  # pytest arguments kept as given (a -k expression has spaces)
    args=(tests/test_kernels.py tests/test_nvcc.py
          tests/test_engine.py::test_engine_with_cuda_score_kernel_equals_triton_score_kernel
          tests/test_engine.py::test_cuda_graph_replay_equals_eager_steps
          tests/test_engine.py::test_compiled_step_equals_eager_and_compiles_once_for_all_layers)
fi
KVLOCKS_HEAVY_FIRST=1 timeout "${KVLOCKS_TEST_TIMEOUT:-540}" python -m pytest -q -rs -p no:cacheprovider -p xdist -n "$workers" \
    --maxschedchunk 2 --durations=15 \
    "${args[@]}" > "$out/pytest_gpu.txt" 2>&1
echo "pytest exit $?"
tail -25 "$out/pytest_gpu.txt"
