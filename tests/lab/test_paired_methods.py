"""scripts/analysis/paired_methods.py: methods paired with a reference method record by record."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "analysis" / "paired_methods.py"


def _run(tmp_path, rows, *args):
    """The script on ``rows``: ``(its stdout, {(task, budget): paired row})``."""
    path, out = tmp_path / "rows.jsonl", tmp_path / "paired.json"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(path), *args, "--out", str(out)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, {(r["task"], r["budget"]): r for r in json.loads(out.read_text())}


def _row(task, index, method, budget, score, kl):
    return {"task": task, "length": 2048, "index": index, "method": method, "budget": budget, "score": score,
            "kl": kl}


def test_pairs_by_record_and_pools_over_cells(tmp_path):
    rows = []
    for i in range(4):
        rows += [_row("a", i, "full", None, 1.0, 0.0), _row("a", i, "oracle", 64, float(i < 2), 0.2),
                 _row("a", i, "locks", 64, float(i < 1), 0.4)]
    rows += [_row("b", 0, "oracle", 64, 1.0, 0.1), _row("b", 0, "locks", 64, 1.0, 0.3),
             _row("b", 1, "locks", 64, 0.0, 0.3)]  # record 1 has no oracle row: not paired
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "paired.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(path), "--methods", "locks", "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    got = {(r["task"], r["budget"]): r for r in json.loads(out.read_text())}
    a, b, pooled = got[("a", 64)], got[("b", 64)], got[("all", 64)]
    assert (a["n"], a["method"], a["reference"], a["diff"], a["full"]) == (4, 0.25, 0.5, -0.25, 1.0)
    assert abs(a["kl_method"] - 0.4) < 1e-12 and abs(a["kl_reference"] - 0.2) < 1e-12
    assert (b["n"], b["diff"], b["full"]) == (1, 0.0, None)
    assert pooled["n"] == 5 and abs(pooled["diff"] - (-0.25 * 4 + 0.0) / 5) < 1e-12
    assert pooled["low"] <= pooled["diff"] <= pooled["high"]
    assert "| a | 2048 | 64 | locks | 4 | 100 | 25.0 | 50.0 | -25.0" in proc.stdout


def test_full_as_reference_pairs_every_budget(tmp_path):
    rows = []
    for i in range(4):
        rows += [_row("a", i, "full", None, float(i < 3), 0.0), _row("a", i, "locks", 64, float(i < 1), 0.4),
                 _row("a", i, "locks", 256, float(i < 3), 0.1)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "paired.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(path), "--against", "full", "--methods", "locks",
                           "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    got = {(r["task"], r["budget"]): r for r in json.loads(out.read_text())}
    assert set(got) == {("a", 64), ("a", 256), ("all", 64), ("all", 256)}
    low, high = got[("a", 64)], got[("a", 256)]
    assert (low["n"], low["method"], low["reference"], low["diff"]) == (4, 0.25, 0.75, -0.5)
    assert (high["n"], high["diff"], high["low"], high["high"]) == (4, 0.0, 0.0, 0.0)
    assert abs(low["kl_reference"]) < 1e-12 and abs(low["kl_method"] - 0.4) < 1e-12


def test_rows_without_kl_pair_by_score_and_print_no_kl(tmp_path):
    """Rows served through vLLM carry no KL: their pairs are scored, their KL reported as missing."""
    rows = []
    for i in range(3):
        rows += [_row("a", i, "locks", 512, float(i < 2), 0.1), _row("a", i, "vllm_locks", 512, float(i < 1), None)]
    stdout, got = _run(tmp_path, rows, "--against", "locks", "--methods", "vllm_locks")
    a = got[("a", 512)]
    assert (a["n"], a["method"], a["reference"], a["kl_method"]) == (3, 1 / 3, 2 / 3, None)
    assert abs(a["kl_reference"] - 0.1) < 1e-12
    assert "| a | 2048 | 512 | vllm_locks | 3 | - | 33.3 | 66.7 | -33.3" in stdout and "| - | 0.100 |" in stdout


def test_by_length_pools_the_tasks_of_each_length(tmp_path):
    """Two tasks at two lengths: each length's row pools its two tasks' records, by hand."""
    rows = []
    for task, length, ref, mine in (("a", 1024, 1.0, 0.0), ("b", 1024, 1.0, 1.0), ("a", 4096, 0.0, 1.0),
                                    ("b", 4096, 1.0, 1.0)):
        for i in range(2):
            rows += [{**_row(task, i, "oracle", 64, ref, 0.1), "length": length},
                     {**_row(task, i, "locks", 64, mine, 0.2), "length": length}]
    path, out = tmp_path / "rows.jsonl", tmp_path / "paired.json"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(path), "--methods", "locks", "--by-length", "--out",
                           str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    got = {(r["task"], r["length"]): r for r in json.loads(out.read_text())}
    assert set(got) == {("a", 1024), ("b", 1024), ("a", 4096), ("b", 4096), ("all", 1024), ("all", 4096),
                        ("all", "all")}
    short, long = got[("all", 1024)], got[("all", 4096)]
    assert (short["n"], short["method"], short["reference"], short["diff"]) == (4, 0.5, 1.0, -0.5)
    assert (long["n"], long["method"], long["reference"], long["diff"]) == (4, 1.0, 0.5, 0.5)
    assert got[("all", "all")]["n"] == 8 and got[("all", "all")]["diff"] == 0.0
