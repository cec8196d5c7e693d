"""One vLLM engine in its own process, for the lab's vLLM measurements (``vllm_tpot``, ``vllm_tasks``).

The caller writes a JSON spec; the process runs ``python -m MODULE --worker SPEC OUT`` with the
engine core in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), vLLM's FlashInfer sampler off
and ``KVLOCKS_VLLM_CONFIG`` unset (a LOCKS engine enables itself from its spec; a stock engine stays
stock); stdout and stderr go to ``OUT_DIR/NAME.log``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run(module: str, spec: dict, out: Path, name: str, timeout: int) -> tuple[object, str]:
    """``(result, log text)``: the worker's JSON result, or a :class:`Failure` when it exited
    non-zero or ran past ``timeout`` seconds."""
    spec_path, res_path, log = out / f"{name}.spec.json", out / f"{name}.out.json", out / f"{name}.log"
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
