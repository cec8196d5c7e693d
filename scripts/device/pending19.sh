#!/usr/bin/env bash
# Prepared in session 18 for the next session (~8 min): programmatic dependent launch beyond the
# attention's kernels. 1) GPU tests: the score kernel launched early (cuda_mma.SCORE_PDL) and the
# compiled pieces with Inductor's PDL (step.INDUCTOR_PDL) give the same outputs and tokens;
# 2) select_ab.py, GLM-4-9B shape, batch 1, both methods, interleaved: 32K x2, then 1M.
# Usage on the device (carry .device/wheels): bash scripts/device/pending19.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH
python -c "import torch._inductor.config as c; print('torch', __import__('torch').__version__, 'inductor enable_pdl:', hasattr(c.triton, 'enable_pdl'))"
KVLOCKS_TEST_TIMEOUT=240 bash scripts/device/gpu_tests.sh "$out" 4 tests/test_kernels.py tests/test_engine.py \
    -k "programmatic or inductor_pdl or test_cuda_graph_replay_equals_eager_steps"
export PYTHONPATH=$PWD/src
timeout 200 python scripts/device/select_ab.py --model glm4-9b-1m --contexts 32768 --methods locks,dense \
    --modes defaults11,score_pdl,inductor_pdl,defaults11,score_pdl,inductor_pdl --out "$out/ab32" > "$out/ab32.txt" 2>&1
echo "ab32 exit $?"; grep -E "^(defaults11|score_pdl|inductor_pdl) " "$out/ab32.txt"
timeout 200 python scripts/device/select_ab.py --model glm4-9b-1m --contexts 1048576 --methods locks,dense \
    --modes defaults11,inductor_pdl --out "$out/ab1m" > "$out/ab1m.txt" 2>&1
echo "ab1m exit $?"; grep -E "^(defaults11|inductor_pdl) " "$out/ab1m.txt"
