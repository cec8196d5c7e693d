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
