"""Every ```python block in README.md and docs/*.md runs as written, on the bundled model.

A block is run in a fresh namespace (``__name__ == "__main__"``) in a temporary folder, so the
files it writes land there. A block that cannot run here opts out with a first line
``# doc-snippet: skip (reason)``, and the reason is reported. The module's summary line says how
many blocks ran and how many were skipped.
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
