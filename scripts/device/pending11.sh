#!/usr/bin/env bash
# Session 11: the GLM-4-9B e2e rows (issue 6's table) with the defaults flipped after pending10b's
# A/B (fused q/k/v, rebased radix keys, K/V writes in the projection piece). One call, limit 560 s;
# rows are appended to rows.jsonl as they finish, so a partial run still says something.
# Usage on the device: bash scripts/device/pending11.sh "$OUT" [glm|llama]
set -u
out=${1:?output folder}
which=${2:-glm}
export PYTHONPATH=$PWD/src PATH=/usr/local/cuda/bin:$PATH
if [ "$which" = glm ]; then
  timeout 560 python -m kvlocks.cli bench e2e --out "$out/e2e_glm" --models glm4-9b-1m --contexts 1M,512K,256K,128K,64K,32K,16K \
      --batches 1,2,3,4 --batch-context 256K --steps 16 --max-prefill 64K > "$out/e2e_glm.txt" 2>&1
  echo "glm exit $?"
  grep -E "tpot|skipped|rows" "$out/e2e_glm.txt"
else
  timeout 560 python -m kvlocks.cli bench e2e --out "$out/e2e_llama" --models llama3.1-8b --contexts 1M,768K,512K,256K,128K,64K,32K,16K \
      --batches 1,2,3,4 --batch-context 256K --steps 16 --max-prefill 64K > "$out/e2e_llama.txt" 2>&1
  echo "llama exit $?"
  grep -E "tpot|skipped|rows" "$out/e2e_llama.txt"
fi
tar czf /tmp/pending11.tgz -C "$out" . && mv /tmp/pending11.tgz "$out/all.tgz"
ls "$out"
