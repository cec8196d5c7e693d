#!/usr/bin/env bash
# `kvlocks bench kernels|e2e` of two source snapshots (a baseline and a candidate commit) on the
# same GPU in one command, then their comparison.
#
#   bash scripts/gpu/before_after.sh OUT BEFORE.tar AFTER.tar kernels|e2e [kvlocks bench options]
#
# BEFORE.tar, AFTER.tar: `git archive COMMIT src lab -o FILE` of each commit (`src` alone where the
# commit has no lab folder), copied to the GPU machine (random weights: nothing needs staging).
# Each snapshot runs from its own folder; the rows go to OUT/before/<which>/ and OUT/after/<which>/
# (logs OUT/bench_<side>_<which>.txt), and OUT/compare_<which>.json holds after / before per case
# and the cases slower by more than 3 % (scripts/analysis/compare_bench.py). TIMEOUT_S: each run's
# limit in seconds (default 270, so the two fit one 600 s command).
set -u
usage="usage: before_after.sh OUT BEFORE.tar AFTER.tar kernels|e2e [kvlocks bench options]"
out=${1:?$usage}
before=${2:?$usage}
after=${3:?$usage}
which=${4:?$usage}
shift 4
case "$which" in kernels|e2e) ;; *) echo "before_after.sh: $which: allowed kernels or e2e"; exit 2 ;; esac
for tar in "$before" "$after"; do
  [ -f "$tar" ] || { echo "before_after.sh: $tar: no such file (make it with git archive COMMIT src lab -o FILE)"; exit 2; }
done
cd "$(dirname "$0")/../.." || exit 2
python3 scripts/gpu/stage.py env > /dev/null && . /tmp/kvlocks-stage/env.sh || exit 2
mkdir -p "$out"
out=$(cd "$out" && pwd)
set -o pipefail
for side in before after; do
  if [ "$side" = before ]; then tar=$before; else tar=$after; fi
  dir=/tmp/kvlocks-$side
  rm -rf "$dir" && mkdir -p "$dir" && tar -xf "$tar" -C "$dir" || exit 2
  (cd "$dir" && export PYTHONPATH="$dir/src:$dir/lab/src:$PYTHONPATH" \
    && python3 -c "import kvlocks; print('$side: kvlocks from', kvlocks.__file__)" \
    && timeout "${TIMEOUT_S:-270}" python3 -m kvlocks.cli bench "$which" --out "$out/$side/$which" "$@") 2>&1 \
    | tee "$out/bench_${side}_$which.txt"
  echo "bench $which ($side) exit $?"
done
python3 scripts/analysis/compare_bench.py "$out/before/$which/rows.jsonl" "$out/after/$which/rows.jsonl" \
  --out "$out/compare_$which.json"
