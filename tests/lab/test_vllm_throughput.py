"""The concurrency throughput benchmark's arithmetic (kvlocks_lab.bench.vllm_throughput), by hand:
a pass's numbers from vLLM-like request outputs, and the LOCKS / FLASH_ATTN ratio per cell."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvlocks_lab.bench.vllm_throughput import main, pass_row, ratios


def _out(n_tokens: int, first: float, last: float, latency: float, cached: int):
    metrics = SimpleNamespace(first_token_ts=first, last_token_ts=last, first_token_latency=latency)
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n_tokens)))], metrics=metrics,
                           num_cached_tokens=cached)


def test_a_pass_counts_tokens_over_the_wall_and_each_requests_decode_rate():
    outs = [_out(5, 10.0, 12.0, 1.5, 0), _out(5, 11.0, 11.5, 2.5, 16)]
    row = pass_row(outs, wall=4.0, new=5)
    assert row["output_tokens"] == 10 and row["tok_s"] == 2.5
    assert row["decode_tok_s_per_request"] == [2.0, 8.0]  # 4 steps in 2 s and in 0.5 s
    assert row["first_token_s_max"] == 2.5 and row["cached_tokens"] == [0, 16]


def test_ratios_pair_locks_with_flash_attn_on_the_same_cell_and_pass():
    def r(backend, ctx, n, p, tok_s):
        return {"model": "m", "backend": backend, "context": ctx, "concurrency": n, "pass": p, "tok_s": tok_s}

    rows = [r("FLASH_ATTN", 65536, 8, "warm", 100.0), r("LOCKS", 65536, 8, "warm", 150.0),
            r("FLASH_ATTN", 65536, 8, "cold", 40.0), r("LOCKS", 65536, 8, "cold", 30.0),
            r("LOCKS", 131072, 8, "warm", 90.0),  # no FLASH_ATTN row: no ratio
            {"model": "m", "backend": "FLASH_ATTN", "error": "timeout"}]
    assert ratios(rows) == {"m|65536|8|warm": 1.5, "m|65536|8|cold": 0.75}


@pytest.mark.parametrize("argv, needle", [
    (["--out", "x", "--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--out", "x", "--concurrency", "0"], "every --concurrency >= 1"),
    (["--out", "x", "--contexts", "8"], "every --contexts >= 16"),
    ([], "--out is required"),
])
def test_bad_arguments_are_refused_before_any_engine_starts(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_a_failed_engine_is_one_row_with_its_error_and_the_summary_counts_it(tmp_path):
    """A worker that cannot start (here: a spec without its cells) leaves one row naming the engine,
    its exit and the log's last lines, appended to rows.jsonl; the summary counts it as an error."""
    import argparse
    import json

    from kvlocks_lab.bench import engine_process

    spec = {"model": "tiny", "backend": "FLASH_ATTN"}
    rows = engine_process.run_rows("kvlocks_lab.bench.vllm_throughput", spec, tmp_path, 120,
                                   {"model": "tiny", "backend": "FLASH_ATTN", "cells": []})
    assert len(rows) == 1 and rows[0]["error"] == "rc 1" and rows[0]["model"] == "tiny"
    assert "Error" in rows[0]["log_tail"]
    assert [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()] == rows
    summary = engine_process.write_summary(tmp_path, argparse.Namespace(out=tmp_path, worker=None), rows, extra=1)
    assert summary["errors"] == 1 and summary["rows"] == 1 and summary["extra"] == 1
    assert summary["settings"] == {"out": str(tmp_path)} and "commit" in summary and "date" in summary
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


WORKER = """
import json, sys
from pathlib import Path
spec_path, out_path = sys.argv[2], sys.argv[3]
spec = json.loads(Path(spec_path).read_text())
runs = Path(spec["runs"])
runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
Path(out_path).write_text(json.dumps({"doubled": spec["n"] * 2}))
"""


def test_an_engine_that_finished_with_the_same_spec_is_reused_not_run_again(tmp_path, monkeypatch):
    import os

    from kvlocks_lab.bench import engine_process

    (tmp_path / "fake_worker.py").write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out, runs = tmp_path / "out", tmp_path / "runs.txt"
    out.mkdir()
    spec = {"n": 3, "runs": str(runs)}
    assert engine_process.run("fake_worker", spec, out, "e", 60)[0] == {"doubled": 6}
    assert engine_process.run("fake_worker", spec, out, "e", 60, reuse=True)[0] == {"doubled": 6}
    assert runs.read_text() == "x"  # reused: not run again
    assert engine_process.run("fake_worker", {**spec, "n": 4}, out, "e", 60, reuse=True)[0] == {"doubled": 8}
    assert runs.read_text() == "xx"  # another spec runs
    assert engine_process.run("fake_worker", {**spec, "n": 4}, out, "e", 60)[0] == {"doubled": 8}
    assert runs.read_text() == "xxx"  # without reuse it always runs
