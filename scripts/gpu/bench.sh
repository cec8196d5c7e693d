#!/usr/bin/env bash
# `kvlocks bench kernels|e2e` on the device, its result files under OUT.
#
#   bash scripts/gpu/bench.sh OUT kernels|e2e [kvlocks bench options]
#
# Writes OUT/<kernels|e2e>/summary.json and rows.jsonl (written as rows finish, so a timeout keeps
# what finished) and OUT/bench_<kernels|e2e>.txt (the log). Options go to `kvlocks bench` unchanged
# (e.g. --models glm4-9b-1m --contexts 1M,128K,32K --batches 1 --steps 16 --max-prefill 64K);
# `kvlocks bench --help` lists them. TIMEOUT_S: the run's time limit, default 570 (a device command
# may run 600 s). Random weights: no model needs staging.
set -u
out=${1:?usage: bench.sh OUT kernels|e2e [options]}
which=${2:?usage: bench.sh OUT kernels|e2e [options]}
shift 2
case "$which" in kernels|e2e) ;; *) echo "bench.sh: $which: allowed kernels or e2e"; exit 2 ;; esac
cd "$(dirname "$0")/../.." || exit 2
python3 scripts/gpu/stage.py env > /dev/null && . /tmp/kvlocks-stage/env.sh || exit 2
mkdir -p "$out"
set -o pipefail
timeout "${TIMEOUT_S:-570}" python3 -m kvlocks.cli bench "$which" --out "$out/$which" "$@" 2>&1 | tee "$out/bench_$which.txt"
rc=$?
echo "bench $which exit $rc"
exit $rc
