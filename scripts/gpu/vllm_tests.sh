#!/usr/bin/env bash
# The CUDA vLLM tests (tests/vllm_gpu) in one GPU run, vLLM and the bundled model staged
# (scripts/gpu/README.md: "vLLM 0.26 with the bundled model"). Each test runs its engines in
# subprocesses; the tests run side by side under pytest-xdist (one worker each, every engine
# sized to 12 % of the GPU's memory, each worker with its own vLLM compile cache).
#
#   bash scripts/gpu/vllm_tests.sh OUT [workers=5] [pytest args]
#
# OUT gets pytest_vllm.txt and vllm_tests.tgz: every test's folder (its engines' spec, result and
# log files, the JSON the test saved). pytest args replace the default (tests/vllm_gpu).
# TIMEOUT_S: pytest's time limit, default 560.
set -u
out=${1:?usage: vllm_tests.sh OUT [workers] [pytest args]}
workers=${2:-5}
shift $(( $# > 1 ? 2 : 1 ))
cd "$(dirname "$0")/../.." || exit 2
python3 scripts/gpu/stage.py env > /dev/null && . /tmp/kvlocks-stage/env.sh || exit 2
python3 -c "import vllm, xdist" 2>/dev/null || { echo "vLLM or pytest-xdist is missing: stage tests model vllm"; exit 2; }
mkdir -p "$out"
args=("$@")
[ $# -gt 0 ] || args=(tests/vllm_gpu)
tmp=/tmp/kvlocks-vllm-tests
rm -rf "$tmp"
timeout "${TIMEOUT_S:-560}" python3 -m pytest -v -rs -p no:cacheprovider -p xdist -n "$workers" --dist load \
    --durations=10 --basetemp "$tmp" "${args[@]}" > "$out/pytest_vllm.txt" 2>&1
rc=$?
tar czf "$out/vllm_tests.tgz" -C "$tmp" --exclude='*.safetensors' . 2>/dev/null
echo "pytest exit $rc ($(grep -c PASSED "$out/pytest_vllm.txt") passed lines)"
grep -E "^(FAILED|ERROR)" "$out/pytest_vllm.txt" | head -20
tail -2 "$out/pytest_vllm.txt"
exit $rc
