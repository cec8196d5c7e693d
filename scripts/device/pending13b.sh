#!/usr/bin/env bash
# Session 13's second call (~6 min; carry .device/cubins13b, compiled here first with
#   PYTHONPATH=src .venv/bin/python scripts/device/cubin_probe.py --compile .device/cubins13b \
#       --variants onesided:144,onesided:152,onesided:160,onesided:176,onesided:192,onesided:208,lean:168,lean:192)
# 1. the register cap of the one-sided build with Triton 3.9 around the first call's best (168:
#    0.982 s per llama3-8b model at 1M, uncapped 1.103, lean 1.096), and lean capped;
# 2. the short-context kernels: score / selection launch sizes at 16K-64K (small_ctx_probe.py).
# Usage on the device: bash scripts/device/pending13b.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 150 python scripts/device/cubin_probe.py --time .device/cubins13b --out "$out/cubin.jsonl" > "$out/cubin.txt" 2>&1
echo "cubin exit $?"
python3 scripts/device/show_jsonl.py "$out/cubin.jsonl" file layer_ms model_s recon_err_vs_keys
timeout 300 python scripts/device/small_ctx_probe.py --out "$out/small.jsonl" > "$out/small.txt" 2>&1
echo "small exit $?"
tail -3 "$out/small.txt"
python3 scripts/device/show_jsonl.py "$out/small.jsonl" kind shape tokens warps ppp chunk programs default same_pages us max_err
