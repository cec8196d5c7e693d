#!/usr/bin/env bash
# Time limits sum to 580 s (a call may run 600 s).
# Session 10's end-to-end questions (GLM-4-9B shape, random weights; one call, ~9 min):
# - each layer's q/k/v projections as one product over the three weights in one matrix
#   (engine.step.FUSE_QKV: two fewer launches per layer; the k and v products read 4 MB each)
#   against the defaults, LOCKS, batch 1, at 1M and 32K (select_ab.py, same machine), and the
#   radix passes over rebased keys (selection.triton.REBASE_KEYS: ~30% fewer passes in an
#   emulation, docs/results/radix_passes.json), end to end and alone (fused_select_probe.py), and
#   the K/V writes inside the compiled projection piece (engine.step.KV_WRITE_IN_PIECE), the
#   attention's split merge in its own kernel (attention.triton.MERGE_IN_KERNEL), and all four;
# - TTFT with the new measurement (the median of 3 real prefills of each method, dense and
#   LOCKS's alternating: session 9's single runs showed an order effect) and the short-context
#   rows with the idle build launches skipped (on since session 10), 16K-64K.
# First the selection's GPU tests (every radix option against the reference, rebased keys included).
# Usage on the device (carry .device/wheels): bash scripts/device/pending10b.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH
KVLOCKS_TEST_TIMEOUT=120 bash scripts/device/gpu_tests.sh "$out/tests" 4 tests/test_kernels.py::test_select_matches_reference \
    tests/test_kernels.py::test_rank_and_select_matches_reference \
    tests/test_kernels.py::test_rank_and_select_breaks_ties_by_page_index \
    tests/test_engine.py::test_auto_switch_mid_decode_with_cuda_graphs tests/test_kernels.py::test_attention_matches_reference \
    | tail -3
export PYTHONPATH=$PWD/src
timeout 230 python scripts/device/select_ab.py --modes skip_idle_builds,fused_qkv,rebase_keys,kv_write,merge_in_kernel,prepared10 --contexts 1048576,32768 \
    --out "$out/ab_qkv" > "$out/ab_qkv.txt" 2>&1
echo "e2e A/B exit $?"
grep -E "^(skip|fused|rebase|kv_write|merge|prepared)" "$out/ab_qkv.txt"
timeout 80 python scripts/device/fused_select_probe.py --out "$out/select_rebase.jsonl" --chunks default \
    --contexts 65536,262144,1048576 --batches 1 --early on --regs on --bits 5 --rebase both > /dev/null 2>&1
echo "select probe exit $?"
python3 - "$out/select_rebase.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["shape"], r["tokens"], r["variant"], round(r["us"], 2), r.get("same"))
PY
timeout 150 python -m kvlocks.cli bench e2e --out "$out/e2e_short" --models glm4-9b-1m --contexts 16K,32K,64K \
    --batches 1 --batch-context 16K --steps 24 --max-prefill 64K > "$out/e2e_short.txt" 2>&1
echo "e2e exit $?"
python3 - "$out/e2e_short/summary.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(r["context"], r["method"], round(r["tpot_ms"], 3), r.get("speedup_vs_dense") and round(r["speedup_vs_dense"], 3),
          r["ttft_ms"] and round(r["ttft_ms"], 1), [round(x, 1) for x in r.get("ttft_runs_ms") or []],
          r.get("build_exposed_ms") and round(r["build_exposed_ms"], 1))
print("errors", d["errors"])
PY
# at most 8 files come back from $OUT: everything in one archive, the printed summaries beside it
tar czf /tmp/pending10b.tgz -C "$out" . && mv /tmp/pending10b.tgz "$out/all.tgz" && rm -rf "$out/ab_qkv" "$out/e2e_short" "$out/tests"
ls "$out"
