#!/usr/bin/env bash
# Session 17's third call (~7 min). The issue-5 kernel grid with the tuned dense baseline
# (`dense_splitk` = kvlocks.attention.tune.fastest_dense's launch since session 16, not yet run on a
# GPU; `x_splitk_default` = the default launch): the whole grid, batches 1, 4 and 16.
# Usage on the device: bash scripts/device/pending17c.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 560 python -m kvlocks.cli bench kernels --out "$out/kern" > "$out/kern.txt" 2>&1
echo "kernels exit $?"; tail -40 "$out/kern.txt"
