"""Tensor parallelism on the CPU with the plugin.

The bundled model has 9 query heads and 3 KV heads, so vLLM rejects tensor_parallel_size=2 for it
(heads must divide evenly); 3 is the smallest degree > 1 it accepts. Each worker holds one KV head
and its own summaries; LOCKS selects per KV head, so the pages and the greedy tokens must equal
the single-process run's.
"""

from __future__ import annotations

import os

from helpers import long_text, read_trace, run_engine

from kvlocks.config import LocksConfig


def test_tensor_parallel_3_matches_single_process(tmp_path):
    prompts = [long_text(40), long_text(25, seed=3)]
    cfg = LocksConfig(budget=64).to_json()
    base = {"dtype": "float32", "max_model_len": 1024, "enable_prefix_caching": False}
    spec = {"prompts": prompts, "max_tokens": 16, "locks": cfg}
    t1, t3 = tmp_path / "tp1.jsonl", tmp_path / "tp3.jsonl"
    one = run_engine({**spec, "llm": base}, tmp_path, "tp1", env={"KVLOCKS_VLLM_TRACE": str(t1)})
    # one NUMA node here: vLLM's automatic thread binding refuses 3 workers, so give each rank a core
    cores = len(os.sched_getaffinity(0))
    bind = "|".join(str(i % cores) for i in range(3))
    three = run_engine({**spec, "llm": {**base, "tensor_parallel_size": 3}}, tmp_path, "tp3",
                       env={"KVLOCKS_VLLM_TRACE": str(t3), "VLLM_CPU_OMP_THREADS_BIND": bind})
    assert three["tokens"] == one["tokens"]
    r1, r3 = read_trace(t1), read_trace(t3)
    assert len({r["pid"] for r in r3}) == 3 and all(len(r["pages"]) == 1 for r in r3)
    # per (layer, seq_len): the union over workers of their one KV head's pages = TP=1's heads
    single = {(r["layer"], r["seq_len"]): sorted(r["pages"]) for r in r1}
    merged: dict = {}
    for r in r3:
        merged.setdefault((r["layer"], r["seq_len"]), []).extend(r["pages"])
    assert set(merged) == set(single)
    assert all(sorted(merged[k]) == single[k] for k in single)
