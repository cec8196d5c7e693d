#!/usr/bin/env bash
# The kvlocks wheel installed as a user installs it into the staged vLLM 0.26, then `vllm serve`
# with the plugin answers an OpenAI client (scripts/gpu/README.md: "The installed wheel serves").
#
#   bash scripts/gpu/serve_check.sh OUT [WHEEL_DIR]       # WHEEL_DIR default .device/wheels
#
# Needs `tests model vllm` staged (finished) and the wheel built here and carried:
# `bash scripts/build_wheels.sh .device/wheels`, carry .device/wheels.
# 1. A venv in /tmp/kvlocks-serve that sees what `python3` sees (the image's torch 2.11,
#    transformers, ...) and the staged packages in /tmp/site (vLLM and its imports), through a .pth
#    file, but not this checkout's src/ (PYTHONPATH is unset).
# 2. `pip install --no-index --find-links /tmp/kvlocks-stage/wheels kvlocks-*.whl`: plain pip, no
#    --no-deps; a dependency the image lacks comes from the staged wheels. Fails if that changed
#    torch, transformers, triton or vllm, or if kvlocks is then not imported from the venv.
# 3. serve_check.py: `vllm serve` of the bundled model with KVLOCKS_VLLM_CONFIG set, a chat request
#    through the openai client, the server log checked for the LOCKS backend.
# OUT gets pip_install.txt, serve.log and serve_check.json. TIMEOUT_S (default 540) bounds step 3.
set -uo pipefail
out=${1:?usage: serve_check.sh OUT [WHEEL_DIR]}
wheels=${2:-.device/wheels}
cd "$(dirname "$0")/../.." || exit 2
repo=$PWD
mkdir -p "$out"
out=$(cd "$out" && pwd)
fail() { echo "serve_check: $*" >&2; echo "{\"passed\": false, \"error\": \"$*\"}" > "$out/serve_check.json"; exit 1; }

shopt -s nullglob
found=("$wheels"/kvlocks-*-py3-none-any.whl)
[ ${#found[@]} -eq 1 ] || fail "expected one kvlocks wheel in $wheels, found ${#found[@]} (bash scripts/build_wheels.sh $wheels here, and carry it)"
wheel=$(cd "$(dirname "${found[0]}")" && pwd)/$(basename "${found[0]}")
python3 scripts/gpu/stage.py env > /dev/null && . /tmp/kvlocks-stage/env.sh || fail "stage.py env failed"
unset PYTHONPATH  # env.sh points it at src/: the check must not see the checkout
house=/tmp/kvlocks-stage/wheels
[ -d /tmp/site/vllm ] && [ -d "$house" ] || fail "vLLM is not staged (stage tests model vllm, then finish)"

work=/tmp/kvlocks-serve
rm -rf "$work" && mkdir -p "$work" && cd "$work" || fail "cannot make $work"
venv=$work/venv
python3 -m venv --without-pip "$venv" || fail "python3 -m venv failed"
py=$venv/bin/python
purelib=$($py -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# what python3 itself imports from (its site-packages and any path of the image's own), after the staged site
python3 - "$repo" > "$purelib/kvlocks-serve-check.pth" <<'EOF' || fail "listing python3's paths failed"
import os, sys, sysconfig
repo = os.path.realpath(sys.argv[1])
std = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
print("/tmp/site")
for p in sys.path[1:]:
    r = os.path.realpath(p)
    # the image's python3 may itself be a venv whose site-packages lies under its platstdlib: only the
    # standard library's own folders are left out, not what lies below them
    if os.path.isdir(r) and r not in std and not r.startswith(repo) and not r.endswith("lib-dynload"):
        print(r)
EOF
versions="from importlib.metadata import version as v; print(' '.join(f'{n}=={v(n)}' for n in ('torch', 'transformers', 'triton', 'vllm')))"
before=$($py -c "$versions") || fail "the venv does not see torch, transformers, triton and vllm"
$py -c "import kvlocks" 2>/dev/null && fail "kvlocks is importable before the wheel is installed"
echo "serve_check: installing $(basename "$wheel") beside $before"
$py -m pip install --disable-pip-version-check --no-cache-dir --no-index --find-links "$house" "$wheel" \
  > "$out/pip_install.txt" 2>&1 || { tail -20 "$out/pip_install.txt"; fail "pip install of the wheel failed"; }
grep -E "^Successfully installed" "$out/pip_install.txt"
after=$($py -c "$versions")
[ "$before" = "$after" ] || fail "installing kvlocks changed the environment: [$before] -> [$after]"
where=$($py -c "import kvlocks; print(kvlocks.__file__)")
case $where in "$purelib"/*) ;; *) fail "kvlocks is imported from $where, not from $purelib" ;; esac
model=$($py -c "from kvlocks.models import resolve; print(resolve('smollm2-135m'))") || fail "the bundled model did not resolve"
echo "serve_check: kvlocks from $where; serving $model"
limit=${TIMEOUT_S:-540}  # the server's readiness wait ends 90 s before it, so the JSON is written
timeout "$limit" $py "$repo/scripts/gpu/serve_check.py" --model "$model" --out "$out" --timeout $((limit - 90)) \
  --serve-arg=--dtype --serve-arg=bfloat16 --serve-arg=--gpu-memory-utilization --serve-arg=0.85
rc=$?
$py - "$out/serve_check.json" "$wheel" "$before" <<'EOF'
import hashlib, json, sys
path, wheel, before = sys.argv[1:]
rec = json.load(open(path))
rec["wheel"] = {"name": wheel.rsplit("/", 1)[-1], "sha256": hashlib.sha256(open(wheel, "rb").read()).hexdigest()}
rec["install"] = "pip install --no-index --find-links /tmp/kvlocks-stage/wheels " + rec["wheel"]["name"]
rec["unchanged_by_install"] = before
json.dump(rec, open(path, "w"), indent=1)
EOF
exit $rc
