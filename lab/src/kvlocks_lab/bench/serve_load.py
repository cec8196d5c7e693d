"""Concurrent OpenAI-client load on a running ``vllm serve``: mixed lengths, streams, cancels, refusals.

:func:`run_load` sends every request of a plan at once (``asyncio``, one ``openai.AsyncOpenAI``
client over loopback) and returns one row per request: what was sent, what came back (token ids
via vLLM's ``return_token_ids``), the HTTP error of a refused request, and timings.
:func:`summarize` turns the rows into the result file's numbers (requests by outcome, tokens per
second, errors with their messages). :func:`server_metric` reads a counter from the server's
Prometheus ``/metrics`` (``vllm:num_preemptions_total``: was preemption really forced?);
:func:`server_command` starts the server so that it notes which requests were preempted
(:func:`preempted_requests`), :func:`wait_up` waits for it, :class:`MemorySampler` follows the
device memory; :func:`pack_outputs` puts a result folder's files into one archive.

A request of the plan is a dict:

* ``id``: a name;
* ``prompt``: token ids;
* ``max_tokens``;
* ``stream`` (optional): read the answer as a stream;
* ``cancel_after`` (optional, with ``stream``): close the stream after that many chunks (the
  server must abort the request and free its blocks);
* ``kv_transfer_params`` (optional): sent as vLLM's request field (the kvlocks connector's file);
* ``ignore_eos`` (optional, default True): so that a completed request yields exactly
  ``max_tokens`` tokens to compare;
* ``logprobs`` (optional): the top log-probabilities of every generated token, recorded as
  ``row["logprobs"]``, per position ``{token id as a string: log-probability}`` (tokens are asked
  for as ``token_id:N``, which also works without a tokenizer, ``--skip-tokenizer-init``);
* ``request_id`` (optional): sent as vLLM's ``request_id`` (the server's id is ``cmpl-<it>-<n>``).

Decoding is greedy. :func:`compare_tokens` judges a request's greedy tokens against a reference's,
telling a flip at a near-tie (its log-probabilities) from a real difference.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from pathlib import Path


async def _one(client, model: str, req: dict) -> dict:
    import openai

    body = {"return_token_ids": True, "ignore_eos": req.get("ignore_eos", True)}
    for key in ("kv_transfer_params", "request_id"):
        if req.get(key):
            body[key] = req[key]
    kw = {}
    if req.get("logprobs"):
        kw["logprobs"], body["return_tokens_as_token_ids"] = req["logprobs"], True
    row = {"id": req["id"], "prompt_tokens": len(req["prompt"]), "max_tokens": req["max_tokens"],
           "stream": bool(req.get("stream")), "tokens": [], "finish": None, "error": None, "status": None}
    if req.get("logprobs"):
        row["logprobs"] = []
    t0 = time.perf_counter()
    try:
        if req.get("stream"):
            stream = await client.completions.create(model=model, prompt=req["prompt"], max_tokens=req["max_tokens"],
                                                     temperature=0.0, stream=True, extra_body=body, **kw)
            chunks = 0
            async for chunk in stream:
                row["response_id"] = row.get("response_id") or getattr(chunk, "id", None)
                choice = chunk.choices[0] if chunk.choices else None
                if choice is not None:
                    row["tokens"] += list(getattr(choice, "token_ids", None) or [])
                    _add_logprobs(row, choice)
                    row["finish"] = choice.finish_reason or row["finish"]
                    if row.get("first_token_s") is None and row["tokens"]:
                        row["first_token_s"] = time.perf_counter() - t0
                chunks += 1
                if req.get("cancel_after") and chunks >= req["cancel_after"]:
                    await stream.close()  # the client goes away mid-answer
                    row["finish"] = "cancelled"
                    break
        else:
            out = await client.completions.create(model=model, prompt=req["prompt"], max_tokens=req["max_tokens"],
                                                  temperature=0.0, extra_body=body, **kw)
            choice, row["response_id"] = out.choices[0], getattr(out, "id", None)
            row["tokens"], row["finish"] = list(getattr(choice, "token_ids", None) or []), choice.finish_reason
            _add_logprobs(row, choice)
    except openai.APIStatusError as exc:
        row["status"], row["error"] = exc.status_code, _message(exc)
    except openai.APIError as exc:  # a broken connection or a server that went away
        row["error"] = f"{type(exc).__name__}: {exc}"
    row["seconds"] = time.perf_counter() - t0
    return row


def _add_logprobs(row: dict, choice) -> None:
    """Append a choice's top log-probabilities to the row, keyed by token id (``token_id:N`` -> ``N``)."""
    if "logprobs" not in row:
        return
    top = getattr(getattr(choice, "logprobs", None), "top_logprobs", None) or []
    row["logprobs"] += [{k.removeprefix("token_id:"): v for k, v in (pos or {}).items()} for pos in top]


def _message(exc) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        return str(err.get("message", err) if isinstance(err, dict) else err)
    return str(exc)


async def _all(base_url: str, model: str, plan: list[dict], timeout: float) -> list[dict]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", timeout=timeout, max_retries=0) as client:
        return list(await asyncio.gather(*(_one(client, model, r) for r in plan)))


def run_load(base_url: str, model: str, plan: list[dict], *, timeout: float = 600.0) -> tuple[list[dict], float]:
    """Send every request of ``plan`` at once; returns (rows in plan order, wall seconds)."""
    t0 = time.perf_counter()
    rows = asyncio.run(_all(base_url, model, plan, timeout))
    return rows, time.perf_counter() - t0


def server_metric(base_url: str, name: str) -> float | None:
    """The sum of a Prometheus metric's samples on the server's ``/metrics`` (None if absent)."""
    root = base_url.rsplit("/v1", 1)[0]
    text = urllib.request.urlopen(f"{root}/metrics", timeout=30).read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and not line.startswith("#") and line[len(name):len(name) + 1] in ("{", " ")]
    return sum(values) if values else None


def summarize(rows: list[dict], seconds: float) -> dict:
    """Counts by outcome, generated tokens per second over the whole load, and the refusals."""
    done = [r for r in rows if r["error"] is None and r["finish"] in ("length", "stop")]
    cancelled = [r for r in rows if r["finish"] == "cancelled"]
    refused = [r for r in rows if r["error"] is not None]
    other = [r for r in rows if r not in done and r not in cancelled and r not in refused]
    generated = sum(len(r["tokens"]) for r in rows)
    return {"requests": len(rows), "completed": len(done), "cancelled": len(cancelled), "refused": len(refused),
            "other": [{"id": r["id"], "finish": r["finish"], "tokens": len(r["tokens"])} for r in other],
            "generated_tokens": generated, "wall_s": round(seconds, 2),
            "tokens_per_s": round(generated / seconds, 2) if seconds > 0 else None,
            "errors": [{"id": r["id"], "status": r["status"], "message": r["error"]} for r in refused]}


# nats: a tie flip's margin for bf16 logits, whose spacing is 0.125 in [16, 32) and 0.25 in [32, 64),
# so one or two units of their last place (the CUDA vLLM budget test's threshold: tests/vllm_gpu)
BF16_TIE_NATS = 0.25


def margin(top: dict | None, token: int) -> tuple[float | None, str | None]:
    """``token``'s log-probability minus the best other one's in ``top`` (``{token id: logprob}``),
    and that other token's id; (None, None) when ``top`` lacks the token or any other."""
    if not top or str(token) not in top or len(top) < 2:
        return None, None
    other = max((k for k in top if k != str(token)), key=top.__getitem__)
    return top[str(token)] - top[other], other


def compare_tokens(got: list[int], want: list[int], got_top: list[dict] | None = None,
                   want_top: list[dict] | None = None, tol: float = BF16_TIE_NATS) -> dict:
    """A served request's greedy tokens ``got`` against the reference's ``want``, with each one's top
    log-probabilities per position (``{token id: logprob}``, None where not recorded).

    ``equal``; ``tie`` when, at the first differing position ``j``, the two tokens are each other's
    runner-up on every side whose log-probabilities are known (at least one) and the margin between
    them is below ``tol`` on at least one side (a flip at a near-tie: numerics that depend on the
    batch, the prefix cache's chunking or recomputation); ``wrong`` otherwise, also when one is a
    prefix of the other (a different length or finish). Returns the verdict, ``first_difference``
    and the margins at ``j`` (``reference_margin``: the reference's token over the next one,
    ``served_margin`` likewise), None where unknown."""
    if got == want:
        return {"verdict": "equal", "first_difference": None, "reference_margin": None, "served_margin": None}
    j = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    res = {"verdict": "wrong", "first_difference": j, "reference_margin": None, "served_margin": None}
    if j >= min(len(got), len(want)):
        return res
    sides = []
    for name, top, mine, theirs in (("reference", want_top, want[j], got[j]), ("served", got_top, got[j], want[j])):
        m, other = margin(top[j] if top and j < len(top) else None, mine)
        res[f"{name}_margin"] = m
        if m is not None:
            sides.append((m, other == str(theirs)))
    if sides and all(paired for _, paired in sides) and any(m < tol for m, _ in sides):
        res["verdict"] = "tie"
    return res


class MemorySampler(threading.Thread):
    """Peak device memory in use (MiB, ``nvidia-smi``) while it runs; None without nvidia-smi.

    ``peak`` is the whole device's; with ``root`` (a process id) ``peak_tree`` is the most that the
    process and its descendants held at once (``--query-compute-apps``), so another job on the same
    device does not count; it stays None where ``nvidia-smi`` names no process of that tree (a
    container whose process ids the driver does not see).
    """

    def __init__(self, root: int | None = None) -> None:
        super().__init__(daemon=True)
        self.root, self.stop = root, threading.Event()
        self.peak = self.total = self.peak_tree = None

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                used, total = (int(x) for x in _smi("--query-gpu=memory.used,memory.total")[0].split(","))
                self.peak, self.total = max(self.peak or 0, used), total
                if self.root is not None:
                    tree = process_tree(self.root)
                    held = [int(m) for pid, m in (row.split(",") for row in _smi("--query-compute-apps=pid,used_memory"))
                            if int(pid) in tree]
                    if held:
                        self.peak_tree = max(self.peak_tree or 0, sum(held))
            except Exception:  # noqa: BLE001 - no nvidia-smi (the CPU smoke run)
                return
            time.sleep(1.0)


def _smi(query: str) -> list[str]:
    out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=10, check=True).stdout
    return [line for line in out.split("\n") if line.strip()]


def process_tree(root: int, proc: Path = Path("/proc")) -> set[int]:
    """``root`` and every process descended from it, read from ``/proc/*/stat``."""
    parent = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while read
        parent[int(stat.parent.name)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        new = {pid for pid, pp in parent.items() if pp in tree} - tree
        tree |= new
        grew = bool(new)
    return tree


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(proc, base: str, log: Path, limit: float = 420) -> None:
    """Wait until the server ``proc`` at ``base`` answers (exit with its ``log``'s end if it dies)."""
    import openai

    client = openai.OpenAI(base_url=base, api_key="unused", timeout=30, max_retries=0)
    deadline = time.time() + limit
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:
            client.models.list()
            return
        except openai.APIConnectionError:
            if time.time() > deadline:
                raise SystemExit(f"vllm serve did not come up in {limit} s") from None
            time.sleep(2)


_HOOK = """import runpy, sys
path = sys.argv[1]
try:
    from vllm.v1.metrics.stats import IterationStats
    original = IterationStats.update_from_output
    def update_from_output(self, output, *args, **kwargs):
        if any(getattr(e.type, "name", "") == "PREEMPTED" for e in getattr(output, "events", None) or ()):
            # the first output after a preemption: the tokens delivered before it came before the preemption
            stats = [a for a in (*args, *kwargs.values()) if hasattr(a, "num_generation_tokens")]
            with open(path, "a") as f:
                f.write(f"{output.request_id}\\t{stats[0].num_generation_tokens if stats else ''}\\n")
        return original(self, output, *args, **kwargs)
    IterationStats.update_from_output = update_from_output
    open(path, "a").close()
except Exception as exc:
    print("serve_load: no record of preempted requests:", exc, file=sys.stderr)
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def server_command(module: str, record: Path) -> list[str]:
    """The command start that runs vLLM's entry point ``module`` (its arguments follow) with the API
    process's request statistics appending, for each preemption, the request's id and the tokens it
    had generated before it (tab-separated) to ``record``."""
    return [sys.executable, "-c", _HOOK, str(record), module]


def preempted_requests(record: Path, ids: list[str], count: float | None,
                       response_ids: dict[str, str] | None = None) -> dict | None:
    """Per request id sent (as ``request_id``): None if never preempted, else the tokens it had
    generated before its first preemption (from :func:`server_command`'s record; -1 where a record
    line gives no count). The record names a request ``cmpl-<id>-...`` where the server took the
    client's ``request_id``, else by the completion id it answered with (``response_ids``: request
    id -> that id, as :func:`run_load`'s rows keep it). None for the whole result when unknown (no
    record, or ``count`` preemptions and none of them named)."""
    if not record.is_file():
        return None
    first: dict[str, int] = {}
    for line in record.read_text().splitlines():
        rid, _, n = line.strip().partition("\t")
        if rid:
            before = int(n) if n.strip().isdigit() else -1
            first[rid] = min(first.get(rid, before), before) if before >= 0 else first.get(rid, -1)
    out, answered = {}, response_ids or {}
    for i in ids:
        names = {f"cmpl-{i}", answered.get(i)} - {None, ""}
        hits = [n for s, n in first.items() if any(s == m or s.startswith(f"{m}-") for m in names)]
        out[i] = min(hits) if hits else None
    if count and all(v is None for v in out.values()):
        return None
    return out


def pack_outputs(out: Path, keep: set[str], name: str, limit: int = 15 << 20) -> list[str]:
    """Move everything in ``out`` but ``keep`` into ``out/name`` (a gzipped tar), so that few files
    come back; past ``limit`` bytes it is packed again without the largest entries. Returns what
    was left out of the archive (and deleted all the same)."""
    entries = sorted(p for p in out.iterdir() if p.name not in keep | {name})
    sizes = {p: sum(f.stat().st_size for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()) for p in entries}
    left: list[Path] = []
    while True:
        with tarfile.open(out / name, "w:gz") as tar:
            for p in entries:
                if p not in left:
                    tar.add(p, arcname=p.name)
        if (out / name).stat().st_size <= limit or len(left) == len(entries):
            break
        left.append(max((p for p in entries if p not in left), key=sizes.__getitem__))
    for p in entries:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return [p.name for p in left]
