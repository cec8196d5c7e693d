"""scripts/analysis/compare_bench.py: cases matched by key, after / before, regressions past the tolerance."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "analysis" / "compare_bench.py"
spec = importlib.util.spec_from_file_location("compare_bench", SCRIPT)
compare_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_bench)


def _rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_ratios_regressions_and_unmatched_cases(tmp_path):
    case = {"shape": "llama3-8b", "context": 1024, "batch": 1}
    before = _rows(tmp_path / "b.jsonl", [{**case, "method": "locks", "time_us": 100.0},
                                          {**case, "method": "dense", "time_us": 400.0},
                                          {**case, "method": "gone", "time_us": 5.0},
                                          {**case, "method": "failed", "error": "timeout"}])
    after = _rows(tmp_path / "a.jsonl", [{**case, "method": "locks", "time_us": 103.5},
                                         {**case, "method": "dense", "time_us": 404.0},
                                         {**case, "method": "new", "time_us": 1.0}])
    out = tmp_path / "c.json"
    assert compare_bench.main([before, after, "--out", str(out)]) == 1  # locks: 1.035 > 1.03
    got = json.loads(out.read_text())
    ratios = {c["key"][3]: round(c["ratio"], 4) for c in got["cases"]}
    assert ratios == {"locks": 1.035, "dense": 1.01}
    assert [c["key"][3] for c in got["regressions"]] == ["locks"]
    assert got["only_before"] == [["llama3-8b", 1024, 1, "gone"]] and got["only_after"] == [["llama3-8b", 1024, 1, "new"]]
    assert compare_bench.main([before, after, "--tolerance", "0.05"]) == 0


def test_e2e_rows_compare_their_tpot_and_no_common_case_is_an_error(tmp_path):
    row = {"model": "glm4-9b-1m", "context": 131072, "batch": 1, "method": "locks"}
    before = _rows(tmp_path / "b.jsonl", [{**row, "tpot_ms": 10.0}])
    after = _rows(tmp_path / "a.jsonl", [{**row, "tpot_ms": 9.0}])
    assert compare_bench.main([before, after]) == 0
    other = _rows(tmp_path / "o.jsonl", [{**row, "context": 4096, "tpot_ms": 9.0}])
    assert compare_bench.main([before, other]) == 2
