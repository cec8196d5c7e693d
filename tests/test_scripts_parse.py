"""Every committed script is valid Python: device scripts run only on a lent GPU, so a syntax error
there would otherwise surface only when that machine's time is already being spent."""

import ast
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").rglob("*.py"))


def test_scripts_found():
    assert any(p.parent.name == "device" for p in SCRIPTS)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_script_parses(path):
    ast.parse(path.read_text(), filename=str(path))
