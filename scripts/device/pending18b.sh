#!/usr/bin/env bash
# Session 18's second call (~9 min): programmatic dependent launch (kvlocks.pdl) for the decode step's
# chain (score -> fused selection -> split-KV attention -> merge). 1) GPU tests: PDL on gives the same
# pages / outputs / tokens as off (kernel plan, eager and graph-replayed; the engine's graph test);
# 2) select_ab.py, GLM-4-9B shape, batch 1, both methods, modes interleaved: 32K x2, then 1M LOCKS.
# Usage on the device (carry .device/wheels): bash scripts/device/pending18b.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH
python -c "import triton, triton.language as tl; print('triton', triton.__version__, hasattr(tl.extra.cuda, 'gdc_wait'))"
KVLOCKS_TEST_TIMEOUT=200 bash scripts/device/gpu_tests.sh "$out" 4 tests/test_kernels.py tests/test_engine.py \
    -k "programmatic or graph_capturable or decode_plan or test_cuda_graph_replay_equals_eager_steps"
export PYTHONPATH=$PWD/src
timeout 200 python scripts/device/select_ab.py --model glm4-9b-1m --contexts 32768 --methods locks,dense \
    --modes defaults11,pdl,defaults11,pdl --out "$out/ab32" > "$out/ab32.txt" 2>&1
echo "ab32 exit $?"; grep -E "^(defaults11|pdl) " "$out/ab32.txt"
timeout 150 python scripts/device/select_ab.py --model glm4-9b-1m --contexts 1048576 --methods locks \
    --modes defaults11,pdl --out "$out/ab1m" > "$out/ab1m.txt" 2>&1
echo "ab1m exit $?"; grep -E "^(defaults11|pdl) " "$out/ab1m.txt"
