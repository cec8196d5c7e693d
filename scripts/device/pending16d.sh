#!/usr/bin/env bash
# Session 16's fourth call (~5 min): LOCKS's attention over the selected pages tuned like dense's
# (kvlocks.engine.attention.LocksAttention.tune): the engine GPU tests that compare engines (one
# launch given to the tuner) and the GLM-4-9B e2e rows at 1M, 256K, 64K, 32K and 16K with both
# methods tuned.
# Usage on the device: bash scripts/device/pending16d.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 200 python -m pytest -q -rs -p no:cacheprovider \
    tests/test_engine.py::test_cuda_graph_replay_equals_eager_steps \
    tests/test_engine.py::test_auto_switch_mid_decode_with_cuda_graphs \
    tests/test_engine.py::test_engine_with_cuda_score_kernel_equals_triton_score_kernel \
    tests/test_engine.py::test_triton_backend_matches_torch_backend > "$out/pytest_gpu.txt" 2>&1
echo "pytest exit $?"; tail -3 "$out/pytest_gpu.txt"
timeout 330 python -m kvlocks.cli bench e2e --out "$out/e2e" --models glm4-9b-1m \
    --contexts 1M,64K,32K,16K --batches 1 --steps 16 --max-prefill 64K > "$out/e2e.txt" 2>&1
echo "e2e exit $?"; grep -E " x[0-9]|rows|copy" "$out/e2e.txt" | tail -16
python - "$out/e2e/summary.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["model"], r["context"], r["batch"], r["method"], r["kernel"].split("launch ")[-1])
PY
