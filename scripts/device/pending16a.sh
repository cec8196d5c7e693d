#!/usr/bin/env bash
# Session 16's first call (~3 min; run as call 1, its -k also deselected the engine tests): the dense baseline tuned (kvlocks.attention.tune) checked on the
# GPU (the tuner's kernel test, the engine's CUDA-graph tests, which tune before capture), then every
# GLM-4-9B batch-1 e2e row, dense and LOCKS, against the tuned dense.
# Usage on the device: bash scripts/device/pending16a.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 120 python -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py -k dense_tuner \
    tests/test_engine.py::test_cuda_graph_replay_equals_eager_steps \
    tests/test_engine.py::test_auto_switch_mid_decode_with_cuda_graphs \
    tests/test_engine.py::test_triton_backend_matches_torch_backend > "$out/pytest_gpu.txt" 2>&1
echo "pytest exit $?"; tail -3 "$out/pytest_gpu.txt"
timeout 450 python -m kvlocks.cli bench e2e --out "$out/e2e" --models glm4-9b-1m \
    --contexts 1M,512K,128K,64K,32K,16K --batches 1 --steps 16 --max-prefill 64K > "$out/e2e.txt" 2>&1
echo "e2e exit $?"; grep -E "x1|rows|copy" "$out/e2e.txt" | tail -24
python - "$out/e2e/summary.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    if r["method"] == "dense":
        print(r["context"], r["batch"], r["kernel"].split("launch ")[-1])
PY
