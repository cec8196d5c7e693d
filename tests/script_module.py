"""Import a script of ``scripts/`` (not a package) as a module, for the tests of its functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(relative: str, name: str):
    """``scripts/<relative>`` executed as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / relative)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
