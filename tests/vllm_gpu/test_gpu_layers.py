"""Hybrid sliding-window and sink models in vLLM 0.26 (tiny random-weight checkpoints written by
``tiny_models.py``): window layers stay FlashAttention, global layers run LOCKS, with their
summaries only; learned sinks enter LOCKS's softmax exactly. At budget >= context LOCKS gives
FLASH_ATTN's greedy tokens up to near-ties; at a small budget the LOCKS rows run with valid tags;
the kernels select what the PyTorch reference selects on vLLM's own tensors (an eager, traced run);
strict mode accepts the window layers; the one layer table counts each kind."""

from __future__ import annotations

import random

from gpu_helpers import read_trace, run_engine, save
from test_gpu_budget import NEAR_TIE, first_differences
from test_gpu_selection import KERNEL_TOL, kernel_vs_reference
from tiny_models import VOCAB, gemma3_like, gpt_oss_like

from kvlocks.config import LocksConfig

LLM = {"max_model_len": 4096, "skip_tokenizer_init": True}


def _prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(n)] for n in lengths]


def _table(log: str) -> str:
    lines = [line for line in log.splitlines() if "kvlocks: attention layers" in line]
    assert len(lines) == 1, lines  # one table per engine
    return lines[0]


def _compare(tmp_path, name: str, model: str, n_layers: int, n_locks: int) -> dict:
    prompts = _prompts((700, 1500, 2300), seed=n_layers)
    spec = {"model": model, "llm": LLM, "prompts": prompts, "max_tokens": 24, "batches": [[0], [1, 2]],
            "logprobs": 5}
    stock = run_engine(spec, tmp_path, f"{name}_stock")
    dense = run_engine({**spec, "locks": LocksConfig(budget=4096).to_json(), "strict": True}, tmp_path,
                       f"{name}_locks_dense", env={"KVLOCKS_VLLM_CHECK": "1"})
    sparse = run_engine({**spec, "locks": LocksConfig(budget=256).to_json(), "strict": True}, tmp_path,
                        f"{name}_locks_256", env={"KVLOCKS_VLLM_CHECK": "1"})
    trace = tmp_path / f"{name}_trace.jsonl"  # eager: every LOCKS row's pages and the reference's
    run_engine({**spec, "llm": {**LLM, "enforce_eager": True}, "batches": [[2]], "max_tokens": 4,
                "locks": LocksConfig(budget=256).to_json()}, tmp_path, f"{name}_locks_256_traced",
               env={"KVLOCKS_VLLM_TRACE": str(trace)})
    recs = read_trace(trace)
    diffs = first_differences(stock["tokens"], dense["tokens"], stock["logprobs"], dense["logprobs"])
    res = {"stock": stock, "dense": dense, "sparse": sparse, "differences": diffs,
           "table": _table((tmp_path / f"{name}_locks_256.log").read_text()),
           "kernel_vs_reference": kernel_vs_reference(recs), "traced_layers": sorted({r["layer"] for r in recs})}
    save(tmp_path, f"{name}.json", res)
    for d in diffs:
        assert d["margin_a"] is not None and d["margin_b"] is not None and \
            abs(d["margin_a"]) <= NEAR_TIE and abs(d["margin_b"]) <= NEAR_TIE, d
    assert res["table"].endswith(f"({n_layers}): {n_locks} LOCKS, {n_layers - n_locks} by design, 0 fallback"), res
    c = dense["counters"]
    assert c["layers"] == n_locks and c["locks_rows"] == 0 and c["tag_mismatches"] == 0, c  # summaries: global only
    c = sparse["counters"]
    assert c["layers"] == n_locks and c["locks_rows"] > 0 and c["tag_mismatches"] == 0, c
    kref = res["kernel_vs_reference"]  # the 2,300-token prompt, 3 decode steps traced, global layers only
    assert len(res["traced_layers"]) == n_locks and kref["head_lists"] > 0, res["traced_layers"]
    assert kref["max_gap"] <= KERNEL_TOL and kref["identical"] >= 0.99 * kref["head_lists"], kref
    return res


def test_gemma3_like_window_layers_dense_global_layers_locks(tmp_path):
    """12 layers (windows of 128 tokens around global layers 5 and 11), head_dim 256."""
    model, glob = gemma3_like(tmp_path / "gemma3_like")
    _compare(tmp_path, "gemma3", str(model), 12, len(glob))


def test_gpt_oss_like_sinks_enter_the_softmax(tmp_path):
    """4 layers alternating 128-token windows (even) and global layers (odd), sinks 3-7 nats on
    every head: at budget >= context the global layers' sink-corrected attention (kvlocks' split-KV
    kernel, then out * sigmoid(lse - sink)) matches FlashAttention's own sink handling."""
    model = gpt_oss_like(tmp_path / "gpt_oss_like")
    _compare(tmp_path, "gpt_oss", str(model), 4, 2)
    assert "with learned sinks" in (tmp_path / "gpt_oss_locks_256.log").read_text()
