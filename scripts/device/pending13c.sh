#!/usr/bin/env bash
# Session 13's third call (~9 min): the CUDA score kernel's one-tile variant (three group slots where
# every warp has at most one tile) and the short-context selection sizes (512 pages per program
# from 1536 to 5120 pages, 8 warps for a row's single program).
# 1. correctness: mma_probe --check (one-tile on and off), the GPU test of the score kernel;
# 2. kernels alone at 16K-128K (small_ctx_probe.py: one-tile on / off side by side);
# 3. GLM-4-9B step profile at 32K (per-kernel classes; call 1 has the one before these changes);
# 4. GLM-4-9B e2e rows 16K-128K, batch 1 (dense and LOCKS in one run).
# Usage on the device: bash scripts/device/pending13c.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 120 python scripts/device/mma_probe.py --check > "$out/check.txt" 2>&1
echo "check exit $?"; grep -E "FAIL|ppp=" "$out/check.txt" | tail -9
timeout 90 python -m pytest -q -x tests/test_kernels.py -k "cuda_score_kernel" > "$out/tests.txt" 2>&1
echo "tests exit $?"; tail -2 "$out/tests.txt"
timeout 150 python scripts/device/small_ctx_probe.py --out "$out/small.jsonl" > "$out/small.txt" 2>&1
echo "small exit $?"
python3 scripts/device/show_jsonl.py "$out/small.jsonl" kind shape tokens ppp one_tile chunk warps default same_pages us max_err
timeout 100 python scripts/device/step_profile.py --model glm4-9b-1m --context 32768 --compile \
    --out "$out/profile_glm_32768.json" > "$out/profile_glm_32768.txt" 2>&1
echo "profile exit $?"; grep '"method"' "$out/profile_glm_32768.txt" | cut -c1-400
timeout 200 python -m kvlocks.cli bench e2e --out "$out/e2e" --models glm4-9b-1m --contexts 128K,64K,32K,16K \
    --batches 1 --steps 16 --max-prefill 64K > "$out/e2e.txt" 2>&1
echo "e2e exit $?"; tail -14 "$out/e2e.txt"
tar czf /tmp/pending13c.tgz -C "$out" . && rm -rf "${out:?}"/* && mv /tmp/pending13c.tgz "$out/all.tgz"
