"""scripts/analysis/merge_bench_runs.py: merging benchmark runs (dedupe, sort, exclusions)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "analysis" / "merge_bench_runs.py"


def _run(tmp_path, name, rows, bw):
    d = tmp_path / name
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"device": "dev", "commit": name, "copy_gbps": bw, "rows": rows,
                                                "errors": [{"model": "m", "error": "skipped"}], "config": {}}))
    return d / "summary.json"


def _row(model, ctx, b, method, tpot):
    return {"model": model, "context": ctx, "batch": b, "method": method, "tpot_ms": tpot}


def _merge(tmp_path, *args):
    out = tmp_path / "merged.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "--note", "n", *map(str, args)],
                          capture_output=True, text=True)
    return proc, (json.loads(out.read_text()) if proc.returncode == 0 else None)


def test_dedupe_keeps_first_run_sort_orders_and_exclude_moves_rows_to_errors(tmp_path):
    new = _run(tmp_path, "new", [_row("a", 256, 1, "dense", 1.0), _row("a", 256, 4, "dense", 4.0)], 100.0)
    old = _run(tmp_path, "old", [_row("a", 1024, 1, "dense", 9.0), _row("a", 256, 4, "dense", 99.0),
                                 _row("b", 512, 3, "dense", 7.0), _row("b", 512, 3, "locks", 3.0),
                                 _row("b", 512, 1, "locks", 2.0)], 200.0)
    proc, m = _merge(tmp_path, "--dedupe", "--sort", "--exclude", "b:512:3=bad run", f"{new}=cmd new", old)
    assert proc.returncode == 0, proc.stderr
    keys = [(r["model"], r["context"], r["batch"], r["tpot_ms"]) for r in m["rows"]]
    # model a first (first seen), then by batch, largest context first; a 256 x4 from the newer run
    assert keys == [("a", 1024, 1, 9.0), ("a", 256, 1, 1.0), ("a", 256, 4, 4.0), ("b", 512, 1, 2.0)]
    excluded = [e for e in m["errors"] if e["error"].startswith("excluded")]
    assert sorted((e["method"], e["tpot_ms"]) for e in excluded) == [("dense", 7.0), ("locks", 3.0)]
    assert all(e["error"] == "excluded: bad run" and e["run"].endswith("/old") for e in excluded)
    assert len(m["errors"]) == 4  # both runs' own errors kept
    assert m["copy_gbps"] == [100.0, 200.0]
    assert [r["command"] for r in m["config"]["runs"]] == ["cmd new", None]


@pytest.mark.parametrize("spec", ["b:512:9=reason", "b:512=reason", "b:512:3"])
def test_exclude_of_a_missing_case_or_a_malformed_spec_is_an_error(tmp_path, spec):
    old = _run(tmp_path, "old", [_row("b", 512, 3, "dense", 7.0)], 1.0)
    proc, m = _merge(tmp_path, "--exclude", spec, old)
    assert proc.returncode != 0 and m is None
    assert "--exclude" in proc.stderr


def test_exclude_of_one_run_keeps_the_same_case_from_another(tmp_path):
    """``@RUN`` scopes an exclusion to one run: the newer run's batch-4 rows go to errors, the older
    run's rows of the same case fill the table (with --dedupe they would otherwise be dropped)."""
    new = _run(tmp_path, "new", [_row("a", 256, 1, "dense", 1.0), _row("a", 256, 4, "dense", 4.0)], 1.0)
    old = _run(tmp_path, "old", [_row("a", 256, 1, "dense", 9.0), _row("a", 256, 4, "dense", 5.0)], 1.0)
    run_new = f"{tmp_path.name}/new"
    proc, m = _merge(tmp_path, "--dedupe", "--exclude", f"a:256:4@{run_new}=other settings", new, old)
    assert proc.returncode == 0, proc.stderr
    assert [(r["batch"], r["tpot_ms"], r["run"]) for r in m["rows"]] == [
        (1, 1.0, run_new), (4, 5.0, f"{tmp_path.name}/old")]
    excluded = [e for e in m["errors"] if e["error"].startswith("excluded")]
    assert [(e["batch"], e["tpot_ms"], e["run"]) for e in excluded] == [(4, 4.0, run_new)]
    proc, m = _merge(tmp_path, "--exclude", "a:256:4@no/such=reason", new, old)
    assert proc.returncode != 0 and "--exclude" in proc.stderr
