"""Budget 256 on a ~4K prompt: the pages the vLLM backend selects, against the PyTorch reference on
the same tensors (exact up to the score kernel's float error) and against kvlocks' own engine on the
same model and precision (bf16: vLLM's and transformers' projections round differently, so near-tied
pages may swap; each swap is measured against the two engines' score differences); and the
CUDA-graph path against the eager path."""

from __future__ import annotations

import statistics

from gpu_helpers import long_text, read_trace, run_engine, run_script, save, tokenize

from kvlocks.config import LocksConfig

STEPS = 8
LAYERS = 30
KERNEL_TOL = 1e-3  # the score kernel matches the reference to rtol 1e-4 (tests/test_kernels.py); ranks ~10


def swap_gap(chosen: list, other: list, rank: list) -> float:
    """How much better, under ``rank``, the best page only in ``other`` is than the worst page only in
    ``chosen``: >= 0 when ``other`` is ``rank``'s top-k (then it is the margin ``chosen`` lost by), 0 for
    equal lists. Pages past the ranked ones (the partial recent page, padding) do not count."""
    a = [rank[p] for p in set(chosen) - set(other) if 0 <= p < len(rank)]
    b = [rank[p] for p in set(other) - set(chosen) if 0 <= p < len(rank)]
    return max(b) - min(a) if a and b else 0.0


def kernel_vs_reference(recs: list) -> dict:
    """The kernels' pages against the PyTorch reference's on the same query and summaries."""
    lists = [(p, r, rank) for rec in recs for p, r, rank in zip(rec["pages"], rec["ref_pages"], rec["ranking"])]
    gaps = [swap_gap(p, r, rank) for p, r, rank in lists if p != r]
    return {"head_lists": len(lists), "identical": len(lists) - len(gaps), "max_gap": max(gaps, default=0.0)}


def engine_vs_vllm(vrecs: dict, erecs: dict, upto: int) -> dict:
    """Per (layer, step) and KV head, for steps before ``upto``: identical lists, page overlap, and for
    each differing list the swap's gap under the engine's ranking next to the two engines' ranking
    difference on that head (RMS over its pages: the numerical noise between them)."""
    keys = sorted(k for k in vrecs if k in erecs and k[1] < upto)
    heads, swaps = 0, []
    jac, same_lists = [], 0
    per_layer = {}
    for k in keys:
        v, e = vrecs[k], erecs[k]
        same_lists += v["pages"] == e["pages"]
        for h, (pv, pe) in enumerate(zip(v["pages"], e["pages"])):
            heads += 1
            jac.append(len(set(pv) & set(pe)) / max(1, len(set(pv) | set(pe))))
            per_layer.setdefault(k[0], [0, 0])[0] += pv == pe
            per_layer[k[0]][1] += 1
            if pv != pe:
                rv, re_ = v["ranking"][h], e["ranking"][h]
                noise = statistics.fmean((x - y) ** 2 for x, y in zip(rv, re_)) ** 0.5
                swaps.append({"layer": k[0], "seq_len": k[1], "head": h, "gap": swap_gap(pv, pe, re_),
                              "noise_rms": noise, "only_vllm": sorted(set(pv) - set(pe)),
                              "only_engine": sorted(set(pe) - set(pv))})
    return {"compared": len(keys), "identical": same_lists, "head_lists": heads,
            "head_lists_identical": heads - len(swaps), "mean_jaccard": statistics.fmean(jac) if jac else 0.0,
            "per_layer_identical": {layer: f"{a}/{b}" for layer, (a, b) in sorted(per_layer.items())},
            "swaps_within_noise": sum(s["gap"] <= 3 * s["noise_rms"] for s in swaps), "swaps": swaps}


def test_budget_256_selection_matches_reference_engine_and_graphs_match_eager(tmp_path):
    ids = tokenize(long_text(215))
    assert 3700 < len(ids) < 4096
    cfg = LocksConfig(budget=256).to_json()
    llm = {"max_model_len": 4200, "enable_prefix_caching": False}
    trace = tmp_path / "trace.jsonl"
    eager = run_engine({"llm": {**llm, "enforce_eager": True}, "prompts": [ids], "max_tokens": STEPS, "locks": cfg},
                       tmp_path, "eager", env={"KVLOCKS_VLLM_TRACE": str(trace), "KVLOCKS_VLLM_VERIFY": "1"})
    graph = run_engine({"llm": llm, "prompts": [ids], "max_tokens": STEPS, "locks": cfg}, tmp_path, "graph",
                       env={"KVLOCKS_VLLM_CHECK": "1"})
    ref = run_script("engine_ref.py", {"prompt_ids": ids, "locks": cfg, "max_tokens": STEPS}, tmp_path, "engine")
    recs = read_trace(trace)
    vrecs = {(r["layer"], r["seq_len"]): r for r in recs}
    erecs = {(r["layer"], r["seq_len"]): r for r in ref["records"]}
    # compare while the two token streams agree: after a different token the contexts differ
    agree = next((i for i, (a, b) in enumerate(zip(eager["tokens"][0], ref["tokens"])) if a != b), STEPS)
    upto = len(ids) + 1 + agree  # seq_len of the first step whose input token differs
    kref = kernel_vs_reference(recs)
    cmp = engine_vs_vllm(vrecs, erecs, upto)
    save(tmp_path, "selection.json", {"eager_tokens": eager["tokens"], "graph_tokens": graph["tokens"],
                                      "engine_tokens": ref["tokens"], "eager_counters": eager["counters"],
                                      "graph_counters": graph["counters"], "agree_steps": agree,
                                      "kernel_vs_reference": kref, "engine_vs_vllm": cmp})
    # the vLLM backend's own checks
    assert len(vrecs) == LAYERS * (STEPS - 1) and all(len(p) == 16 for r in recs for p in r["pages"])
    assert eager["counters"]["stale_used"] == 0 and eager["counters"]["tag_mismatches"] == 0
    # the kernels select what the reference selects on vLLM's own tensors, but for float near-ties
    assert kref["max_gap"] <= KERNEL_TOL and kref["identical"] >= 0.99 * kref["head_lists"], kref
    # CUDA graphs: every decode step of every layer ran the captured LOCKS path, with valid tags,
    # and gave the eager path's tokens
    g = graph["counters"]
    assert g["locks_rows"] == LAYERS * (STEPS - 1) and g["tag_mismatches"] == 0, g
    assert graph["tokens"] == eager["tokens"]
    # against kvlocks' engine: the tokens agree for several steps; the lists agree at layer 0 (the
    # keys differ only by the two projections' rounding) and drift deeper, as the two models' bf16
    # hidden states do; the pages that swap are near-ties: their gap under the engine's own ranking
    # is within 3x the RMS difference between the two engines' rankings on that head. Measured on
    # the H200 (docs/results/2026-12-04-h200-vllm-cuda-tests): layer 0 14 of 15 lists identical,
    # mean Jaccard 0.89, 282 of 301 swaps within the noise, the largest gap 0.016 (shares in [0, 1])
    assert agree >= 4, f"tokens diverge at step {agree}: vLLM {eager['tokens'][0]} engine {ref['tokens']}"
    summary = {k: v for k, v in cmp.items() if k != "swaps"}
    first_layer = [k for k in vrecs if k[0] == 0 and k[1] < upto]
    assert sum(vrecs[k]["pages"] == erecs[k]["pages"] for k in first_layer) >= 0.8 * len(first_layer), summary
    assert cmp["mean_jaccard"] >= 0.85, summary
    assert cmp["swaps_within_noise"] >= 0.9 * len(cmp["swaps"]), summary
    assert max(s["gap"] for s in cmp["swaps"]) <= 0.05, summary
