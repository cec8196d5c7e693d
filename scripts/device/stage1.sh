#!/usr/bin/env bash
# Device call 1: keep part 1 of the GGUF in /tmp for the next call.
set -euo pipefail
mkdir -p /tmp/kvl && cp .device/p1/gguf.part.aa /tmp/kvl/ && ls -la /tmp/kvl
