"""kvlocks in the vLLM venv is the installed wheel, not the checkout (tests/vllm/conftest.py)."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
from installed import INSTALLED_VAR, REPO, installed_wheel_problems

SITE = REPO / ".venv-vllm" / "lib" / "python3.11" / "site-packages"


def _module(path: Path) -> SimpleNamespace:
    return SimpleNamespace(__name__=path.parent.name, __file__=str(path / "__init__.py"))


def test_check_accepts_site_packages_and_names_the_checkout():
    assert installed_wheel_problems([_module(SITE / "kvlocks")], SITE, REPO) == []
    (problem,) = installed_wheel_problems([_module(REPO / "src" / "kvlocks")], SITE, REPO)
    assert "from the checkout" in problem
    (problem,) = installed_wheel_problems([_module(REPO / "lab" / "src" / "kvlocks_lab")], SITE, REPO)
    assert "from the checkout" in problem
    (problem,) = installed_wheel_problems([_module(Path("/elsewhere/kvlocks"))], SITE, REPO)
    assert "not from" in problem


@pytest.mark.skipif(os.environ.get(INSTALLED_VAR) != "1", reason=f"{INSTALLED_VAR} is not 1: any kvlocks install counts")
def test_kvlocks_is_the_installed_wheel():
    import kvlocks
    import kvlocks_lab

    site = Path(sysconfig.get_paths()["purelib"])
    assert installed_wheel_problems([kvlocks, kvlocks_lab], site, REPO) == []
    from importlib.metadata import distribution

    dist = distribution("kvlocks")
    assert dist.read_text("direct_url.json") is None or '"editable": true' not in dist.read_text("direct_url.json")
