#!/usr/bin/env bash
# A record: the CUDA selection it checks and times was slower than the Triton kernel and removed
# (commit 1bb5f27 has it, with its tests; results in docs/results/gpu_session18/call1/).
# Session 18's first call (~8 min): the CUDA fused rank + selection (kvlocks.selection.cuda,
# select_rank.cu) checked and timed. 1) its GPU tests and the Triton selection's (same pages as the
# reference selection, ties, graph replay; nvcc compile); 2) fused_select_probe.py: the selection
# alone (CUDA graph, inputs in L2) at 16K-1M, both shapes, batch 1 and 4: the Triton kernel at its
# defaults against the CUDA kernel at several pages and threads per block (same pages checked).
# Usage on the device (carry .device/wheels): bash scripts/device/pending18.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
KVLOCKS_TEST_TIMEOUT=240 bash scripts/device/gpu_tests.sh "$out" 4 tests/test_nvcc.py tests/test_kernels.py \
    -k "nvcc or rank_and_select or graph_capturable or decode_plan"
export PYTHONPATH=$PWD/src
timeout 240 python scripts/device/fused_select_probe.py --out "$out/select.jsonl" --contexts 16384,32768,65536,262144,1048576 \
    --batches 1,4 --chunks default --early on --regs on --bits 5 --rebase on \
    --cuda-chunks default,512,1024,2048,4096 --cuda-threads 0,256,512 > "$out/select.txt" 2>&1
echo "probe exit $?"
python - "$out/select.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['shape']:>11} B{r['batch']} {r['tokens']:>8} {r['variant']:<40} {r['us']:7.2f} us same={r.get('same')}")
PY
