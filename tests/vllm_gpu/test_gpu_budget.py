"""Budget >= context: the LOCKS backend is vLLM's FlashAttention, token for token (bf16, CUDA graphs)."""

from __future__ import annotations

from gpu_helpers import long_text, run_engine, save, tokenize

from kvlocks.config import LocksConfig


def test_budget_covering_context_gives_flash_attention_tokens(tmp_path):
    """Five prompts of 90 to 1800 tokens: one alone (batch 1), four together (batch 4, different
    lengths), decoded in vLLM's full CUDA graphs. Stock FLASH_ATTN and the LOCKS backend with
    budget 2048 (every page fits: FlashAttention runs every row, kvlocks' kernels attend none)
    give identical greedy tokens, and no row took the LOCKS path."""
    prompts = [tokenize(long_text(n, seed=i)) for i, n in enumerate((5, 30, 55, 105, 70))]
    assert max(len(p) for p in prompts) + 32 <= 2048
    spec = {"llm": {"max_model_len": 2304}, "prompts": prompts, "max_tokens": 32, "batches": [[4], [0, 1, 2, 3]]}
    stock = run_engine(spec, tmp_path, "stock")
    locks = run_engine({**spec, "locks": LocksConfig(budget=2048).to_json()}, tmp_path, "locks",
                       env={"KVLOCKS_VLLM_CHECK": "1"})
    save(tmp_path, "budget.json", {"stock": stock, "locks": locks})
    assert locks["tokens"] == stock["tokens"]
    c = locks["counters"]
    assert c["layers"] == 30 and c["locks_rows"] == 0 and c["tag_mismatches"] == 0, c
