"""The kvlocks KV connector on the GPU: a folded cache file continues in vLLM (bf16) as in the Hugging
Face path (float32, teacher-forced on vLLM's tokens to tell bf16 near-ties from errors)."""

from __future__ import annotations

from gpu_helpers import GPU_LLM, HERE, long_text, run_script, save

from kvlocks.config import LocksConfig

MAX_TOKENS = 16
NEAR_TIE = 0.5  # logits: bf16 rounding in a 30-layer model moves logits by tenths
Q1 = " Question: what is the code word for box 12? Answer:"
Q2 = " Question: which box has the code word maple? Answer:"


def _doc(items: int, seed: int) -> str:
    return long_text(items, seed=seed).split(" Question:")[0]


def test_folded_cache_gives_hf_path_tokens_on_the_gpu(tmp_path):
    files = tmp_path / "caches"
    files.mkdir()
    # the files, made as a user's `kvlocks compact` makes them (float32; the CPU suite's helper)
    made = run_script("compact_ref.py", {
        "dir": str(files), "max_tokens": MAX_TOKENS, "questions": [Q1, Q2],
        "docs": [{"name": "a", "text": _doc(20, 0), "method": "fold", "t": 48},
                 {"name": "b", "text": _doc(14, 5), "method": "drop_refit", "t": 40}]},
        tmp_path, "compact", where=HERE.parent / "vllm")
    docs, qs = made["docs"], made["questions"]
    batch1 = [{"id": "a1", "file": docs["a"]["path"], "new": qs[Q1]}, {"id": "b1", "file": docs["b"]["path"], "new": qs[Q1]}]
    batch2 = [{"id": "a2", "file": docs["a"]["path"], "new": qs[Q2]}, {"id": "a1_again", "file": docs["a"]["path"], "new": qs[Q1]},
              {"id": "b2", "file": docs["b"]["path"], "new": qs[Q2]}]
    spec = {"llm": {"dtype": "bfloat16", "max_model_len": 1024, **GPU_LLM}, "cache_dir": str(files),
            "max_tokens": MAX_TOKENS, "batches": [batch1, batch2]}
    stock = run_script("connector_gpu.py", spec, tmp_path, "stock")["results"]
    # with the LOCKS backend too (budget 32: 2 pages, so LOCKS decodes these ~80-token contexts):
    # the pages the connector wrote are built at once and their tags hold
    locks = run_script("connector_gpu.py", {**spec, "locks": LocksConfig(budget=32).to_json()}, tmp_path, "locks",
                       env={"KVLOCKS_VLLM_CHECK": "1", "KVLOCKS_VLLM_VERIFY": "1"})
    # the HF path (float32, CPU) gave its greedy tokens with the files (compact_ref.py); on the GPU it
    # is teacher-forced on vLLM's tokens, which tells where vLLM's bf16 took a near-tied token
    check = {r["id"]: {**r, "tokens": stock[r["id"]]["tokens"]} for r in batch1 + batch2}
    forced = run_script("connector_ref.py", {"files": {}, "questions": {}, "check": check}, tmp_path, "hf")["check"]
    want = {"a1": "a|" + Q1, "b1": "b|" + Q1, "a2": "a|" + Q2, "a1_again": "a|" + Q1, "b2": "b|" + Q2}
    exact = {rid: stock[rid]["tokens"] == made["hf"][key] for rid, key in want.items()}
    save(tmp_path, "connector.json", {"hf": made["hf"], "stock": stock, "locks": locks, "forced": forced,
                                      "exact": exact})
    for rid, key in want.items():
        got, hf = stock[rid]["tokens"], forced[rid]
        agree = sum(a == b for a, b in zip(got, hf["argmax"]))
        assert exact[rid] or (agree >= len(got) - 2 and max(hf["margin"]) <= NEAR_TIE), (rid, got, made["hf"][key], hf)
    # each file gives the HF path's tokens exactly for at least one request (the others differ only
    # at near-ties: bf16 against float32)
    assert any(exact[r] for r in ("a1", "a2", "a1_again")) and any(exact[r] for r in ("b1", "b2")), exact
    assert stock["a1_again"]["tokens"] == stock["a1"]["tokens"]
    assert stock["a1_again"]["num_cached_tokens"] >= 32  # the placeholder blocks came from the prefix cache
    c = locks["counters"]
    assert c["locks_rows"] > 0 and c["tag_mismatches"] == 0 and c["stale_used"] == 0, c
    assert all(locks["results"][rid]["finish"] != "error" for rid in want)
