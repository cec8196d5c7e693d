"""Every committed script parses: the GPU scripts run only on a GPU machine, so a syntax error
there would otherwise surface only when that machine's time is already being spent. And the GPU
scripts' README lists each of them."""

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS_DIR = Path(__file__).resolve().parents[1] / "scripts"
GPU = SCRIPTS_DIR / "gpu"
PY = sorted(SCRIPTS_DIR.rglob("*.py"))
SH = sorted(SCRIPTS_DIR.rglob("*.sh"))


def _id(p):
    return str(p.relative_to(SCRIPTS_DIR))


def test_gpu_scripts_found():
    for name in ("stage.py", "gpu_tests.sh", "bench.sh", "engine_check.py", "README.md"):
        assert (GPU / name).is_file(), name
    assert (GPU / "probes").is_dir()


@pytest.mark.parametrize("path", PY, ids=_id)
def test_python_script_parses(path):
    ast.parse(path.read_text(), filename=str(path))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("path", SH, ids=_id)
def test_shell_script_parses(path):
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_gpu_readme_lists_every_gpu_script():
    readme = (GPU / "README.md").read_text()
    named = set(re.findall(r"`((?:probes/|grids/)?[\w.]+\.(?:py|sh|txt))", readme))
    files = {str(p.relative_to(GPU)) for p in GPU.rglob("*") if p.suffix in (".py", ".sh", ".txt")
             and "__pycache__" not in p.parts}
    assert files - named == set(), f"not in scripts/gpu/README.md: {sorted(files - named)}"
