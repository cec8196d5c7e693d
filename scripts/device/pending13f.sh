#!/usr/bin/env bash
# Session 13's sixth call (~6 min): the CUDA score kernel's group split (GSPLIT: one tile per
# program, its four page groups over the four warps; picked where one tile per warp is the launch
# and the one-tile programs fit a wave: GLM-4-9B to ~50K tokens, Llama-3.1-8B to ~25K).
# 1. correctness: mma_probe --check (ppp 16 and the small default run it), the GPU score test;
# 2. kernels alone at 16K-128K (small_ctx_probe.py: ppp 16 / 64 / 128 side by side);
# 3. GLM-4-9B step profile at 32K; 4. e2e rows 16K-64K, batch 1, both models.
# Usage on the device: bash scripts/device/pending13f.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 90 python scripts/device/mma_probe.py --check > "$out/check.txt" 2>&1
echo "check exit $?"; grep -E "FAIL" "$out/check.txt" | tail -4
timeout 60 python -m pytest -q -x tests/test_kernels.py -k "cuda_score_kernel" > "$out/tests.txt" 2>&1
echo "tests exit $?"; tail -1 "$out/tests.txt"
timeout 100 python scripts/device/small_ctx_probe.py --out "$out/small.jsonl" > "$out/small.txt" 2>&1
echo "small exit $?"
python3 scripts/device/show_jsonl.py "$out/small.jsonl" kind shape tokens ppp programs default us max_err | grep score
timeout 70 python scripts/device/step_profile.py --model glm4-9b-1m --context 32768 --compile \
    --out "$out/profile_glm_32768.json" > "$out/profile_glm_32768.txt" 2>&1
echo "profile exit $?"; grep '"method"' "$out/profile_glm_32768.txt" | cut -c1-330
timeout 100 python -m kvlocks.cli bench e2e --out "$out/e2e_glm" --models glm4-9b-1m --contexts 64K,32K,16K \
    --batches 1 --batch-context 16K --steps 16 --max-prefill 64K > "$out/e2e_glm.txt" 2>&1
echo "glm exit $?"; grep -E " x1|rows" "$out/e2e_glm.txt" | tail -12
timeout 80 python -m kvlocks.cli bench e2e --out "$out/e2e_llama" --models llama3.1-8b --contexts 32K,16K \
    --batches 1 --batch-context 16K --steps 16 --max-prefill 64K > "$out/e2e_llama.txt" 2>&1
echo "llama exit $?"; grep -E " x1|rows" "$out/e2e_llama.txt" | tail -8
tar czf /tmp/pending13f.tgz -C "$out" . && rm -rf "${out:?}"/* && mv /tmp/pending13f.tgz "$out/all.tgz"
