"""The TPOT benchmark's engine worker (kvlocks_lab.bench.vllm_tpot) end to end in real vLLM on the
CPU: a tiny random-weight Llama from a config file (the Llama-3.1-8B file with smaller sizes),
token-id prompts, the LOCKS backend. Its second pass over each prompt hits the prefix cache, which
is what makes the timed steps pure decode."""

from __future__ import annotations

from helpers import run_bench_worker


def test_worker_times_every_cell_with_the_prompts_cached(tmp_path):
    """Also an engine wider than its contexts (``max_model_len``: the LOCKS plans are as wide as its
    block table) with kernel options for the LOCKS plans and a selection mode (the exact re-rank),
    recorded in every row."""
    kernels, locks = {"short_row_pages": 64}, {"rerank": 2}
    spec = {"backend": "LOCKS", "cells": [[1024, [1, 2]]], "new_tokens": 6, "budget": 256, "max_model_len": 4096,
            "kernels": kernels, "locks": locks}
    rows = run_bench_worker("kvlocks_lab.bench.vllm_tpot", spec, tmp_path)
    assert [(r["context"], r["batch"]) for r in rows] == [(1024, 1), (1024, 2)]
    for r in rows:
        assert r["backend"] == "LOCKS" and r["budget"] == 256 and r["max_model_len"] == 4096
        assert r["kernels"] == kernels and r["locks"] == locks
        assert len(r["tpot_ms_per_request"]) == r["batch"] and all(t > 0 for t in r["tpot_ms_per_request"])
        assert r["ttft_s"] > 0 and all(c >= 512 for c in r["cached_tokens"])  # the prompt came from the cache
