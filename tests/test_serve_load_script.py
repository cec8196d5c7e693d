"""scripts/gpu/serve_load.py's judgements by hand: the hostile files' requests, a served request's
tokens against its run alone (equal, a tie flip, wrong), and the result folder packed into one archive."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tarfile
import time
from types import SimpleNamespace

import pytest

from kvlocks_lab.bench.serve_load import _add_logprobs, compare_tokens, pack_outputs, preempted_requests, process_tree

from script_module import load_script


def _module():
    return load_script("gpu/serve_load.py", "serve_load_script")


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
    m = _module()
    with pytest.raises(SystemExit):
        m.main(["--out", str(tmp_path / "o"), "--model-dir", str(tmp_path)])
    assert "no config.json there" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        m.main(["--out", str(tmp_path / "o"), "--min-context", "9000"])
    assert "--min-context 9000: must be >= 16 and below --max-model-len 8192" in capsys.readouterr().err


def test_a_difference_is_a_tie_flip_only_between_runners_up_at_a_small_margin():
    assert compare_tokens([5, 7, 9], [5, 7, 9])["verdict"] == "equal"
    want_top = [{"5": -0.1, "6": -3.0}, {"7": -0.70, "8": -0.72}, {"9": -0.2, "1": -2.0}]
    got_top = [{"5": -0.1, "6": -3.0}, {"8": -0.69, "7": -0.71}, {"9": -0.2, "1": -2.0}]
    c = compare_tokens([5, 8, 9], [5, 7, 9], got_top, want_top, tol=0.05)
    assert (c["verdict"], c["first_difference"]) == ("tie", 1)
    assert c["reference_margin"] == pytest.approx(0.02) and c["served_margin"] == pytest.approx(0.02)
    # 2.4 nats on the reference's side and 2.95 on the served side: a real difference
    far = compare_tokens([5, 8, 9], [5, 7, 9], [None, {"8": -0.05, "7": -3.0}], [None, {"7": -0.1, "8": -2.5}])
    assert far["verdict"] == "wrong" and far["reference_margin"] == pytest.approx(2.4)
    # a close call on one side is enough when the two tokens are each other's runner-up on both
    one = compare_tokens([5, 8, 9], [5, 7, 9], [None, {"8": -0.05, "7": -3.0}], [None, {"7": -0.70, "8": -0.72}])
    assert one["verdict"] == "tie"
    # a close reference, but the served token was not its runner-up
    third = compare_tokens([5, 8, 9], [5, 7, 9], None, [None, {"7": -0.70, "3": -0.71}])
    assert third["verdict"] == "wrong" and third["reference_margin"] == pytest.approx(0.01)
    # no reference log-probabilities (the CPU runner): the served side alone, against the tolerance
    served_only = [None, {"8": -0.690, "7": -0.695}]
    assert compare_tokens([5, 8, 9], [5, 7, 9], served_only, None, tol=0.05)["verdict"] == "tie"
    assert compare_tokens([5, 8, 9], [5, 7, 9], served_only, None, tol=1e-3)["verdict"] == "wrong"
    assert compare_tokens([5, 8, 9], [5, 7, 9])["verdict"] == "wrong"  # nothing known
    # a different length or finish (one a prefix of the other) is wrong whatever the margins
    short = compare_tokens([5, 7], [5, 7, 9], got_top, want_top)
    assert (short["verdict"], short["first_difference"], short["reference_margin"]) == ("wrong", 2, None)


def test_served_top_logprobs_are_keyed_by_token_id():
    row = {"logprobs": []}
    _add_logprobs(row, SimpleNamespace(logprobs=SimpleNamespace(top_logprobs=[{"token_id:7": -0.1, "token_id:8": -2.0},
                                                                              None])))
    _add_logprobs(row, SimpleNamespace(logprobs=None))
    assert row["logprobs"] == [{"7": -0.1, "8": -2.0}, {}]


def test_differences_mark_kinds_preemption_and_the_final_request():
    m = _module()
    plan = [{"id": f"req_{i}", "kind": "main"} for i in range(4)] + [{"id": "file_a", "kind": "file", "key": "k"}]
    close, far = {"3": -0.50, "4": -0.51}, {"3": -0.1, "4": -4.0}

    def row(rid, tokens, top=None):
        return {"id": rid, "tokens": tokens, "logprobs": top, "error": None, "finish": "length", "prompt_tokens": 9}

    res = {"rows": [row("req_0", [1, 4], [{}, {"4": -0.5, "3": -0.52}]),
                    row("req_1", [1, 4], [{}, {"4": -0.1, "3": -4}]),
                    row("req_2", [1, 4], [{}, {"4": -0.1, "3": -4}]),  # preempted after 1 token: differs at 1
                    row("req_3", [1, 4], [{}, {"4": -0.1, "3": -4}]),  # preempted after 2 tokens: differs before
                    row("file_a", [2, 2])],
           "final": [row("final", [1, 4], [{}, {"4": -0.5, "3": -0.52}])],
           "preempted": {"req_0": None, "req_1": None, "req_2": 1, "req_3": 2, "final": None}}
    alone = {"tokens": [[1, 3]] * 4, "logprobs": [[{}, close], [{}, far], [{}, far], [{}, far]]}
    diff, final = m.differences(plan, {"hf": {"k": [2, 3]}}, res, alone, 0.05)
    assert [(d["id"], d["kind"], d["verdict"], d["preempted_after_tokens"]) for d in diff] == [
        ("req_0", "main", "tie", None), ("req_1", "main", "wrong", None), ("req_2", "main", "after_preemption", 1),
        ("req_3", "main", "wrong", 2), ("file_a", "file", "wrong", None)]
    assert (final["verdict"], final["first_difference"]) == ("tie", 1)
    assert m.after_preemption({"verdict": "wrong", "first_difference": 3}, -1)["verdict"] == "wrong"  # no count
    assert m.after_preemption({"verdict": "equal", "first_difference": None}, 0)["verdict"] == "equal"


def test_compacted_file_rows_are_judged_against_the_file_served_alone():
    """On CUDA each file's request is compared with the file alone through the LOCKS backend, with
    both sides' top-2 log-probabilities; without that reference, against the HF path's tokens with the
    served side's log-probabilities alone."""
    m = _module()
    plan = [{"id": "file_a", "kind": "file", "key": "a|q"}, {"id": "file_b", "kind": "file", "key": "b|q"},
            {"id": "hostile_tampered", "kind": "hostile"}]

    def row(rid, tokens, top):
        return {"id": rid, "tokens": tokens, "logprobs": top, "error": None, "finish": "length", "prompt_tokens": 9,
                "status": 200}

    near, sure = [{}, {"5": -0.60, "6": -0.62}], [{}, {"5": -0.1, "6": -3.0}]
    res = {"rows": [row("file_a", [2, 5], near), row("file_b", [2, 5], sure), row("hostile_tampered", [2, 5], near)],
           "final": [], "preempted": {}}
    alone = {"file_a": {"tokens": [2, 6], "logprobs": [{}, {"6": -0.60, "5": -0.61}]},
             "file_b": {"tokens": [2, 6], "logprobs": [{}, {"6": -0.05, "5": -3.5}]}}
    files = {"hf": {"a|q": [2, 6], f"a|{m.Q1}": [2, 6], "b|q": [2, 5]}, "alone": alone}
    diff, _ = m.differences(plan, files, res, {"tokens": [], "logprobs": None}, 0.25)
    assert [(d["id"], d["verdict"], d["first_difference"]) for d in diff] == [("file_a", "tie", 1), ("file_b", "wrong", 1)]
    rows = {r["id"]: r for r in res["rows"]}
    assert m.files_against_hf(plan, files, rows) == {"file_a": 1, "file_b": "equal"}
    assert [(h["outcome"], h["ok"]) for h in m.hostile_outcomes(plan, rows, files)] == [
        ("served file a's cached prefix", True)]  # file a's tokens up to the same tie flip
    hf_only = {"hf": {**files["hf"], "b|q": [2, 6]}}  # --cpu: the HF path's tokens
    diff, _ = m.differences(plan, hf_only, res, {"tokens": [], "logprobs": None}, 0.25)
    assert [(d["id"], d["verdict"]) for d in diff] == [("file_a", "tie"), ("file_b", "wrong")]


def test_preempted_requests_are_named_by_the_server_record(tmp_path):
    rec = tmp_path / "p.txt"
    assert preempted_requests(rec, ["req_1"], 2) is None  # no record
    rec.write_text("cmpl-req_1-0-1a2b3c4d\t17\ncmpl-soak0_req_1-0-5e6f\t3\ncmpl-req_1-0-1a2b3c4d\t40\n"
                   "cmpl-req_2-0-9a\t\n")
    assert preempted_requests(rec, ["req_1", "req_10", "req_2", "final"], 4) == {
        "req_1": 17, "req_10": None, "req_2": -1, "final": None}  # the first preemption; -1: no count
    assert preempted_requests(rec, ["other"], 2) is None  # preemptions the record does not name
    rec.write_text("cmpl-90c3-0-b8b1\t46\ncmpl-88aa-0-96a8\t7\n")  # ids of the server's own (vLLM 0.26)
    assert preempted_requests(rec, ["req_0", "req_1", "final"], 2, {"req_0": "cmpl-90c3", "final": "cmpl-77"}) == {
        "req_0": 46, "req_1": None, "final": None}
    rec.write_text("")
    assert preempted_requests(rec, ["req_1"], 0) == {"req_1": None}


def test_the_hook_records_each_preemption_with_the_tokens_before_it(tmp_path):
    """The server hook's wrapper, on stand-ins for vLLM's output and request statistics."""
    import types

    from kvlocks_lab.bench.serve_load import _HOOK

    calls = []

    class IterationStats:
        def update_from_output(self, output, timestamp, is_prefilling, req_stats, lora, name):
            calls.append(output.request_id)

    stats_mod = types.ModuleType("vllm.v1.metrics.stats")
    stats_mod.IterationStats = IterationStats
    rec = tmp_path / "rec.txt"
    code = _HOOK.split("sys.argv = sys.argv[2:]")[0]  # install the wrapper, do not start a server
    saved = {k: sys.modules.get(k) for k in ("vllm", "vllm.v1", "vllm.v1.metrics", "vllm.v1.metrics.stats")}
    try:
        for k in saved:
            sys.modules[k] = stats_mod if k.endswith("stats") else types.ModuleType(k)
        argv, sys.argv = sys.argv, ["-c", str(rec)]
        exec(compile(code, "hook", "exec"), {})
    finally:
        sys.argv = argv
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    pre = SimpleNamespace(type=SimpleNamespace(name="PREEMPTED"))
    sched = SimpleNamespace(type=SimpleNamespace(name="SCHEDULED"))
    st = IterationStats()
    st.update_from_output(SimpleNamespace(request_id="cmpl-a", events=[pre, sched]), 0.0, False,
                          SimpleNamespace(num_generation_tokens=12), None, None)
    st.update_from_output(SimpleNamespace(request_id="cmpl-b", events=None), 0.0, False,
                          SimpleNamespace(num_generation_tokens=3), None, None)
    assert calls == ["cmpl-a", "cmpl-b"]  # the original still runs
    assert rec.read_text() == "cmpl-a\t12\n"


def test_the_result_folder_packs_into_one_archive(tmp_path):
    (tmp_path / "serve_load.json").write_text(json.dumps({"requests": 1}))
    (tmp_path / "serve.log").write_text("log")
    (tmp_path / "caches").mkdir()
    (tmp_path / "caches" / "a.safetensors").write_bytes(b"x" * 1000)
    assert pack_outputs(tmp_path, {"serve_load.json"}, "files.tgz") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["files.tgz", "serve_load.json"]
    with tarfile.open(tmp_path / "files.tgz") as tar:
        assert sorted(tar.getnames()) == ["caches", "caches/a.safetensors", "serve.log"]
    (tmp_path / "big").write_bytes(random.Random(0).randbytes(300_000))  # gzip cannot shrink it
    (tmp_path / "small.txt").write_text("s")
    assert pack_outputs(tmp_path, {"serve_load.json"}, "files.tgz", limit=100_000) == ["big"]
    with tarfile.open(tmp_path / "files.tgz") as tar:
        assert tar.getnames() == ["small.txt"]


def test_the_process_tree_holds_children_and_grandchildren_only(tmp_path):
    ready = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']);"
            f"open({str(ready)!r}, 'w').write(str(p.pid)); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for _ in range(200):
            if ready.exists() and ready.read_text():
                break
            time.sleep(0.05)
        grandchild = int(ready.read_text())
        tree = process_tree(child.pid)
        assert {child.pid, grandchild} <= tree
        assert other.pid not in tree and os.getpid() not in tree
    finally:
        for p in (child, other):
            p.kill()
            p.wait()
        os.kill(grandchild, 9)
