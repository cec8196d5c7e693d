"""Whether kvlocks in the vLLM venv is the installed wheel (scripts/vllm_setup.sh), not the checkout."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

INSTALLED_VAR = "KVLOCKS_INSTALLED_WHEEL"  # scripts/test_vllm.sh sets it to 1
REPO = Path(__file__).resolve().parents[2]


def installed_wheel_problems(modules, site: Path, repo: Path) -> list[str]:
    """Why ``modules`` (imported packages) are not an installed wheel's: each must lie under ``site``
    and not in the checkout's source roots (``src/``, ``lab/src/``); an empty list when they are.
    (``site`` itself may lie inside the checkout: .venv-vllm does.)"""
    problems = []
    for module in modules:
        where = Path(module.__file__).resolve()
        if any(where.is_relative_to(root) for root in (repo / "src", repo / "lab" / "src")):
            problems.append(f"{module.__name__} is imported from the checkout ({where})")
        elif not where.is_relative_to(site.resolve()):
            problems.append(f"{module.__name__} is imported from {where}, not from {site}")
    return problems


def check_installed() -> None:
    """With ``KVLOCKS_INSTALLED_WHEEL=1``: stop the run unless kvlocks and kvlocks_lab come from this
    interpreter's site-packages; without it any install counts (an editable one too)."""
    if os.environ.get(INSTALLED_VAR) != "1":
        return
    import kvlocks
    import kvlocks_lab

    problems = installed_wheel_problems([kvlocks, kvlocks_lab], Path(sysconfig.get_paths()["purelib"]), REPO)
    if problems:
        raise pytest.UsageError(f"{INSTALLED_VAR}=1 but kvlocks is not the installed wheel (scripts/vllm_setup.sh "
                                "installs it): " + "; ".join(problems))
