"""Carry what a GPU run needs onto the GPU machine, one part per call.

A run on the GPU machine takes the working tree and at most 64 MiB in all, and the machine keeps ``/tmp``
for about 30 s after a call while it stays warm. So anything larger (the bundled model's GGUF,
vLLM) travels as parts of one ignored folder each, carried by calls made right after each other,
and is joined and installed on the device by the last one.

Here, on a machine with PyPI (``BUNDLES`` in ``stage_prepare.py`` say what each holds)::

    python3 scripts/gpu/stage.py prepare tests model vllm        # -> .device/stage/<name>/partNN/

On the device, one call per part (carry ``.device/stage/<name>/partNN``), the last one also::

    python3 scripts/gpu/stage.py receive .device/stage/<name>/partNN
    python3 scripts/gpu/stage.py finish && . /tmp/kvlocks-stage/env.sh   # verify, join, install

and any later call on the same warm machine (or a call that staged nothing) starts with::

    python3 scripts/gpu/stage.py env && . /tmp/kvlocks-stage/env.sh

``env`` also writes an entry-point record of the working tree into ``/tmp/kvlocks-stage/tree``
(what an editable install would write), so that ``kvlocks bench`` finds the lab's commands and vLLM
finds the kvlocks plugin, with the code itself read from ``src/``; ``/tmp/site`` holds only staged
packages, so an environment that installs the kvlocks wheel instead can use it
(``serve_check.sh``). ``finish`` keeps the staged wheels in ``/tmp/kvlocks-stage/wheels``, for
``pip install --no-index --find-links``. Device-side commands need only the standard library, pip
and ``packaging`` (the image has both).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STAGE = Path("/tmp/kvlocks-stage")  # on the device: received parts, joined files, converted models
# under STAGE: "wheels" (every staged wheel, a --find-links folder), "tree" (the working tree's
# entry-point records), "models" (staged and converted models)
SITE = Path("/tmp/site")  # on the device: installed wheels and staged packages
MIB = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)  # stdout carries only the exports


# ---- on the device -------------------------------------------------------------------------------

def receive(part: Path, stage: Path = STAGE) -> None:
    """Copy one carried part's pieces into ``STAGE/<name>/pieces`` (a new staging replaces an old one)."""
    manifest = json.loads((part / "manifest.json").read_text())
    root = stage / manifest["name"]
    old = root / "manifest.json"
    if old.is_file() and json.loads(old.read_text())["id"] != manifest["id"]:
        log(f"replacing an earlier staging of {manifest['name']!r} in {root}")
        shutil.rmtree(root)
    (root / "pieces").mkdir(parents=True, exist_ok=True)
    shutil.copy(part / "manifest.json", old)
    for piece in sorted(p for p in part.iterdir() if p.name != "manifest.json"):
        shutil.copy(piece, root / "pieces" / piece.name)
    got = {p.name for p in (root / "pieces").iterdir()}
    missing = sorted({pc["part"] for f in manifest["files"] for pc in f["pieces"] if pc["file"] not in got})
    log(f"received {part.name} of {manifest['name']!r} ({manifest['parts']} parts); "
        f"still to come: {', '.join(missing) if missing else 'none (run finish)'}")


def _join(root: Path, entry: dict) -> Path:
    """Check each piece's and the joined file's sha256; ``root/files/<name>``."""
    out = root / "files" / entry["name"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as dst:
        for pc in entry["pieces"]:
            src = root / "pieces" / pc["file"]
            if not src.is_file():
                raise SystemExit(f"{entry['name']}: piece {pc['file']} of {pc['part']} was not received "
                                 f"(carry .device/stage/{root.name}/{pc['part']} and run receive)")
            if sha256(src) != pc["sha256"]:
                raise SystemExit(f"{entry['name']}: piece {pc['file']} has the wrong sha256")
            with open(src, "rb") as f:
                shutil.copyfileobj(f, dst, MIB)
    if sha256(out) != entry["sha256"]:
        raise SystemExit(f"{entry['name']}: the joined file has the wrong sha256")
    return out


def _check_requirements(wheels: list[str], not_carried: dict, site: Path) -> None:
    """Report the staged wheels' requirements that the device lacks or has at another version."""
    code = r"""
import json, sys
from importlib import metadata
from packaging.requirements import Requirement
names, skip = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
env = {"extra": ""}
unmet, skipped = [], set()
for name in names:
    for text in metadata.requires(name) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        key = req.name.lower().replace("_", "-")
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        if have is not None and req.specifier.contains(have, prereleases=True):
            continue
        if key in skip:
            skipped.add(key)
        else:
            unmet.append(f"{name} needs {req.name}{req.specifier}: " + (f"have {have}" if have else "missing"))
print("\n".join(unmet) if unmet else "every requirement of the staged wheels is met")
if skipped:
    print("not carried on purpose (stage_prepare.py says why): " + ", ".join(sorted(skipped)))
"""
    env = {**os.environ, "PYTHONPATH": str(site)}
    res = subprocess.run([sys.executable, "-c", code, json.dumps(wheels), json.dumps(sorted(not_carried))],
                         capture_output=True, text=True, env=env)
    log("requirements: " + (res.stdout.strip() or res.stderr.strip()[-2000:]))


def finish(names: list[str], stage: Path = STAGE, site: Path = SITE) -> None:
    """Verify and join every received staging (or the named ones), install it, then :func:`env`."""
    roots = [stage / n for n in names] if names else sorted(p.parent for p in stage.glob("*/manifest.json"))
    for root in roots:
        manifest = json.loads((root / "manifest.json").read_text())
        done = root / "installed.json"
        if done.is_file() and json.loads(done.read_text())["id"] == manifest["id"]:
            log(f"{manifest['name']!r} is installed already")
            continue
        wheels, placed = [], []
        for entry in manifest["files"]:
            path = _join(root, entry)
            if entry["kind"] == "wheel":
                wheels.append(path)
            else:  # dest "site/..." under SITE, "models/..." under STAGE/models
                base, _, rel = entry["dest"].partition("/")
                dest = (site if base == "site" else stage / "models") / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(path), dest)
                placed.append(str(dest))
        if wheels:
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(f"pip install of {manifest['name']!r} failed:\n{res.stdout}{res.stderr}")
        for entry in manifest["files"]:
            if entry.get("convert"):
                tok = stage / "models" / entry["tokenizer"] if entry.get("tokenizer") else None
                _convert(entry["convert"], stage / "models" / entry["dest"].partition("/")[2], stage, site, tok)
        house = stage / "wheels"
        house.mkdir(parents=True, exist_ok=True)
        for path in wheels:
            shutil.move(str(path), house / path.name)
        shutil.rmtree(root / "pieces")
        shutil.rmtree(root / "files")
        done.write_text(json.dumps({"id": manifest["id"], "placed": placed}))
        log(f"installed {manifest['name']!r}: {len(wheels)} wheels into {site}, {len(placed)} files placed")
        if wheels:
            _check_requirements([w.name.split("-")[0] for w in wheels], manifest.get("not_carried", {}), site)
    env(stage, site)


def _convert(name: str, gguf: Path, stage: Path, site: Path, tokenizer: Path | None = None) -> None:
    """The bundled model ``name``'s Hugging Face directory under ``stage/models`` from a staged GGUF
    (what ``kvlocks.models`` does on first use from the model's installed package), its tokenizer
    from the staged directory ``tokenizer`` where given (checked either way: ``check_tokenizer``)."""
    code = ("import sys; from pathlib import Path; from kvlocks.models.bundled import _convert_file, cache_root; "
            "_convert_file(sys.argv[1], Path(sys.argv[2]), cache_root() / sys.argv[1], "
            "Path(sys.argv[3]) if sys.argv[3] else None)")
    env_vars = {**os.environ, "PYTHONPATH": f"{_tree_path()}:{site}", "KVLOCKS_MODEL_DIR": str(stage / "models")}
    res = subprocess.run([sys.executable, "-c", code, name, str(gguf), str(tokenizer or "")], capture_output=True,
                         text=True, env=env_vars)
    if res.returncode:
        raise SystemExit(f"converting {gguf.name} to {name!r} failed:\n{res.stderr[-3000:]}")
    log(f"converted {gguf.name} to {stage / 'models' / name}")


def _tree_path() -> str:
    """The working tree's two source roots: the product (``src``) and the lab (``lab/src``)."""
    return f"{REPO / 'src'}:{REPO / 'lab' / 'src'}"


def _write_repo_metadata(tree: Path) -> None:
    """``tree/<name>-<version>.dist-info`` for the product and the lab: the working tree's entry
    points (their code stays in ``src/`` and ``lab/src/``)."""
    for pyproject in (REPO / "pyproject.toml", REPO / "lab" / "pyproject.toml"):
        _write_dist_info(tree, pyproject)


def _write_dist_info(site: Path, pyproject: Path) -> None:
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    folder = project["name"].replace("-", "_")  # the wheel's normalised name, as importlib.metadata reads it
    info = site / f"{folder}-{project['version']}.dist-info"
    for old in site.glob(f"{folder}-*.dist-info"):
        shutil.rmtree(old)
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                                   f"Version: {project['version']}\n")
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    (info / "entry_points.txt").write_text("".join(
        f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items()))
    (info / "INSTALLER").write_text("scripts/gpu/stage.py\n")


def env(stage: Path = STAGE, site: Path = SITE) -> None:
    """Write ``stage/env.sh`` (and print it): the shell exports for a run from this working tree
    with whatever was staged."""
    site.mkdir(parents=True, exist_ok=True)
    (stage / "tree").mkdir(parents=True, exist_ok=True)
    _write_repo_metadata(stage / "tree")
    exports = {"PYTHONPATH": f"{_tree_path()}:{stage / 'tree'}:{site}", "KVLOCKS_MODEL_DIR": str(stage / "models"),
               "PATH": "/usr/local/cuda/bin:$PATH", "PYTHONUNBUFFERED": "1"}
    for done in sorted(stage.glob("*/installed.json")):
        manifest = json.loads((done.parent / "manifest.json").read_text())
        for key, value in manifest.get("env", {}).items():
            exports[key] = value.format(models=stage / "models", site=site)
    text = "".join(f'export {key}="{value}"\n' for key, value in exports.items())
    (stage / "env.sh").write_text(text)
    print(text, end="")


# ---- here ------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: download/build the bundles and split them into parts")
    p.add_argument("bundles", nargs="+", help="any of: tests, model, vllm, vllm024, gemma")
    p.add_argument("--name", help="staging name (default: the bundle names joined by '-')")
    p.add_argument("--out", type=Path, default=REPO / ".device" / "stage", help="parts go to OUT/NAME/partNN")
    p.add_argument("--cache", type=Path, default=REPO / ".device" / "cache", help="downloads, kept for reruns")
    p.add_argument("--part-mib", type=int, default=0,
                   help="bytes per part in MiB (default: 64 MiB less the travelling tree, less 2 MiB, at most 60)")
    p.add_argument("--gemma-gguf", type=Path, help="the assembled Gemma 3 270M GGUF (bundle gemma)")
    r = sub.add_parser("receive", help="device: keep one carried part in /tmp/kvlocks-stage")
    r.add_argument("part", type=Path)
    f = sub.add_parser("finish", help="device: verify, join and install; write and print the exports")
    f.add_argument("names", nargs="*", help="stagings to finish (default: every one received)")
    sub.add_parser("env", help="device: write /tmp/kvlocks-stage/env.sh (and the tree's entry points)")
    args = ap.parse_args()
    if args.cmd == "prepare":
        from stage_prepare import prepare  # here only (needs PyPI and the project's venv)

        prepare(args)
    elif args.cmd == "receive":
        receive(args.part)
    elif args.cmd == "finish":
        finish(args.names)
    else:
        env()


if __name__ == "__main__":
    main()
