"""The CPU decode benchmark at a tiny size: its files and fields."""

import json

import pytest

from kvlocks_lab.bench.cpu_decode import CpuDecodeConfig, run

pytestmark = pytest.mark.model


def test_bad_methods_are_refused():
    with pytest.raises(ValueError, match="CpuDecodeConfig.methods: 'lock'"):
        CpuDecodeConfig(methods=("full", "lock"))
    with pytest.raises(ValueError, match="'full_ref'"):
        CpuDecodeConfig(methods=("full_ref",))


def test_small_run_writes_rows_summary_and_plot(tmp_path):
    from kvlocks.models import load

    model, tok = load("smollm2-135m")
    cfg = CpuDecodeConfig(lengths=(300,), methods=("full", "locks"), budget=64, blocks=1, warmup=0, top_ops=3)
    summary = run(cfg, tmp_path, model=model, tok=tok)
    rows = {r["method"]: r for r in map(json.loads, (tmp_path / "rows.jsonl").read_text().splitlines())}
    assert set(rows) == {"full", "locks"} and (tmp_path / "step_ms.png").exists()
    assert {"commit", "machine", "versions", "config", "results"} <= set(summary)
    assert len(rows["locks"]["step_ms"]) == 16 and rows["full"]["ratio_to_full"] == 1
    assert rows["locks"]["stats"]["read_fraction"] < 1 == rows["full"]["stats"]["read_fraction"]
    assert {"scores", "select", "attend", "build_page"} <= set(rows["locks"]["layer_parts"])
    assert set(rows["full"]["layer_parts"]) == {"full"} and len(rows["locks"]["top_ops"]) == 3
