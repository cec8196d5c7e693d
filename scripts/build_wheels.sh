#!/usr/bin/env bash
# Build the two wheels of this repository: kvlocks (the product) and kvlocks-lab (the lab).
#
#   bash scripts/build_wheels.sh [OUTDIR]        # default dist/
#
# Each is built with `pip wheel --no-deps` (pip fetches setuptools into an isolated build
# environment; nothing else is needed) from a copy of the sources without build outputs
# (__pycache__, build/, *.egg-info), so what an earlier build or an editable install left in the
# tree never reaches a wheel. Needs no git (CI may build from a copy of the tree).
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
tar -C "$repo" --exclude=__pycache__ --exclude='*.egg-info' --exclude=build --exclude='*.pyc' \
  -cf - pyproject.toml README.md src lab/pyproject.toml lab/src | tar -C "$copy" -xf -
rm -f "$out"/kvlocks-*.whl "$out"/kvlocks_lab-*.whl
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$out" "$copy" "$copy/lab"
ls "$out"/kvlocks-*.whl "$out"/kvlocks_lab-*.whl
