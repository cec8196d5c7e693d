#!/usr/bin/env bash
# Build the two wheels of this repository: kvlocks (the product) and kvlocks-lab (the lab).
#
#   bash scripts/build_wheels.sh [OUTDIR]        # default dist/
#
# Each is built with `pip wheel --no-deps` (pip fetches setuptools into an isolated build
# environment; nothing else is needed) from a copy of the files git tracks or would track (new,
# unignored files included), so build/ and *.egg-info left in the tree never reach a wheel.
# PYTHON picks the interpreter (default: .venv's, else python3). Prints the wheels' paths.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${1:-dist}
mkdir -p "$out"
out=$(cd "$out" && pwd)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
git ls-files -z --cached --others --exclude-standard -- pyproject.toml README.md src lab/pyproject.toml lab/src |
  while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done |  # tracked files deleted here stay out
  tar -C "$repo" --null -T - -cf - | tar -C "$copy" -xf -
rm -f "$out"/kvlocks-*.whl "$out"/kvlocks_lab-*.whl
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$out" "$copy" "$copy/lab"
ls "$out"/kvlocks-*.whl "$out"/kvlocks_lab-*.whl
