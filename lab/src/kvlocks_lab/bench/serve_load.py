"""Concurrent OpenAI-client load on a running ``vllm serve``: mixed lengths, streams, cancels, refusals.

:func:`run_load` sends every request of a plan at once (``asyncio``, one ``openai.AsyncOpenAI``
client over loopback) and returns one row per request: what was sent, what came back (token ids
via vLLM's ``return_token_ids``), the HTTP error of a refused request, and timings.
:func:`summarize` turns the rows into the result file's numbers (requests by outcome, tokens per
second, errors with their messages). :func:`server_metric` reads a counter from the server's
Prometheus ``/metrics`` (``vllm:num_preemptions_total``: was preemption really forced?).

A request of the plan is a dict:

* ``id``: a name;
* ``prompt``: token ids;
* ``max_tokens``;
* ``stream`` (optional): read the answer as a stream;
* ``cancel_after`` (optional, with ``stream``): close the stream after that many chunks (the
  server must abort the request and free its blocks);
* ``kv_transfer_params`` (optional): sent as vLLM's request field (the kvlocks connector's file);
* ``ignore_eos`` (optional, default True): so that a completed request yields exactly
  ``max_tokens`` tokens to compare.

Decoding is greedy.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request


async def _one(client, model: str, req: dict) -> dict:
    import openai

    body = {"return_token_ids": True, "ignore_eos": req.get("ignore_eos", True)}
    if req.get("kv_transfer_params"):
        body["kv_transfer_params"] = req["kv_transfer_params"]
    row = {"id": req["id"], "prompt_tokens": len(req["prompt"]), "max_tokens": req["max_tokens"],
           "stream": bool(req.get("stream")), "tokens": [], "finish": None, "error": None, "status": None}
    t0 = time.perf_counter()
    try:
        if req.get("stream"):
            stream = await client.completions.create(model=model, prompt=req["prompt"], max_tokens=req["max_tokens"],
                                                     temperature=0.0, stream=True, extra_body=body)
            chunks = 0
            async for chunk in stream:
                choice = chunk.choices[0] if chunk.choices else None
                if choice is not None:
                    row["tokens"] += list(getattr(choice, "token_ids", None) or [])
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
                                                  temperature=0.0, extra_body=body)
            choice = out.choices[0]
            row["tokens"], row["finish"] = list(getattr(choice, "token_ids", None) or []), choice.finish_reason
    except openai.APIStatusError as exc:
        row["status"], row["error"] = exc.status_code, _message(exc)
    except openai.APIError as exc:  # a broken connection or a server that went away
        row["error"] = f"{type(exc).__name__}: {exc}"
    row["seconds"] = time.perf_counter() - t0
    return row


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
