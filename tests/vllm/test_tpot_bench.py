"""The TPOT benchmark's engine worker (kvlocks_lab.bench.vllm_tpot) end to end in real vLLM on the
CPU: a tiny random-weight Llama from a config file (the Llama-3.1-8B file with smaller sizes),
token-id prompts, the LOCKS backend. Its second pass over each prompt hits the prefix cache, which
is what makes the timed steps pure decode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvlocks_lab.bench.vllm_tpot import CONFIGS


def test_worker_times_every_cell_with_the_prompts_cached(tmp_path):
    cfg = json.loads((CONFIGS / "llama3.1-8b" / "config.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=1024)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(cfg))
    spec = {"model": "tiny", "model_dir": str(tmp_path / "tiny"), "backend": "LOCKS", "cells": [[1024, [1, 2]]],
            "new_tokens": 6, "budget": 256, "vocab": 1024, "gpu_memory_utilization": 0.15}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("KVLOCKS_VLLM_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "kvlocks_lab.bench.vllm_tpot", "--worker", str(tmp_path / "spec.json"),
                           str(tmp_path / "rows.json")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["context"], r["batch"]) for r in rows] == [(1024, 1), (1024, 2)]
    for r in rows:
        assert r["backend"] == "LOCKS" and r["budget"] == 256 and r["max_model_len"] == 1024 + 6 + 16
        assert len(r["tpot_ms_per_request"]) == r["batch"] and all(t > 0 for t in r["tpot_ms_per_request"])
        assert r["ttft_s"] > 0 and all(c >= 512 for c in r["cached_tokens"])  # the prompt came from the cache
