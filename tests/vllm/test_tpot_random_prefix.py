"""The TPOT benchmark's ``--prefix connector`` (kvlocks_lab.bench.random_prefix) in real vLLM on the CPU:
the prompts' first ``context - 1`` tokens are loaded as random K/V by the bench's KV connector, not
computed; decode runs on them, with the LOCKS backend (whose summaries of the loaded pages are built
from the written keys, checked through its trace with verification on) and with the stock CPU
attention (the connector is backend agnostic). Plus the connector's pieces without an engine: the
random K/V and the slot arithmetic."""

from __future__ import annotations

import pytest
import torch
from helpers import read_trace, run_bench_worker

from kvlocks_lab.bench import random_prefix as rp
from kvlocks_lab.bench.vllm_tpot import main

CTX, NEW, BUDGET = 2048, 6, 256
BLOCK = 128  # vLLM's CPU block size


def test_random_kv_depends_only_on_position():
    """The entry of a position is the same whatever range it is generated in (a reload of a tail
    writes what the first load wrote), layers and seeds differ, pieces stay inside one chunk."""
    def cat(seed, layer, start, stop):
        pieces = list(rp.random_kv(seed, layer, start, stop, 2, 64, torch.bfloat16))
        assert [p for p, _, _ in pieces][0] == start
        assert all((p // rp.CHUNK) == ((p + k.shape[0] - 1) // rp.CHUNK) for p, k, _ in pieces)
        return torch.cat([k for _, k, _ in pieces]), torch.cat([v for _, _, v in pieces])

    k_all, v_all = cat(0, 3, 0, rp.CHUNK + 500)
    assert k_all.shape == (rp.CHUNK + 500, 2, 64) and k_all.dtype == torch.bfloat16
    k_tail, v_tail = cat(0, 3, rp.CHUNK - 128, rp.CHUNK + 500)
    assert torch.equal(k_tail, k_all[rp.CHUNK - 128:]) and torch.equal(v_tail, v_all[rp.CHUNK - 128:])
    assert not torch.equal(cat(0, 4, 0, 64)[0], k_all[:64]) and not torch.equal(cat(1, 3, 0, 64)[0], k_all[:64])


def test_random_keys_have_page_structure():
    """Keys of one 16-token page share a direction (cosine ~0.8), keys of different pages do not;
    every element has about unit variance, values are standard normal."""
    keys, values = rp.random_chunk(0, 0, 0, 2, 128)
    k = torch.nn.functional.normalize(keys[:1024].view(64, rp.PAGE, 2, 128), dim=-1)
    within = (k[:, 0] * k[:, 1]).sum(-1).mean()
    across = (k[:-1, 0] * k[1:, 0]).sum(-1).abs().mean()
    assert 0.7 < within < 0.9 and across < 0.15
    assert 0.9 < keys.std() < 1.1 and 0.9 < values.std() < 1.1 and abs(values.mean()) < 0.01


def test_slots_and_claims():
    """Position p of a request is slot ``block_ids[p // bs] * bs + p % bs``; the connector claims
    the prompt's first N - 1 tokens less those already computed."""
    blocks = torch.tensor([5, 2, 9])
    assert rp.slot_mapping(blocks, 4, 0, 12).tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 36, 37, 38, 39]
    assert rp.slot_mapping(blocks, 4, 6, 9).tolist() == [10, 11, 36]
    assert [rp.claimed_tokens(100, c) for c in (0, 64, 99, 100)] == [99, 35, 0, 0]


def test_prefill_refuses_contexts_past_max_context(capsys):
    with pytest.raises(SystemExit):
        main(["--out", "x", "--contexts", "1048576:1", "--prefix", "prefill"])
    assert "--prefix connector" in capsys.readouterr().err


def _run_worker(tmp_path, backend: str, env_extra: dict) -> list[dict]:
    spec = {"backend": backend, "cells": [[CTX, [1, 2]]], "new_tokens": NEW, "budget": BUDGET, "prefix": "connector",
            "prefix_seed": 0}
    rows = run_bench_worker("kvlocks_lab.bench.vllm_tpot", spec, tmp_path, env_extra)
    assert [(r["context"], r["batch"]) for r in rows] == [(CTX, 1), (CTX, 2)]
    for r in rows:
        b = r["batch"]
        assert r["prefix"] == "connector" and r["backend"] == backend
        # first pass: fresh prompts, the whole prefix loaded by the connector, one token computed
        assert r["first_cached_tokens"] == [CTX - 1] * b
        assert r["prefix_loaded_tokens"][0] == b * (CTX - 1)
        if r["external_prefix_cache_hits"] is not None:
            assert r["external_prefix_cache_hits"][0] == b * (CTX - 1)
        # second pass: vLLM's prefix cache holds the loaded full blocks; the connector loads the tail
        assert r["cached_tokens"] == [CTX - 1] * b
        assert r["prefix_loaded_tokens"][1] == b * ((CTX - 1) % BLOCK)
        assert r["prefix_fill_s"][0] > 0
        assert len(r["tpot_ms_per_request"]) == b and all(t > 0 for t in r["tpot_ms_per_request"])
    return rows


def test_connector_prefix_decodes_with_locks(tmp_path):
    """With LOCKS: the loaded pages' summaries are built (all CTX / 16 full pages at the first step
    of each fresh prompt, per layer and request) from the keys the connector wrote (verification:
    no stale summary), and the decode steps select from them."""
    trace = tmp_path / "trace.jsonl"
    _run_worker(tmp_path, "LOCKS", {"KVLOCKS_VLLM_TRACE": str(trace), "KVLOCKS_VLLM_VERIFY": "1"})
    recs = read_trace(trace)
    first = [r for r in recs if r["seq_len"] == CTX]
    assert first and all(r["stale"] == 0 for r in recs)
    for layer in (0, 1):
        built = [r["built"] for r in first if r["layer"] == layer]
        # TTFT pass: 1 + 2 fresh prompts; TPOT pass: the tail block rebuilt, the cached blocks reused
        assert built.count(CTX // 16) == 3, built
        assert built.count((CTX - (CTX - 1) // BLOCK * BLOCK) // 16) == 3, built
    assert any(r["seq_len"] == CTX + NEW - 1 for r in recs)  # decode steps ran the LOCKS path


def test_connector_prefix_decodes_with_stock_attention(tmp_path):
    """The connector writes vLLM's cache through the layer's backend, whichever it is: the stock CPU
    attention (where the GPU bench runs FLASH_ATTN) loads and decodes the same way."""
    _run_worker(tmp_path, "FLASH_ATTN", {})
