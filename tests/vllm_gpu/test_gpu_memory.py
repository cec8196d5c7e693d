"""LOCKS's memory inside vLLM's budget at ``gpu_memory_utilization`` 0.95, the pool filled by long
requests (Llama-3.1-8B shape, random weights: 128 KiB of K/V per token; 12K-token requests worth 1.3 pools,
sent at once, fill it; those that do not fit wait for free blocks).

Runs alone (it takes 95 % of the GPU): ``bash scripts/gpu/vllm_tests.sh OUT 1
tests/vllm_gpu/test_gpu_memory.py``. Stock vLLM first, then the LOCKS engine, both serving the same
requests (the memory in use under load includes the activations and allocator caching of long
prefills, which a lightly loaded engine never reaches): no out-of-memory error, no more device
memory in use than stock under that load, a pool smaller by the summaries' share and the plans
(within 3 % of the prediction), and the log line with the pool in tokens with and without LOCKS. Both engines record where their
memory grew (``memory_probe.py``), saved in ``memory.json``."""

from __future__ import annotations

import os
import random
import re

import pytest
import torch
from gpu_helpers import HERE, run_engine, save

from kvlocks.config import LocksConfig
from kvlocks.integrations.vllm.cuda import memory

MODEL = HERE.parents[1] / "lab" / "src" / "kvlocks_lab" / "bench" / "configs" / "llama3.1-8b"
LLM = {"gpu_memory_utilization": 0.95, "kv_cache_memory_bytes": None, "max_model_len": 16384, "max_num_seqs": 64,
       "load_format": "dummy", "skip_tokenizer_init": True,
       "compilation_config": {"cudagraph_capture_sizes": [1, 8, 32, 64]}}
CONFIG = LocksConfig(budget=2048)


def _blocks(res: dict, log_path) -> int:
    """The engine's pool in 16-token blocks: from its config, else from vLLM's start-up line."""
    if res.get("num_gpu_blocks"):
        return int(res["num_gpu_blocks"])
    m = re.search(r"GPU KV cache size: ([\d,]+) tokens", log_path.read_text())
    assert m, f"no pool size in {log_path}"
    return int(m.group(1).replace(",", "")) // 16


@pytest.mark.skipif(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1,
                    reason="takes 95 % of the GPU: run it alone "
                           "(vllm_tests.sh OUT 1 tests/vllm_gpu/test_gpu_memory.py)")
def test_pool_at_095_counts_lockS_memory(tmp_path):
    rng = random.Random(0)
    # 1.3 pools of 12K-token requests, both engines the same: the pool is 0.95 of the card less the
    # weights (16.1 GB) and vLLM's activation peak (~2 GB), ~29,800 blocks on an 80 GB H100
    pool = int(0.95 * torch.cuda.get_device_properties(0).total_memory) - 18 * 10**9
    n = max(1, min(128, -(-pool * 13 // 10 // (12000 * 128 * 1024))))
    fill = [[rng.randrange(10, 120000) for _ in range(12000)] for _ in range(n)]
    stock = run_engine({"model": str(MODEL), "llm": LLM, "prompts": fill, "max_tokens": 8, "memory_probe": True},
                       tmp_path, "stock")
    stock["num_gpu_blocks"] = _blocks(stock, tmp_path / "stock.log")
    locks = run_engine({"model": str(MODEL), "llm": LLM, "prompts": fill, "max_tokens": 8, "memory_probe": True,
                        "locks": CONFIG.to_json()}, tmp_path, "locks")
    locks["num_gpu_blocks"] = _blocks(locks, tmp_path / "locks.log")
    log = (tmp_path / "locks.log").read_text()
    pool_lines = [line for line in log.splitlines() if "the KV pool holds" in line]
    mb = memory.model_bytes(CONFIG, [(True, 8, 128, 2)] * 32, hybrid=False)
    predicted = stock["num_gpu_blocks"] / (1 + mb.rho)
    res = {"stock_blocks": stock["num_gpu_blocks"], "locks_blocks": locks["num_gpu_blocks"],
           "predicted_blocks_without_plans": predicted, "rho": mb.rho, "stock_memory": stock["memory"],
           "locks_memory": locks["memory"], "preemptions": locks["preemptions"], "pool_lines": pool_lines,
           "share": 0.95 * stock["memory"]["total"], "requests": n}
    save(tmp_path, "memory.json", res)
    assert pool_lines, log[-3000:]
    assert all(len(t) == 8 for t in locks["tokens"]) and all(len(t) == 8 for t in stock["tokens"])
    assert locks["memory"]["used"] <= stock["memory"]["used"] + (256 << 20), res
    assert locks["num_gpu_blocks"] <= predicted * 1.001, res  # the summaries' share left the pool
    assert locks["num_gpu_blocks"] >= predicted * 0.97 - (2 << 30) / mb.kv_per_block, res  # plans: <= 2 GiB
