"""Every ```python block in README.md and docs/*.md runs as written, on the bundled model; every
link and ``docs/*.md`` reference in them and in the sources points to something that exists.

A block is run in a fresh namespace (``__name__ == "__main__"``) in a temporary folder, so the
files it writes land there. A block that cannot run here opts out with a first line
``# doc-snippet: skip (reason)``, and the reason is reported: blocks that need vLLM, a GPU or
files a command writes say so (e.g. ``# doc-snippet: skip (needs a CUDA GPU and vLLM 0.26 with
kvlocks installed)``). A first line that mentions ``doc-snippet`` in any other form is an error,
so a marker cannot silently fail to apply, and so is an unmarked block that imports vLLM (the
test's environment has none). The module's summary line says how many blocks ran
and how many were skipped.

Links: a relative Markdown link in README.md, docs/*.md, docs/results/*/README.md or
scripts/gpu/README.md must name an existing file, and its ``#anchor`` a heading of that file
(GitHub's slugs). A ``docs/NAME.md`` written anywhere in the repository's text (sources, scripts,
tests, docs; result folders excepted, they record what was) must exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = re.compile(r"#\s*doc-snippet:\s*skip\s*\((?P<reason>[^)]+)\)\s*$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")


def extract_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, code)`` of each fenced block tagged ``python`` or ``py``.

    Fences may be indented (inside a list); the indent is removed from the code.
    """
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        indent, lang, start = m["indent"], m["lang"].lower(), i + 1
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1
        if lang in ("python", "py"):
            blocks.append((start + 1, "\n".join(body) + "\n"))
    return blocks


def skip_reason(code: str) -> str | None:
    """The reason of a ``# doc-snippet: skip (reason)`` first line, else None."""
    first = code.lstrip("\n").splitlines()[0] if code.strip() else ""
    if "doc-snippet" not in first:
        return None
    m = SKIP.fullmatch(first.strip())
    if m is None:
        raise ValueError(f"bad marker {first.strip()!r}: write '# doc-snippet: skip (reason)'")
    return m["reason"].strip()


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


SNIPPETS = [(f"{p.relative_to(ROOT)}:{line}", code) for p in _doc_files() for line, code in
            extract_blocks(p.read_text())]
TALLY = {"ran": 0, "skipped": []}


class _Summary:
    """Adds the line ``doc snippets: N of M ran, K skipped (...)`` to the run's closing summary."""

    def pytest_terminal_summary(self, terminalreporter):
        reasons = "; ".join(TALLY["skipped"])
        terminalreporter.write_line(f"doc snippets: {TALLY['ran']} of {len(SNIPPETS)} ran"
                                    + (f", {len(TALLY['skipped'])} skipped ({reasons})" if reasons else ""))


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    if TALLY["ran"] or TALLY["skipped"]:
        request.config.pluginmanager.register(_Summary(), "kvlocks-doc-snippets")


def test_the_extractor_finds_blocks_and_markers():
    md = ("text\n```python\nx = 1\n```\n\n```bash\nls\n```\n  ```py\n  # doc-snippet: skip (needs vLLM)\n"
          "  import vllm\n  ```\n```\nplain\n```\n")
    blocks = extract_blocks(md)
    assert [line for line, _ in blocks] == [3, 10]
    assert blocks[0][1] == "x = 1\n" and skip_reason(blocks[0][1]) is None
    assert skip_reason(blocks[1][1]) == "needs vLLM" and blocks[1][1].startswith("# doc-snippet")
    with pytest.raises(ValueError, match="bad marker"):
        skip_reason("# doc-snippet: skip\nimport vllm\n")


def test_the_readme_has_a_snippet():
    assert any(where.startswith("README.md:") for where, _ in SNIPPETS)


@pytest.mark.model
@pytest.mark.parametrize("where,code", SNIPPETS, ids=[w for w, _ in SNIPPETS])
def test_snippet_runs(where, code, tmp_path, monkeypatch, capsys):
    reason = skip_reason(code)
    if reason is None and re.search(r"^\s*(from|import)\s+vllm\b", code, re.M):
        pytest.fail(f"the snippet at {where} imports vLLM: mark it '# doc-snippet: skip (needs vLLM ...)'")
    if reason is not None:
        TALLY["skipped"].append(f"{where}: {reason}")
        pytest.skip(f"{where}: {reason}")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__", "__file__": str(tmp_path / "snippet.py")}
    try:
        exec(compile(code, f"{where} (snippet)", "exec"), namespace)
    except Exception as exc:
        pytest.fail(f"the snippet at {where} fails: {type(exc).__name__}: {exc}\n{code}")
    TALLY["ran"] += 1


# ---------------------------------------------------------------- links and doc references

LINK = re.compile(r"\]\(([^)\s]+)\)")
DOC_REF = re.compile(r"(?<![\w/.-])docs/[a-z0-9][a-z0-9_-]*\.md")


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown text's headings (outside fences): lower case, punctuation
    dropped, spaces as hyphens, ``-1``, ``-2`` ... for repeats."""
    anchors: set[str] = set()
    repeats: dict[str, int] = {}
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = repeats.get(slug, 0)
        repeats[slug] = n + 1
        anchors.add(f"{slug}-{n}" if n else slug)
    return anchors


def _linked_files() -> list[Path]:
    return [*_doc_files(), *sorted((ROOT / "docs" / "results").glob("*/README.md")),
            ROOT / "docs" / "results" / "README.md", ROOT / "scripts" / "gpu" / "README.md"]


def test_the_anchor_rule():
    assert heading_anchors("# kvlocks in vLLM\n## On a GPU: the CUDA backend (vLLM 0.26)\n```\n# no\n```\n"
                           "## kvlocks' own engine (H200)\n## Limits\n## Limits\n") == {
        "kvlocks-in-vllm", "on-a-gpu-the-cuda-backend-vllm-026", "kvlocks-own-engine-h200", "limits", "limits-1"}


def test_relative_links_resolve():
    bad = []
    for md in _linked_files():
        if not md.exists():
            continue
        for n, line in enumerate(md.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (md.parent / path).resolve() if path else md
                where = f"{md.relative_to(ROOT)}:{n}: {target}"
                if not dest.exists():
                    bad.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
                    bad.append(f"{where} (no such heading)")
    assert not bad, "\n".join(bad)


def _text_files() -> list[Path]:
    """The repository's own text files (no venvs, builds or result folders); no git needed."""
    skip = {"__pycache__", "build", "dist", "results", "node_modules"}
    out = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for top in ("src", "lab", "scripts", "tests", "docs", ".ci"):
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT).parts
            if (path.is_file() and path.suffix in (".md", ".py", ".sh", ".cu", ".toml", ".txt")
                    and not skip.intersection(rel) and not any(part.endswith(".egg-info") for part in rel)):
                out.append(path)
    return out


def test_doc_references_exist():
    bad = []
    for path in _text_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            bad += [f"{path.relative_to(ROOT)}:{n}: {ref}" for ref in DOC_REF.findall(line) if not (ROOT / ref).exists()]
    assert not bad, "references to docs that do not exist:\n" + "\n".join(bad)
