"""The serving test's compacted-cache files (``scripts/gpu/serve_load.py``): made by
``tests/vllm/compact_ref.py``, sent as requests through the kvlocks connector, and judged against
each file served alone through the LOCKS backend on CUDA (top-2 log-probabilities both sides, as the
main requests), else against the Hugging Face path's tokens; the hostile files' outcomes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import long_text

ROOT = Path(__file__).resolve().parents[2]
FILE_TOKENS = 24  # new tokens after a compacted file
Q1 = " Question: what is the code word for box 12? Answer:"


def _doc(items: int, seed: int) -> str:
    return long_text(items, seed=seed).split(" Question:")[0]


def file_rows(files: dict) -> list[dict]:
    """The plan's requests after compacted files: files a and b (kind ``file``, judged), and the file
    for other weights and the tampered one (kind ``hostile``, :func:`hostile_outcomes`)."""
    from kvlocks.integrations.vllm.connector.compacted import compacted_request

    rows = []
    for doc in ("a", "b"):
        prompt, params = compacted_request(files["docs"][doc]["path"], files["questions"][Q1],
                                           files["vocab_size"], name=f"{doc}.safetensors")
        rows.append({"id": f"file_{doc}", "kind": "file", "key": f"{doc}|{Q1}", "doc": doc,
                     "prompt": prompt["prompt_token_ids"], "max_tokens": FILE_TOKENS, "ignore_eos": False,
                     "kv_transfer_params": params, "logprobs": 2})
    for rid, name in (("hostile_other_model", "other_weights"), ("hostile_tampered", "tampered_data")):
        prompt, params = compacted_request(files["bad"][name], files["questions"][Q1], files["vocab_size"],
                                           name=f"bad_{name}.safetensors")
        rows.append({"id": rid, "kind": "hostile", "prompt": prompt["prompt_token_ids"], "max_tokens": FILE_TOKENS,
                     "ignore_eos": False, "kv_transfer_params": params, "logprobs": 2})
    return rows


def compacted_files(args, out: Path) -> dict | None:
    """The CPU suite's compacted files (``tests/vllm/compact_ref.py``), or None (``--no-files``, or
    random weights: the files are the bundled model's)."""
    if args.no_files or args.model_dir:
        return None
    files = out / "caches"
    files.mkdir(exist_ok=True)
    spec = {"dir": str(files), "max_tokens": FILE_TOKENS, "questions": [Q1],
            "reference_dtype": "float32" if args.cpu else "bfloat16",  # the server's dtype
            "docs": [{"name": "a", "text": _doc(20, 0), "method": "fold", "t": 48},
                     {"name": "b", "text": _doc(14, 5), "method": "drop_refit", "t": 40}]}
    (out / "compact.spec.json").write_text(json.dumps(spec))
    with open(out / "compact.log", "w") as log:
        subprocess.run([args.compact_python or sys.executable, str(ROOT / "tests" / "vllm" / "compact_ref.py"),
                        str(out / "compact.spec.json"), str(out / "compact.json")], stdout=log,
                       stderr=subprocess.STDOUT, check=True)
    return {**json.loads((out / "compact.json").read_text()), "cache_dir": str(files)}


def file_references(args, plan, files: dict, out: Path, locks_json: str) -> dict:
    """Each compacted file's request alone through the kvlocks connector and the LOCKS backend in an
    offline CUDA engine (``tests/vllm_gpu/connector_gpu.py``, the server's settings): per request id
    ``tokens`` and ``logprobs`` (top 2 a position), the reference the served file rows are judged by."""
    rows = [r for r in plan if r["kind"] == "file"]
    spec = {"llm": {"dtype": "bfloat16", "block_size": 16, "max_model_len": args.max_model_len,
                    "gpu_memory_utilization": args.share, "enable_prefix_caching": False},
            "cache_dir": files["cache_dir"], "max_tokens": FILE_TOKENS, "locks": locks_json, "logprobs": 2,
            "batches": [[{"id": r["id"], "file": files["docs"][r["doc"]]["path"], "new": files["questions"][Q1]}]
                        for r in rows]}
    (out / "files_alone.spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "VLLM_BATCH_INVARIANT": "1"}
    env.pop("KVLOCKS_VLLM_CONFIG", None)
    with open(out / "files_alone.log", "w") as log:
        subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_gpu" / "connector_gpu.py"),
                        str(out / "files_alone.spec.json"), str(out / "files_alone.json")],
                       env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return json.loads((out / "files_alone.json").read_text())["results"]


def file_reference(rid: str, key: str, files: dict) -> tuple[list[int], list[dict] | None]:
    """A compacted file's reference tokens and top log-probabilities: the file alone through the LOCKS
    backend (``files["alone"]``, by request id, CUDA), else the Hugging Face path's tokens
    (``files["hf"]``, by ``key``; no log-probabilities: a difference is judged by the served side's)."""
    alone = (files.get("alone") or {}).get(rid)
    if alone is not None:
        return alone["tokens"], alone.get("logprobs")
    return files["hf"][key], None


def file_a_tokens(got: dict, files: dict, tol: float | None = None) -> bool:
    """Whether ``got`` continues file a's content: file a's reference tokens, up to a tie flip."""
    from kvlocks_lab.bench.serve_load import BF16_TIE_NATS, compare_tokens

    want, want_top = file_reference("file_a", f"a|{Q1}", files)
    verdict = compare_tokens(got["tokens"], want, got.get("logprobs"), want_top, tol or BF16_TIE_NATS)["verdict"]
    return verdict in ("equal", "tie")


def files_against_hf(plan, files, rows: dict) -> dict:
    """Each completed file row against the Hugging Face path's decode in the server's dtype (another
    implementation: kept to read, not counted): ``equal`` or the first differing position."""
    out = {}
    for r in (r for r in plan if r["kind"] == "file" and rows[r["id"]]["error"] is None):
        got, want = rows[r["id"]]["tokens"], files["hf"][r["key"]]
        out[r["id"]] = "equal" if got == want else next(
            (i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return out


def hostile_outcomes(plan, rows: dict, files) -> list[dict]:
    """What each hostile file's request got, and whether that is allowed: the file for other weights
    is refused (its header); the tampered one (``tests/vllm/compact_ref.py`` changes a data byte of
    file a's and keeps its header, so its checksum and placeholder ids are file a's) is refused when
    its data is read, or, when vLLM's prefix cache already holds every placeholder block from a load
    of file a, continues that validated content: file a's reference tokens (:func:`file_a_tokens`)."""
    out = []
    for r in (r for r in plan if r["kind"] == "hostile"):
        got = rows[r["id"]]
        refused = got["error"] is not None or got["finish"] not in ("length", "stop")
        if r["id"] == "hostile_tampered" and not refused:
            ok, outcome = file_a_tokens(got, files), "served file a's cached prefix"
        else:
            ok, outcome = refused, "refused" if refused else "served"
        out.append({"id": r["id"], "outcome": outcome, "status": got["status"], "ok": ok})
    return out
