"""One vLLM engine in its own process, for the lab's vLLM measurements (``vllm_tpot``,
``vllm_throughput``, ``vllm_tasks``), and what their result files share: the rows appended as each
engine finishes, and a summary with the run's settings and facts (date, commit, GPU, versions).

The caller writes a JSON spec; the process runs ``python -m MODULE --worker SPEC OUT`` with the
engine core in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), vLLM's FlashInfer sampler off
and ``KVLOCKS_VLLM_CONFIG`` unset (a LOCKS engine enables itself from its spec; a stock engine stays
stock); stdout and stderr go to ``OUT_DIR/NAME.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def run(module: str, spec: dict, out: Path, name: str, timeout: int, reuse: bool = False) -> tuple[object, str]:
    """``(result, log text)``: the worker's JSON result, or a :class:`Failure` when it exited
    non-zero or ran past ``timeout`` seconds. ``reuse``: a result already in ``out`` from the same
    spec (an earlier run cut off after this engine) is returned without running it again."""
    spec_path, res_path, log = out / f"{name}.spec.json", out / f"{name}.out.json", out / f"{name}.log"
    if reuse and res_path.is_file() and spec_path.is_file() and json.loads(spec_path.read_text()) == spec:
        return json.loads(res_path.read_text()), log.read_text(errors="replace") if log.is_file() else ""
    res_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    env.pop("KVLOCKS_VLLM_CONFIG", None)
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, "-m", module, "--worker", str(spec_path), str(res_path)], env=env,
                                stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log.read_text(errors="replace")
    if rc != 0:
        return Failure(f"rc {rc}" if rc != "timeout" else "timeout", text.splitlines()[-20:]), text
    return json.loads(res_path.read_text()), text


class Failure:
    """A worker that failed: ``error`` (``"rc N"`` or ``"timeout"``) and the last lines of its log."""

    def __init__(self, error: str, log_tail: list[str]) -> None:
        self.error, self.log_tail = error, log_tail


def worker_main(worker_args, fn) -> int:
    """In the worker process: ``fn(spec)`` on the spec file, its JSON result to the out file."""
    spec_path, out_path = worker_args
    Path(out_path).write_text(json.dumps(fn(json.loads(Path(spec_path).read_text()))))
    return 0


def parse_args(ap: argparse.ArgumentParser, argv, worker) -> argparse.Namespace:
    """A lab vLLM measurement's arguments: with ``--worker SPEC OUT`` (how :func:`run` starts the
    process) runs ``worker`` on the spec and exits; otherwise ``--out`` is required."""
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        raise SystemExit(worker_main(args.worker, worker))
    if args.out is None:
        ap.error("--out is required")
    return args


def run_rows(module: str, spec: dict, out: Path, timeout: int, ident: dict) -> list[dict]:
    """The worker's rows for ``spec`` (named ``MODEL_BACKEND``), or one row with ``ident``, the error
    and the log's last lines; appended to ``OUT/rows.jsonl`` either way."""
    res, _ = run(module, spec, out, f"{spec['model']}_{spec['backend']}", timeout)
    rows = [{**ident, "error": res.error, "log_tail": "\n".join(res.log_tail[-15:])}] \
        if isinstance(res, Failure) else res
    with open(out / "rows.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


def write_summary(out: Path, args, rows: list[dict], **fields) -> dict:
    """``OUT/summary.json``: the command's arguments, the run's facts, ``fields``, the row and error counts."""
    summary = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"},
               **run_facts(), **fields, "rows": len(rows), "errors": sum("error" in r for r in rows)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def run_facts() -> dict:
    """Date, Python, commit (``KVLOCKS_COMMIT`` where git's state is not the tree's), torch, GPU, vLLM."""
    facts = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0]}
    try:
        facts["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                         cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        facts["commit"] = None
    from kvlocks import env

    facts["commit"] = env.get("KVLOCKS_COMMIT") or facts["commit"]
    import torch

    facts["torch"] = torch.__version__
    facts["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        import vllm

        facts["vllm"] = getattr(vllm, "__version__", None)  # None: a folder named vllm, not the package
    except ImportError:
        facts["vllm"] = None
    return facts
