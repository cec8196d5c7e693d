#!/usr/bin/env bash
# Session 17's fifth call (~4 min, the session's last device minutes). The attention tuner with the
# in-kernel split merge as a candidate (one launch instead of two, at a half and a quarter of the
# default split count): GLM-4-9B shape, 32K and 16K, batch 1, both methods; each row names the
# launch its tuner chose and carries every candidate's time (`attention_launch_us`).
# Ran at its commit (session 17, call 5): the merge candidates were the slowest everywhere and were
# removed from the tuner in the next commit; this script is the record.
# Usage on the device: bash scripts/device/pending17e.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 200 python -m kvlocks.cli bench e2e --out "$out/e2e" --models glm4-9b-1m --contexts 32K,16K \
    --batches 1 --steps 16 --max-prefill 0 > "$out/e2e.txt" 2>&1
echo "e2e exit $?"
python - "$out/e2e/summary.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    t = r.get("attention_launch_us") or {}
    best = sorted((v, k) for k, v in t.items() if v is not None)[:4]
    print(r["context"], r["method"], round(r["tpot_ms"], 3), r["kernel"].split("launch ")[-1][:90], best)
PY
