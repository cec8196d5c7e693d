"""kvlocks bench e2e on the CPU: its rows, its launch record, and a recompile-limit case."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=512)


def test_bench_e2e_makes_an_eager_fallback_an_error_of_its_case(tmp_path):
    """A compiled piece that reaches Dynamo's recompile limit would run eagerly and make its rows
    slow for a reason the table does not show. The bench raises the limit (E2EBenchConfig's
    recompile_limit, 64 by default) and turns reaching it into an error of that case: with the limit
    at 1, the batch-1 case compiles and measures, the batch-2 case (new shapes) is an error naming
    the limit, and no row of it is kept."""
    import torch._dynamo

    from kvlocks_lab.bench.e2e import E2EBenchConfig, run_e2e_bench

    assert E2EBenchConfig().recompile_limit == 64
    torch._dynamo.reset()
    tiny = {**TINY, "vocab_size": 1000, "num_hidden_layers": 1}
    cfg = E2EBenchConfig(models=("llama3.1-8b",), contexts=(64,), batches=(1, 2), batch_context=64, budget=32,
                         steps=3, warmup=1, max_prefill=0, methods=("dense",), compile=True, model_overrides=tiny,
                         recompile_limit=1)
    summary = run_e2e_bench(tmp_path, cfg, device="cpu")
    torch._dynamo.reset()
    assert [(r["batch"], r["method"]) for r in summary["rows"]] == [(1, "dense")]
    assert len(summary["errors"]) == 1 and summary["errors"][0]["batch"] == 2
    assert "limit" in summary["errors"][0]["error"].lower()
    assert summary["dynamo"] == {"recompile_limit": 1, "fail_on_recompile_limit_hit": True}
    import torch._dynamo.config as dc

    assert dc.recompile_limit == 8 and not dc.fail_on_recompile_limit_hit  # restored after the run


def test_bench_e2e_rows_on_cpu(tmp_path):
    from kvlocks_lab.bench.e2e import ROW_KEYS, E2EBenchConfig, run_e2e_bench

    tiny = {**TINY, "vocab_size": 1000}
    cfg = E2EBenchConfig(models=("glm4-9b-1m",), contexts=(64, 128), batches=(1, 2), batch_context=64, budget=32,
                         steps=3, warmup=1, max_prefill=100, model_overrides=tiny)
    summary = run_e2e_bench(tmp_path, cfg, device="cpu")
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["rows"] == summary["rows"] and summary["errors"] == []
    assert {"config", "device", "versions", "copy_gbps", "rows", "errors"} <= set(summary)
    # how the kernels were launched, so rows made under other settings cannot pass for these: no PDL
    # and the default compile mode on the CPU
    assert summary["launch"] == {"pdl": False, "inductor_pdl": False,
                                 "compile_mode": "max-autotune-no-cudagraphs", "compile_mode_max_batch": 1}
    assert summary["config"]["kernels"]["score_kernel"] == "auto"  # the KernelOptions the run used
    rows = summary["rows"]
    assert all(r["compiled"] and r["compile_mode"] is None for r in rows)
    assert [(r["context"], r["batch"], r["method"]) for r in rows] == [
        (64, 1, "dense"), (64, 1, "locks"), (128, 1, "dense"), (128, 1, "locks"), (64, 2, "dense"), (64, 2, "locks")]
    for r in rows:
        assert set(ROW_KEYS) <= set(r) and r["tpot_ms"] > 0 and r["floor_ms"] > 0
        assert r["tpot_p10_ms"] <= r["tpot_ms"] <= r["tpot_max_ms"] and r["tpot_mean_ms"] <= r["tpot_max_ms"]
        assert r["bytes_per_step"] == r["weight_bytes"] + r["kv_bytes"] + r["summary_bytes"]
        assert (r["ttft_ms"] is not None) == (r["fill"] == "prefill") == (r["context"] * r["batch"] <= 100)
        assert (r["build_ms"] is not None) == (r["method"] == "locks")
        overlapped = r["method"] == "locks" and r["fill"] == "prefill"
        assert (r["ready_ms"] is not None) == (r["build_exposed_ms"] is not None) == overlapped
        if overlapped:
            assert r["ready_ms"] >= r["ttft_ms"] > 0 and "built during it" in r["ttft_note"]
        if r["fill"] == "prefill":  # the median of 3 runs of each prefill (default ttft_repeats)
            assert len(r["ttft_runs_ms"]) == 3 and r["ttft_ms"] == sorted(r["ttft_runs_ms"])[1]
    dense, locks = rows[2], rows[3]
    assert locks["kv_bytes"] == dense["kv_bytes"] // 4  # 2 of 8 pages of K/V
    assert locks["summary_bytes"] == 2 * 2 * 8 * 498  # layers x KV heads x pages x bytes per (page, head) at D = 64
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == len(rows)


def test_bench_e2e_locks_centroid_rows_count_centroids_and_candidate_keys(tmp_path):
    """locks_centroid decodes with the centroid first stage (the plan's config says so) and counts
    per layer and KV head 8 pages x (D + 2) centroid bytes plus 4 candidate pages of bf16 keys
    (max(2 x 1 free slot, 0) + sink + recent), beside the same 2 pages of K/V as locks."""
    from kvlocks_lab.bench.e2e import E2EBenchConfig, run_e2e_bench

    cfg = E2EBenchConfig(models=("glm4-9b-1m",), contexts=(128,), batches=(1,), batch_context=128, budget=32,
                         steps=3, warmup=1, max_prefill=0, compile=False, methods=("dense", "locks", "locks_centroid"),
                         centroid_rerank=2, centroid_min=0, model_overrides={**TINY, "vocab_size": 1000})
    rows = run_e2e_bench(tmp_path, cfg, device="cpu")["rows"]
    assert [r["method"] for r in rows] == ["dense", "locks", "locks_centroid"]
    locks, cen = rows[1], rows[2]
    assert cen["kv_bytes"] == locks["kv_bytes"] and cen["budget"] == 32 and cen["tpot_ms"] > 0
    assert (locks["rerank_scores"], cen["rerank_scores"]) == ("summary", "centroid")  # the plans that ran
    assert cen["summary_bytes"] == 2 * 2 * (8 * (64 + 2) + 4 * 16 * 64 * 2)
    with pytest.raises(ValueError, match="locks_centroid"):
        E2EBenchConfig(methods=("dense", "centroid"))
