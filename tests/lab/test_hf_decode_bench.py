"""The Hugging Face decode benchmark (a GPU benchmark) at a tiny size on the CPU: its files and fields."""

import json

import pytest

from kvlocks_lab.bench.hf_decode import HfDecodeConfig, run

pytestmark = pytest.mark.model


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="HfDecodeConfig.methods: 'lock'"):
        HfDecodeConfig(methods=("locks", "lock"))
    with pytest.raises(ValueError, match="dtype"):
        HfDecodeConfig(dtype="int8")


def test_small_run_writes_rows_and_summary(tmp_path):
    from kvlocks.models import load

    model, _ = load("smollm2-135m")
    cfg = HfDecodeConfig(lengths=(200,), methods=("locks", "locks_rerank", "locks_centroid"), budget=64,
                         dtype="float32", steps=2, warmup=0, device="cpu")
    summary = run(cfg, tmp_path, model=model)
    rows = {r["method"]: r for r in map(json.loads, (tmp_path / "rows.jsonl").read_text().splitlines())}
    assert set(rows) == {"locks", "locks_rerank", "locks_centroid"}
    assert {"commit", "device", "versions", "config", "results", "rerank_at_most_1_3x_locks"} <= set(summary)
    assert all(r["backend"] == "cpu" and len(r["step_ms"]) == 2 for r in rows.values())
    assert rows["locks"]["ratio_to_locks"] == 1 and rows["locks_rerank"]["config"]["rerank"] == 4
    assert rows["locks_centroid"]["config"]["rerank_scores"] == "centroid"
