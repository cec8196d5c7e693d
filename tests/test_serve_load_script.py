"""scripts/gpu/serve_load.py's judgement of the hostile files' requests, by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "serve_load.py"


def _module():
    spec = importlib.util.spec_from_file_location("serve_load_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(error=None, finish="length", status=None, tokens=()):
    return {"error": error, "finish": finish, "status": status, "tokens": list(tokens)}


def test_hostile_requests_must_be_refused_or_continue_the_declared_content():
    m = _module()
    plan = [{"id": "hostile_other_model", "kind": "hostile"}, {"id": "hostile_tampered", "kind": "hostile"},
            {"id": "req_0", "kind": "main"}]
    files = {"hf": {f"a|{m.Q1}": [7, 8, 9]}}
    refused = {"hostile_other_model": _row("other weights", None, 400), "hostile_tampered": _row("load", "error", 500)}
    assert [h["ok"] for h in m.hostile_outcomes(plan, refused, files)] == [True, True]
    # the tampered file's header is file a's: served from file a's cached blocks, it must give file a's tokens
    cached = {**refused, "hostile_tampered": _row(tokens=[7, 8, 9])}
    assert [(h["outcome"], h["ok"]) for h in m.hostile_outcomes(plan, cached, files)] == [
        ("refused", True), ("served file a's cached prefix", True)]
    wrong = {**refused, "hostile_tampered": _row(tokens=[7, 8, 1])}
    assert [h["ok"] for h in m.hostile_outcomes(plan, wrong, files)] == [True, False]
    # a file for other weights is never served
    served = {**refused, "hostile_other_model": _row(tokens=[1])}
    assert [h["ok"] for h in m.hostile_outcomes(plan, served, files)] == [False, True]


def test_a_random_weight_plan_spans_its_contexts_with_token_ids_in_the_vocabulary():
    """--model-dir: random token ids (no tokenizer), the main requests from --min-context to the limit,
    the same plan for the same arguments."""
    m = _module()
    plan = m.make_plan(5, 4096, None, 128, low=1024, vocab=1000)
    main = [r for r in plan if r["kind"] == "main"]
    assert [len(r["prompt"]) for r in main] == [1024 + (4096 - 130 - 1024) * i // 4 for i in range(5)]
    assert all(10 <= t < 1000 for r in plan for t in r["prompt"])
    assert [r["kind"] for r in plan].count("over") == 2 and len(plan[-1]["prompt"]) == 4096 - 20
    assert plan == m.make_plan(5, 4096, None, 128, low=1024, vocab=1000)


def test_bad_model_arguments_are_refused(tmp_path, capsys):
    import pytest

    m = _module()
    with pytest.raises(SystemExit):
        m.main(["--out", str(tmp_path / "o"), "--model-dir", str(tmp_path)])
    assert "no config.json there" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        m.main(["--out", str(tmp_path / "o"), "--min-context", "9000"])
    assert "--min-context 9000: must be >= 16 and below --max-model-len 8192" in capsys.readouterr().err
