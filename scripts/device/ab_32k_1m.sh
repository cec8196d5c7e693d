#!/usr/bin/env bash
# Two select_ab.py modes side by side (~5 min): GLM-4-9B shape, batch 1, both methods, interleaved twice at
# 32K, then once at 1M. Usage on the device (carry .device/wheels):
#   bash scripts/device/ab_32k_1m.sh "$OUT" MODE_A MODE_B      (e.g. defaults19b coord_descent)
set -u
out=${1:?output folder}
a=${2:?first mode}
b=${3:?second mode}
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
timeout 330 python scripts/device/select_ab.py --model glm4-9b-1m --contexts 32768 --methods locks,dense \
    --modes "$a,$b,$a,$b" --out "$out/ab32" > "$out/ab32.txt" 2>&1
echo "ab32 exit $?"; grep -E "^($a|$b) " "$out/ab32.txt"
rm -rf "$out/ab32"  # its per-mode folders are too many files to come back
timeout 230 python scripts/device/select_ab.py --model glm4-9b-1m --contexts 1048576 --methods locks,dense \
    --modes "$a,$b" --out "$out/ab1m" > "$out/ab1m.txt" 2>&1
echo "ab1m exit $?"; grep -E "^($a|$b) " "$out/ab1m.txt"
