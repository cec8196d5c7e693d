#!/usr/bin/env bash
# Session 17's second call (~9 min; carry .device/wheels). The page selection in the CUDA score
# kernel's tail (rows of at most 4096 pages: the last program of each row ranks and selects, no
# selection launch): its GPU tests beside the score, selection and decode-plan tests and the engine
# tests that compare paths, then a same-machine end-to-end A/B, GLM-4-9B shape at 32K and 16K,
# batch 1, tail vs the fused Triton selection (no_tail), interleaved twice, dense rows alongside.
# Ran at 2ea6215 (session 17, call 2): every test passed, the tail was slower end to end (32K +0.8 ms,
# 16K +0.2 ms per step), and it was removed in the next commit; this script is the record.
# Usage on the device: bash scripts/device/pending17b.sh "$OUT"
set -u
out=${1:?output folder}
KVLOCKS_TEST_TIMEOUT=250 bash scripts/device/gpu_tests.sh "$out/tests" 4 tests/test_kernels.py \
    -k "tail or cuda_score_kernel or rank_and_select or decode_plan or graph_capturable" -v > /dev/null
grep -c PASSED "$out/tests/pytest_gpu.txt"; grep -E "FAILED|ERROR" "$out/tests/pytest_gpu.txt" | head -20
tail -2 "$out/tests/pytest_gpu.txt"
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 120 python -m pytest -q -rs -p no:cacheprovider \
    tests/test_engine.py::test_engine_with_cuda_score_kernel_equals_triton_score_kernel \
    tests/test_engine.py::test_cuda_graph_replay_equals_eager_steps > "$out/pytest_engine.txt" 2>&1
echo "engine tests exit $?"; tail -2 "$out/pytest_engine.txt"
timeout 270 python scripts/device/select_ab.py --out "$out/ab" --contexts 32768,16384 --methods locks,dense \
    --modes no_tail,defaults11,no_tail,defaults11 --steps 16 > "$out/ab.txt" 2>&1
echo "ab exit $?"; grep -E "^(no_tail|defaults11) " "$out/ab.txt"
