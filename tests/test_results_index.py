"""docs/results/README.md indexes every result folder under docs/results/: one table row a folder,
no row for a folder that is not there, and every folder holds a README.md or a JSON file that
says what made it (but for the raw-log folders listed below)."""

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
INDEX = RESULTS / "README.md"
FIRST_CELL = re.compile(r"^\|\s*`([^`/]+)/`\s*\|")


def _folders():
    return sorted(p.name for p in RESULTS.iterdir() if p.is_dir())


def _table_rows():
    """The table's body rows (not its header or separator), as (line, folder named or None)."""
    lines = INDEX.read_text(encoding="utf-8").splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("| folder |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        m = FIRST_CELL.match(line)
        rows.append((line, m.group(1) if m else None))
    return rows


def test_every_folder_has_exactly_one_row_and_every_row_names_a_folder():
    rows = _table_rows()
    assert rows, "docs/results/README.md has no table rows"
    unnamed = [line for line, name in rows if name is None]
    assert not unnamed, f"rows whose first cell is not a backticked `FOLDER/`: {unnamed}"
    named = [name for _, name in rows]
    folders = _folders()
    counts = {f: named.count(f) for f in folders}
    missing = [f for f, c in counts.items() if c == 0]
    repeated = [f for f, c in counts.items() if c > 1]
    assert not missing, f"folders without a row in docs/results/README.md: {missing}"
    assert not repeated, f"folders with more than one row: {repeated}"
    stale = sorted(set(named) - set(folders))
    assert not stale, f"rows naming folders that do not exist under docs/results/: {stale}"


# Folders of raw logs only (.txt, .jsonl, .csv.gz), with neither README.md nor a .json file: their
# row in docs/results/README.md is all that describes them. The list may only shrink.
RAW_LOG_FOLDERS = {
    "2026-12-01-h200-score-launch-probe",
    "2026-12-02-h200-build-cubins",
    "2026-12-02-h200-engine-check",
    "2026-12-02-h200-gpu-tests",
    "2026-12-02-h200-score-kernel-ncu",
    "2026-12-02-h200-short-context-probe",
    "2026-12-03-h200-gpu-tests",
}


def _described(folder):
    d = RESULTS / folder
    return (d / "README.md").is_file() or any(d.rglob("*.json"))


def test_every_folder_has_a_readme_or_json():
    bare = [f for f in _folders() if not _described(f) and f not in RAW_LOG_FOLDERS]
    assert not bare, f"result folders with neither README.md nor a .json file: {bare}"


def test_raw_log_folders_are_still_raw_logs():
    """Each listed exception still exists and still lacks both, so the list does not outlive it."""
    folders = set(_folders())
    gone = sorted(RAW_LOG_FOLDERS - folders)
    assert not gone, f"RAW_LOG_FOLDERS names folders that do not exist: {gone}"
    described = sorted(f for f in RAW_LOG_FOLDERS if _described(f))
    assert not described, f"these have a README.md or .json; drop them from RAW_LOG_FOLDERS: {described}"
