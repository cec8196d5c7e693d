#!/usr/bin/env bash
# Session 9's open questions, prepared on the CPU for the next device session (one call, ~7 min):
# does the score kernel run faster at 6 blocks per SM (cuda_mma.MIN_BLOCKS = 6: at most 80
# registers, one centroid slot per warp; 24 warps per SM instead of 20), alone (with the static and
# the balanced page split) and end to end? Its GPU tests first (same scores as the reference), with
# the CUDA-graph engine test under engine.graph.SKIP_IDLE_BUILDS (LOCKS replays one of two graphs
# per step, with or without the incremental-build launches, by the host-tracked length), and that
# mode in the e2e A/B ("skip_idle_builds").
# And the summary build with 4 Jacobi sweeps instead of 5 (scripts/analysis/build_sweeps.py on the
# CPU: the same reconstruction error against the keys to 1e-4, top-8 pages within one of 72 of the
# 5-sweep build's): how much faster is it for a whole llama3-8b model at 1M (1.18 s, target < 1 s)?
# Usage on the device (carry .device/wheels): bash scripts/device/pending9.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH
KVLOCKS_TEST_TIMEOUT=150 bash scripts/device/gpu_tests.sh "$out/tests" 4 \
    tests/test_kernels.py::test_cuda_score_kernel_matches_reference tests/test_nvcc.py \
    tests/test_engine.py::test_cuda_graph_replay_equals_eager_steps \
    tests/test_engine.py::test_engine_with_cuda_score_kernel_equals_triton_score_kernel | tail -2
export PYTHONPATH=$PWD/src
timeout 150 python scripts/device/score_launch_probe.py --out "$out/launch.jsonl" > "$out/launch.txt" 2>&1
echo "launch probe exit $?"
timeout 240 python scripts/device/select_ab.py --modes fused_regs_bits5,six,six_balanced,skip_idle_builds \
    --contexts 1048576,262144,32768 \
    --out "$out/ab_six" > "$out/ab_six.txt" 2>&1
echo "e2e A/B exit $?"
python3 - "$out/launch.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["shape"], r["tokens"], r["variant"], r.get("programs"), round(r["us"], 1), round(r["pct_copy"], 1), r.get("same_as_static"))
PY
grep -E "^(fused|six|skip)" "$out/ab_six.txt"
timeout 120 python scripts/device/build_probe.py --variants lean:1:1,lean:1:1:4 --out "$out/build_sweeps.jsonl" \
    > /dev/null 2> "$out/build_sweeps.err"
echo "build probe exit $?"
cut -c1-220 "$out/build_sweeps.jsonl"
