#!/usr/bin/env bash
# Split the bundled GGUF into two device-sized parts and fetch the gguf wheel, and the pytest-xdist
# wheels for scripts/device/gpu_tests.sh (run here, not there).
set -euo pipefail
cd "$(dirname "$0")/../.."
g=$(.venv/bin/python -c "from kvlocks.models.bundled import gguf_path; print(gguf_path('smollm2-135m'))")
rm -rf .device && mkdir -p .device/p1 .device/p2
split -b 50M "$g" .device/gguf.part.
mv .device/gguf.part.aa .device/p1/ && mv .device/gguf.part.ab .device/p2/
python3 -m pip download -q --no-deps --only-binary=:all: gguf==0.19.0 -d .device/p2
sha256sum "$g" | cut -d' ' -f1 > .device/p2/gguf.sha256
python3 -m pip download -q --no-deps --only-binary=:all: pytest-xdist==3.8.0 execnet==2.1.2 -d .device/wheels
