"""Shared helpers of the CUDA vLLM tests: run a script in a subprocess, the engine settings.

Every engine runs in its own process with the engine core in that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one GPU, the uniprocess executor), so the LOCKS backend's
counters (:func:`kvlocks.integrations.vllm.cuda.backend.debug_counters`) are readable there. The
prompt helpers are the CPU suite's (``tests/vllm/helpers.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "vllm"))

from helpers import long_text, read_trace, tokenize  # noqa: E402,F401 (re-exported)

# small and quick to start: the bundled model needs little memory. The tests run side by side
# (scripts/gpu/vllm_tests.sh): each engine takes 12 % of the GPU and a KV pool of a fixed size, since
# vLLM's memory profiling fails when another process's memory changes meanwhile; 4 graph sizes
GPU_SHARE = 0.12
KV_BYTES = 4 << 30  # 180K tokens of the bundled model's KV
GPU_LLM = {"gpu_memory_utilization": GPU_SHARE, "kv_cache_memory_bytes": KV_BYTES}
BASE_LLM = {"dtype": "bfloat16", **GPU_LLM, "max_num_seqs": 8,
            "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]}}
DEBUG_VARS = ("KVLOCKS_VLLM_CONFIG", "KVLOCKS_VLLM_TRACE", "KVLOCKS_VLLM_VERIFY", "KVLOCKS_VLLM_CHECK",
              "KVLOCKS_VLLM_IGNORE_TAGS", "KVLOCKS_VLLM_CONNECTOR_TRACE", "KVLOCKS_VLLM_COUNTERS",
              "VLLM_BATCH_INVARIANT")


def worker_env() -> dict:
    """The environment of an engine process: this one's, less the kvlocks debug switches, with vLLM's
    FlashInfer sampler off and, under pytest-xdist, a vLLM compile cache of this worker's own."""
    full = {k: v for k, v in os.environ.items() if k not in DEBUG_VARS}
    full["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        full["VLLM_CACHE_ROOT"] = f"/tmp/kvlocks-vllm-cache-{worker}"
    return full


def run_script(script: str, spec: dict, tmp: Path, name: str, env: dict | None = None, timeout: int = 900,
               where: Path = HERE) -> dict:
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    full_env = {**worker_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    log = tmp / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, str(where / script), str(spec_path), str(out_path)], env=full_env,
                              stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"{script} failed (rc {proc.returncode}); last log lines:\n"
                             + "\n".join(log.read_text().splitlines()[-40:]))
    return json.loads(out_path.read_text())


def run_engine(spec: dict, tmp: Path, name: str, env: dict | None = None) -> dict:
    """``engine_gpu.py`` with ``BASE_LLM`` under the spec's ``llm`` settings."""
    return run_script("engine_gpu.py", {**spec, "llm": {**BASE_LLM, **spec.get("llm", {})}}, tmp, name, env)


def save(tmp: Path, name: str, obj) -> None:
    """Keep a result next to the logs (the lead copies tmp folders into the results)."""
    (tmp / name).write_text(json.dumps(obj, indent=1))
