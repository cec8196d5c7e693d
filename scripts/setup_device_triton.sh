#!/usr/bin/env bash
# Install the H200 image's Triton (3.6.0, the version its Python packages list) into
# .venv/triton-device, beside the Triton that torch 2.13 pins, so the test suite can compile every
# Triton kernel for sm_90 with both (tests/test_triton_compile.py): a kernel that compiles with one
# version can fail with the other. Idempotent; run by scripts/test.sh after scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
version=3.6.0
dest=.venv/triton-device
if [ -f "$dest/.version" ] && [ "$(cat "$dest/.version")" = "$version" ]; then
  exit 0
fi
rm -rf "$dest"
.venv/bin/python -m pip install --quiet --no-deps --target "$dest" "triton==$version"
echo "$version" > "$dest/.version"
echo "kvlocks: Triton $version in $dest"
