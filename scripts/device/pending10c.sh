#!/usr/bin/env bash
# Optional, after pending10.sh and pending10b.sh (one call, up to ~6 min): Inductor's max-autotune
# for the decode step's two compiled pieces (engine.step.COMPILE_MODE = "max-autotune-no-cudagraphs"),
# which times Triton templates against cuBLAS for each weight product. Session 5's profile has the
# large products at 90-97% of copy bandwidth but split-K reduction launches (5 per layer, 1.8 us
# each) and small products at 22-75% (docs/benchmarks.md). GLM-4-9B shape, LOCKS, batch 1, against
# the defaults (session 11's: defaults11), 1M and 32K. Time limit 560 s.
# Usage on the device: bash scripts/device/pending10c.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 560 python scripts/device/select_ab.py --modes defaults11,max_autotune --contexts 1048576,32768 \
    --out "$out/ab_autotune" > "$out/ab_autotune.txt" 2>&1
echo "e2e A/B exit $?"
grep -E "^(defaults11|max)" "$out/ab_autotune.txt"
tar czf /tmp/pending10c.tgz -C "$out" . && mv /tmp/pending10c.tgz "$out/all.tgz" && rm -rf "$out/ab_autotune"
ls "$out"
