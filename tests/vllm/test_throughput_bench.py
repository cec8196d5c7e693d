"""The concurrency throughput benchmark's engine worker (kvlocks_lab.bench.vllm_throughput) end to
end in real vLLM on the CPU: a tiny random-weight Llama from a config file, token-id prompts, the
LOCKS backend, several requests submitted at once, each pass's counts from vLLM's outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvlocks_lab.bench.vllm_throughput import PASSES
from kvlocks_lab.bench.vllm_tpot import CONFIGS


def test_worker_counts_every_request_of_both_passes(tmp_path):
    cfg = json.loads((CONFIGS / "llama3.1-8b" / "config.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=1024)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(cfg))
    new = 6
    spec = {"model": "tiny", "model_dir": str(tmp_path / "tiny"), "backend": "LOCKS", "cells": [[1024, [3]]],
            "new_tokens": new, "budget": 256, "vocab": 1024, "prefix": "prefill", "gpu_memory_utilization": 0.15}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("KVLOCKS_VLLM_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "kvlocks_lab.bench.vllm_throughput", "--worker",
                           str(tmp_path / "spec.json"), str(tmp_path / "rows.json")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["context"], r["concurrency"], r["pass"]) for r in rows] == [(1024, 3, p) for p in PASSES]
    for r in rows:
        assert r["backend"] == "LOCKS" and r["budget"] == 256 and r["output_tokens"] == 3 * new
        assert abs(r["tok_s"] - r["output_tokens"] / r["wall_s"]) < 1e-9
        assert len(r["decode_tok_s_per_request"]) == 3 and all(x > 0 for x in r["decode_tok_s_per_request"])
        assert r["kv_pool_tokens"] >= 3 * (1024 + new) and r["preemptions"] == 0
    cold, warm = rows
    assert all(c < 16 for c in cold["cached_tokens"])  # fresh prompts: nothing cached
    # the same prompts again: their whole blocks come from the cache (not the one with the last prompt token)
    assert all(512 <= c < 1024 for c in warm["cached_tokens"])
