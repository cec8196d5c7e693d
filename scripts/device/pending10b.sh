#!/usr/bin/env bash
# Session 10's end-to-end questions (GLM-4-9B shape, random weights; one call, ~6 min):
# - each layer's q/k/v projections as one product over the three weights in one matrix
#   (engine.step.FUSE_QKV: two fewer launches per layer; the k and v products read 4 MB each)
#   against the defaults, LOCKS, batch 1, at 1M and 32K (select_ab.py, same machine);
# - TTFT with the new measurement (the median of 3 real prefills of each method, dense and
#   LOCKS's alternating: session 9's single runs showed an order effect) and the short-context
#   rows with the idle build launches skipped (on since session 10), 16K-64K.
# Usage on the device: bash scripts/device/pending10b.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 200 python scripts/device/select_ab.py --modes skip_idle_builds,fused_qkv --contexts 1048576,32768 \
    --out "$out/ab_qkv" > "$out/ab_qkv.txt" 2>&1
echo "e2e A/B exit $?"
grep -E "^(skip|fused)" "$out/ab_qkv.txt"
timeout 300 python -m kvlocks.cli bench e2e --out "$out/e2e_short" --models glm4-9b-1m --contexts 16K,32K,64K \
    --batches 1 --batch-context 16K --steps 32 --max-prefill 64K > "$out/e2e_short.txt" 2>&1
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
tar czf /tmp/pending10b.tgz -C "$out" . && mv /tmp/pending10b.tgz "$out/all.tgz" && rm -rf "$out/ab_qkv" "$out/e2e_short"
ls "$out"
