# Measurements prepared on the CPU host and not yet run on the GPU (session 4 ran out of device
# time). One device call, about 6-8 minutes; every file lands under $OUT.
#   run: bash scripts/device/pending.sh
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
# Jacobi variants of the summary build: gathers (default) / lean / dots, one layer at 1M, both shapes
timeout 240 python3 scripts/device/build_probe.py --out "$OUT/build_probe.jsonl"
# selection kernels against their chunk size at 1M (the radix merge is ~2 ms of GLM's 1M step)
timeout 120 python3 scripts/device/select_probe.py --out "$OUT/select_probe.jsonl"
# torch.compile of the step's per-layer pieces, beside the eager step, same cases
for c in "" "--compile"; do
  timeout 240 python3 -m kvlocks.cli bench e2e --out "$OUT/e2e${c:+_compile}" --models glm4-9b-1m \
    --contexts 16K,1M --batches 1 --batch-context 16K --steps 24 --max-prefill 0 $c 2>&1 | grep -v -i warn | tail -6
done
