"""The concurrency throughput benchmark's engine worker (kvlocks_lab.bench.vllm_throughput) end to
end in real vLLM on the CPU: a tiny random-weight Llama from a config file, token-id prompts, the
LOCKS backend, several requests submitted at once, each pass's counts from vLLM's outputs."""

from __future__ import annotations

from helpers import run_bench_worker

from kvlocks_lab.bench.vllm_throughput import PASSES


def test_worker_counts_every_request_of_both_passes(tmp_path):
    new = 6
    spec = {"backend": "LOCKS", "cells": [[1024, [3]]], "new_tokens": new, "budget": 256, "prefix": "prefill"}
    rows = run_bench_worker("kvlocks_lab.bench.vllm_throughput", spec, tmp_path)
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
