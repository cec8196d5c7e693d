"""The product/lab split and the import graph, checked on the source tree.

- the product (``src/kvlocks``) imports nothing from the lab (``lab/src/kvlocks_lab``, the
  ``kvlocks-lab`` distribution);
- the library does not import the CLI (``kvlocks.cli``, ``kvlocks.commands``);
- no import cycle between files, counting imports inside functions too (a lazy import that only
  hides a cycle is still a cycle);
- no two product folders import each other, and the folders import in one direction (no cycle):
  a folder is a top-level subpackage of ``kvlocks`` (``summary``, ``compaction``, ...), a top-level
  module (``config.py``, ``plan.py``) counts as its own folder;
- the product's declared dependencies hold neither scipy nor matplotlib (the lab's distribution
  declares them), and every product module imports with both of them unavailable;
- no source file is over 400 lines, and the product stays under ``PRODUCT_LINES``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
LAB_SRC = ROOT / "lab" / "src"
LAB_ONLY = ("scipy", "matplotlib")


def _modules() -> dict[str, Path]:
    out = {}
    for root in (SRC, LAB_SRC):
        for p in root.rglob("*.py"):
            parts = p.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every kvlocks/kvlocks_lab module ``name`` imports, resolved to the deepest module named."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _is_product(name: str) -> bool:
    return name == "kvlocks" or name.startswith("kvlocks.")


def test_the_tree_has_both_parts():
    assert "kvlocks.api" in MODULES and "kvlocks_lab.eval.runner" in MODULES
    assert sum(_is_product(m) for m in MODULES) > 50


def test_product_imports_nothing_from_the_lab():
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if _is_product(m) for t in ts
                 if t.startswith("kvlocks_lab"))
    assert bad == []


def test_library_does_not_import_the_cli():
    cli = ("kvlocks.cli", "kvlocks.commands")
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items()
                 if _is_product(m) and not m.startswith(cli) for t in ts if t.startswith(cli))
    assert bad == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in graph:
        if v not in index:
            visit(v)
    return comps


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    # a package's __init__ re-exporting its own modules is not a cycle between files
    graph = {m: {t for t in ts if not (MODULES[m].name == "__init__.py" and t.startswith(m + "."))}
             for m, ts in GRAPH.items()}
    graph = {m: {t for t in ts if not (MODULES[t].name == "__init__.py" and m.startswith(t + "."))}
             for m, ts in graph.items()}
    assert _cycles(graph) == []


def _folder(name: str) -> str:
    """The top-level folder of ``kvlocks`` a module belongs to (``kvlocks.cache.paged`` ->
    ``kvlocks.cache``); a top-level module is its own folder, the package root is ``kvlocks``."""
    return ".".join(name.split(".")[:2])


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """Product folder -> folder it imports -> the module imports that make the edge."""
    out: dict[str, dict[str, list[str]]] = {}
    for m, ts in graph.items():
        for t in ts:
            if _is_product(m) and _is_product(t) and _folder(m) != _folder(t):
                out.setdefault(_folder(m), {}).setdefault(_folder(t), []).append(f"{m} -> {t}")
    return out


def _mutual(folders: dict[str, dict[str, list[str]]]) -> set[tuple[str, str]]:
    """Pairs of folders that import each other, each pair sorted."""
    return {tuple(sorted((a, b))) for a, bs in folders.items() for b in bs if a in folders.get(b, {})}


FOLDERS = _folder_graph(GRAPH)
# Pairs of folders allowed to import each other: none. Kept as a set so that a temporary allowance
# can be stated here; test_every_allowed_pair_still_exists fails once an allowed pair is gone.
ALLOWED_PAIRS: set[tuple[str, str]] = set()


def test_folder_pair_finder_finds_a_planted_pair():
    planted = {"kvlocks.a.x": {"kvlocks.b.y"}, "kvlocks.b.z": {"kvlocks.a.w"},  # a <-> b, lazily or not
               "kvlocks.a.w": {"kvlocks.a.x"}, "kvlocks.c": {"kvlocks.a.x"}, "kvlocks_lab.d": {"kvlocks.c"}}
    folders = _folder_graph(planted)
    assert _mutual(folders) == {("kvlocks.a", "kvlocks.b")}
    assert folders["kvlocks.b"]["kvlocks.a"] == ["kvlocks.b.z -> kvlocks.a.w"]
    assert _cycles({a: set(bs) for a, bs in folders.items()}) == [["kvlocks.a", "kvlocks.b"]]
    same_folder = {"kvlocks.a.x": {"kvlocks.a.w"}, "kvlocks.a.w": {"kvlocks.a.x"}}
    assert _mutual(_folder_graph(same_folder)) == set()


def test_no_two_product_folders_import_each_other():
    bad = {f"{a} <-> {b}": FOLDERS[a][b] + FOLDERS[b][a] for a, b in sorted(_mutual(FOLDERS) - ALLOWED_PAIRS)}
    assert bad == {}


def test_every_allowed_pair_still_exists():
    gone = ALLOWED_PAIRS - _mutual(FOLDERS)
    assert gone == set(), f"no longer import each other, remove from ALLOWED_PAIRS: {sorted(gone)}"


def test_product_folders_import_in_one_direction():
    # without the allowed pairs' edges, no cycle through any number of folders
    graph = {a: {b for b in bs if tuple(sorted((a, b))) not in ALLOWED_PAIRS} for a, bs in FOLDERS.items()}
    assert _cycles(graph) == []


def _names(reqs) -> set[str]:
    return {r.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in reqs}


def test_product_dependencies_exclude_the_lab_extras():
    core = [r for r in requires("kvlocks") or [] if "extra ==" not in r]
    assert not _names(core) & set(LAB_ONLY)
    assert _names(requires("kvlocks-lab") or []) >= {"kvlocks", *LAB_ONLY}


BLOCKED_IMPORT = """
import importlib, json, pkgutil, sys
# None in sys.modules: `import scipy` raises ImportError and importlib.util.find_spec returns None,
# exactly as when the package is not installed (transformers probes availability with find_spec)
for name in {blocked!r}:
    sys.modules[name] = None
import kvlocks
done, failed = [], []
for m in pkgutil.walk_packages(kvlocks.__path__, "kvlocks."):
    if m.name.startswith("kvlocks.integrations.vllm."):  # needs vllm itself (tests/vllm)
        continue
    try:
        importlib.import_module(m.name)
        done.append(m.name)
    except ImportError as exc:
        failed.append((m.name, str(exc)))
print(json.dumps({{"done": len(done), "failed": failed}}))
"""


def test_every_product_module_imports_without_the_lab_extras():
    code = BLOCKED_IMPORT.format(blocked=set(LAB_ONLY))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["failed"] == [] and result["done"] > 50


@pytest.mark.parametrize("part", ["kvlocks", "kvlocks_lab"])
def test_no_file_over_400_lines(part):
    root = SRC if part == "kvlocks" else LAB_SRC
    long = {str(p.relative_to(root)): n for p in (root / part).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


PRODUCT_LINES = 17_000  # the product stays small: research code belongs in kvlocks_lab (16.6K with the vLLM
# start-up checks, layer table, sinks and memory reserve, the plan's CPU backend and head_dim 256)


def test_product_stays_under_its_line_cap():
    lines = sum(len(p.read_text().splitlines()) for p in (SRC / "kvlocks").rglob("*.py"))
    assert lines < PRODUCT_LINES, lines
