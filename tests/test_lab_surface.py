"""The lab (``kvlocks_lab``) imports only the product's public surface.

A product import is private when a component of its dotted module path starts with ``_``
(``kvlocks.selection._common``) or when it imports a name starting with ``_`` from a product
module (``from kvlocks.scoring.triton import _tuned``). Dunder names (``__version__``) are public.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "lab" / "src" / "kvlocks_lab"
PRODUCT = "kvlocks"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_product(module: str) -> bool:
    return module == PRODUCT or module.startswith(PRODUCT + ".")


def private_imports(source: str, filename: str = "<lab module>") -> list[str]:
    """Every import in ``source`` that reaches a private product module or name, as ``file:line: what``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_product(alias.name) and any(_private(c) for c in alias.name.split(".")):
                    found.append(f"{filename}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_product(node.module):
            if any(_private(c) for c in node.module.split(".")):
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{filename}:{node.lineno}: from {node.module} import {alias.name}")
    return found


def lab_modules() -> list[Path]:
    return sorted(LAB.rglob("*.py"))


def test_lab_tree_is_found():
    assert len(lab_modules()) > 20, f"expected the lab's modules under {LAB}"


def test_no_lab_module_imports_a_private_product_module_or_name():
    found = []
    for path in lab_modules():
        found += private_imports(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, "lab modules reach private product code (make it public or move it into the lab):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("source", [
    "from kvlocks.selection._common import page_mask",
    "import kvlocks._config_io",
    "import kvlocks._config_io as cio",
    "from kvlocks._nvcc import build",
    "from kvlocks.scoring.triton import _score_mma_tuned",
    "from kvlocks import _checks",
    "def f():\n    from kvlocks.commands._common import DTYPES\n",
])
def test_checker_finds_planted_private_imports(source):
    assert len(private_imports(source)) == 1, source


@pytest.mark.parametrize("source", [
    "from kvlocks.selection.pages import page_mask",
    "import kvlocks.config_io",
    "from kvlocks import __version__",
    "from kvlocks_lab._private import thing",  # the lab's own private modules are its business
    "from torch._dynamo import config",  # not the product
    "from ._local import x",  # relative: inside the lab
])
def test_checker_allows_public_and_non_product_imports(source):
    assert private_imports(source) == [], source
