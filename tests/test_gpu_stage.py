"""scripts/gpu/stage.py: parts made here, received in any order, joined and installed as on the device."""

import base64
import hashlib
import json
import random
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
import stage  # noqa: E402
from stage_prepare import write_stage  # noqa: E402


def _wheel(dir: Path, name: str, version: str, requires=()) -> Path:
    """A minimal pure-Python wheel: ``name/__init__.py`` with ``VALUE = 7`` and its metadata."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": b"VALUE = 7\n",
             f"{info}/METADATA": ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (name, version)
                                  + "".join(f"Requires-Dist: {r}\n" for r in requires)).encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},"
                     f"{len(d)}\n" for p, d in files.items()) + f"{info}/RECORD,,\n"
    path = dir / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, d in files.items():
            z.writestr(p, d)
        z.writestr(f"{info}/RECORD", record)
    return path


@pytest.fixture
def staged(tmp_path):
    rng = random.Random(0)
    src = tmp_path / "src"
    src.mkdir()
    big = src / "model.gguf"
    big.write_bytes(rng.randbytes(2500))
    empty = src / "empty.py"
    empty.write_bytes(b"")
    wheel = _wheel(src, "tinypkg", "1.0", requires=["surely-not-installed-pkg>=1"])
    files = [{"name": big.name, "kind": "file", "dest": "site/tinymodel/model.gguf", "path": big},
             {"name": "tinymodel__init__.py", "kind": "file", "dest": "site/tinymodel/__init__.py", "path": empty},
             {"name": wheel.name, "kind": "wheel", "path": wheel}]
    manifest, parts = write_stage(tmp_path / "out" / "set", "set", files, 1024, env={"TINY": "{models}/x"})
    return tmp_path, big, manifest, parts


def test_parts_are_full_but_the_last_and_hold_every_byte(staged):
    tmp, big, manifest, parts = staged
    total = sum(e["size"] for e in manifest["files"])
    assert parts[:-1] == [1024] * (len(parts) - 1) and 0 < parts[-1] <= 1024
    assert sum(parts) == total and len(parts) == -(-total // 1024)
    for k in range(len(parts)):
        folder = tmp / "out" / "set" / f"part{k + 1:02d}"
        sizes = sum(p.stat().st_size for p in folder.iterdir() if p.name != "manifest.json")
        assert sizes == parts[k]
        assert json.loads((folder / "manifest.json").read_text())["id"] == manifest["id"]


def test_parts_in_any_order_join_and_install(staged, capsys):
    tmp, big, manifest, parts = staged
    st, site = tmp / "stage", tmp / "site"
    order = list(range(1, len(parts) + 1))
    random.Random(1).shuffle(order)
    for k in order[:-1]:
        stage.receive(tmp / "out" / "set" / f"part{k:02d}", st)
    with pytest.raises(SystemExit, match=f"part{order[-1]:02d}"):  # a part not received is named
        stage.finish([], st, site)
    stage.receive(tmp / "out" / "set" / f"part{order[-1]:02d}", st)
    stage.finish([], st, site)
    assert (site / "tinymodel" / "model.gguf").read_bytes() == big.read_bytes()
    assert (site / "tinymodel" / "__init__.py").read_bytes() == b""
    assert (site / "tinypkg" / "__init__.py").read_text() == "VALUE = 7\n"
    # the staged wheel stays in the wheelhouse (pip --find-links); the staged site holds no record
    # of the working tree, so an environment may install the kvlocks wheel beside it
    assert [w.name for w in (st / "wheels").iterdir()] == ["tinypkg-1.0-py3-none-any.whl"]
    assert not list(site.glob("kvlocks*"))
    out = capsys.readouterr()
    assert "surely-not-installed-pkg" in out.err and "missing" in out.err  # the requirement check
    assert (st / "env.sh").read_text() == out.out  # what a command sources
    exports = dict(line.removeprefix("export ").split("=", 1) for line in out.out.splitlines())
    assert exports["PYTHONPATH"] == f'"{ROOT / "src"}:{ROOT / "lab" / "src"}:{st / "tree"}:{site}"'
    assert exports["TINY"] == f'"{st / "models" / "x"}"'
    stage.finish([], st, site)  # installed already: nothing redone
    assert "installed already" in capsys.readouterr().err


def test_a_corrupted_piece_is_refused(staged):
    tmp, big, manifest, parts = staged
    st = tmp / "stage"
    for k in range(1, len(parts) + 1):
        stage.receive(tmp / "out" / "set" / f"part{k:02d}", st)
    piece = st / "set" / "pieces" / f"{big.name}.000"
    data = bytearray(piece.read_bytes())
    data[10] ^= 1
    piece.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="wrong sha256"):
        stage.finish([], st, tmp / "site")


def test_env_records_the_working_tree_entry_points(tmp_path):
    stage.env(tmp_path / "stage", tmp_path / "site")
    tree = tmp_path / "stage" / "tree"
    code = ("from importlib.metadata import entry_points; "
            "print(sorted(e.name for e in entry_points(group='kvlocks.commands')))")
    # -S: no site-packages, so only the tree's record can provide these entry points
    res = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(tree)})
    lab = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())["project"]
    assert json.loads(res.stdout.replace("'", '"')) == sorted(lab["entry-points"]["kvlocks.commands"])
    for pyproject in (ROOT / "pyproject.toml", ROOT / "lab" / "pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())["project"]
        meta = (tree / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info" / "METADATA").read_text()
        assert f"Version: {project['version']}" in meta
    assert not list((tmp_path / "site").iterdir()), "the staged site holds staged packages only"
