"""The task suite served through real vLLM on the CPU (kvlocks_lab.eval.vllm_tasks): the eval's
records, stock and LOCKS engines, rows scored like the eval's, and LOCKS with a budget that holds
every prompt giving stock's greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_stock_and_locks_engines_answer_the_suite_records(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("KVLOCKS_VLLM_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "kvlocks_lab.eval.vllm_tasks", "--out", str(out), "--model",
                           "smollm2-135m", "--tasks", "passkey", "--lengths", "1024", "--samples", "2", "--budgets",
                           "256", "--exact", "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "2"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert sorted((r["method"], r["budget"], r["index"]) for r in rows) == [
        ("vllm_full", None, 0), ("vllm_full", None, 1), ("vllm_locks", 256, 0), ("vllm_locks", 256, 1)]
    for r in rows:  # scored as the eval scores: the reference number in the greedy answer
        assert r["task"] == "passkey" and r["length"] == 1024 and r["prompt_tokens"] > 900
        assert r["score"] == float(r["references"][0] in r["prediction"]), r
    full = {r["index"]: r for r in rows if r["method"] == "vllm_full"}
    assert all(full[i]["score"] == 1.0 for i in full), full  # SmolLM2 finds the passkey at 1K
    exact = json.loads((out / "exact.json").read_text())
    assert exact["records"] == 2 and exact["differing"] == 0  # every page attended: stock's tokens
    engines = json.loads((out / "engines.json").read_text())["engines"]
    assert any("30 LOCKS" in line for line in engines["vllm_locks_256"]["layer_table"]), engines
